"""What ``/shared`` is on this machine and what the machine can do with it, for ``shared`` (shared.py):
the mounts read from ``/proc/self/mountinfo``, the agent's record of what it made, and whether NFS or
sshfs is installed. ``Machine`` holds where each thing is: the machine's root (``FADEN_NODE_FILES_ROOT``
in tests), ``/proc`` (``FADEN_SHARED_PROC``) and where programs are looked for (``FADEN_SHARED_PATH``).
"""

import errno
import json
import os
import pwd
import shutil
import subprocess
import tempfile

from .nodeedit import Root, ensure_dir, put, read

SHARED = "/shared"
RECORD = "/etc/fadenstack/shared.json"
ENV_PROC, ENV_PATH = "FADEN_SHARED_PROC", "FADEN_SHARED_PATH"
SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TIMEOUT = 60  # seconds a program may take (a mount of a head that does not answer gives up sooner)
# Mounts on /shared that are another network file system than ours: never mounted over or taken away.
FOREIGN_TYPES = ("cifs", "smb3", "ceph", "glusterfs", "9p", "virtiofs")


# ------------------------------------------------------------------ what is mounted


def _unescape(field: str) -> str:
    # mountinfo writes a space, tab, newline and backslash as octal escapes (\040 ...)
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_at(mountinfo: str, path: str):
    """The topmost mount on ``path`` in ``/proc/self/mountinfo``'s text: ``{"fstype", "source", "options"}``
    (``options``: the mount's own flags, ``nosuid``, ``nodev`` ...), or None."""
    found = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:] or len(fields) < 10:
            continue
        dash = fields.index("-", 6)
        if _unescape(fields[4]) == path and len(fields) > dash + 2:
            found = {"fstype": fields[dash + 1], "source": _unescape(fields[dash + 2]), "options": fields[5].split(",")}
    return found


def method_of(fstype: str):
    """``nfs`` or ``sshfs`` for a mount's file system type; None for any other."""
    if fstype in ("nfs", "nfs4"):
        return "nfs"
    return "sshfs" if fstype == "fuse.sshfs" else None


def is_network(fstype: str) -> bool:
    """Whether a mount on /shared is a network file system (ours or another); a disk's, or a bind of a
    directory (each lab machine's own /shared), is the machine's local /shared."""
    return method_of(fstype) is not None or fstype.startswith("fuse") or fstype in FOREIGN_TYPES


def root_home() -> str:
    try:
        return pwd.getpwnam("root").pw_dir or "/root"
    except KeyError:
        return "/root"


class Machine:
    """This machine as the commands see it: its root (a test's directory), /proc and its programs."""

    def __init__(self):
        self.root = Root.from_env()
        self.proc = os.environ.get(ENV_PROC) or "/proc"
        self.search = os.environ.get(ENV_PATH) or "%s:%s" % (os.environ.get("PATH", ""), SEARCH_PATH)

    def real(self, path: str) -> str:
        return self.root.real(path)

    def program(self, name: str):
        return shutil.which(name, path=self.search)

    def proc_text(self, name: str) -> str:
        try:
            with open(os.path.join(self.proc, name)) as fh:
                return fh.read()
        except OSError:
            return ""

    def mount(self):
        """The network file system mounted on /shared (None: /shared is local), with ``alive``: whether it
        answers (a dead FUSE mount does not) and ``method`` (None for one that is not ours)."""
        found = mount_at(self.proc_text("self/mountinfo"), self.real(SHARED))
        if found is None or not is_network(found["fstype"]):
            return None
        found["method"], found["alive"], found["error"] = method_of(found["fstype"]), True, None
        try:
            os.stat(self.real(SHARED))
        except OSError as exc:
            found["alive"], found["error"] = False, "%s (%s)" % (os.strerror(exc.errno), errno.errorcode.get(exc.errno, exc.errno))
        return found

    def record(self) -> dict:
        data = read(self.real(RECORD))[0]
        try:
            return json.loads(data.decode("utf-8")) if data else {}
        except ValueError:
            return {}

    def save_record(self, record) -> None:
        if record is None:
            put(self.real(RECORD), None, 0o644)
            return
        ensure_dir(self.root, os.path.dirname(RECORD), 0o755, [])
        put(self.real(RECORD), (json.dumps(record, sort_keys=True) + "\n").encode("utf-8"), 0o644)

    def run(self, argv: list, new_session: bool = False):
        """``(exit status, its words)``. Output goes to a file, not a pipe: sshfs leaves a daemon and its
        ssh behind, which would hold a pipe open; in a session of their own they outlive this command."""
        with tempfile.TemporaryFile() as out:
            try:
                proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=TIMEOUT,
                                      start_new_session=new_session)
            except subprocess.TimeoutExpired:
                return None, "%s did not end within %d s" % (os.path.basename(argv[0]), TIMEOUT)
            except OSError as exc:
                return None, "%s: %s" % (argv[0], exc.strerror)
            out.seek(0)
            words = " ".join(out.read().decode("utf-8", "replace").split())
        return proc.returncode, words[-600:]


# ------------------------------------------------------------------ what this machine can do


def abilities(machine: Machine) -> tuple:
    """``(can, cannot)``: for ``nfs_export``, ``nfs_mount`` and ``sshfs``, whether this machine can,
    and the reason in words where it cannot."""
    cannot = {}
    threads = machine.proc_text("fs/nfsd/threads").strip()
    if not machine.program("exportfs"):
        cannot["nfs_export"] = "exportfs is not installed (apt-get install nfs-kernel-server)"
    elif "nfsd" not in machine.proc_text("filesystems").split():
        cannot["nfs_export"] = "this kernel has no NFS server (no nfsd in /proc/filesystems)"
    elif not threads.isdigit() or int(threads) == 0:
        cannot["nfs_export"] = "the NFS server is not running (no nfsd threads: systemctl start nfs-server)"
    if not machine.program("mount.nfs"):
        cannot["nfs_mount"] = "mount.nfs is not installed (apt-get install nfs-common)"
    if not machine.program("sshfs"):
        cannot["sshfs"] = "sshfs is not installed (apt-get install sshfs)"
    elif not (machine.program("fusermount3") or machine.program("fusermount")):
        cannot["sshfs"] = "fusermount is not installed (apt-get install fuse3)"
    elif not os.path.exists(machine.real("/dev/fuse")):
        cannot["sshfs"] = "this machine has no /dev/fuse (FUSE is off in its kernel or its container)"
    can = {name: name not in cannot for name in ("nfs_export", "nfs_mount", "sshfs")}
    return can, cannot

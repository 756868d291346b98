"""``shared export|mount|unmount|status``: the real agent as a subprocess on a pretend machine (a temporary
``/`` through FADEN_NODE_FILES_ROOT), with stand-ins for mount, umount, sshfs, fusermount3 and exportfs
that record their argv and edit a pretend /proc/self/mountinfo (FADEN_SHARED_PROC); and, where this
host has sshd, sshfs and /dev/fuse, a real sshfs mount over loopback SSH."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from fadenstack_agent.shared import exports_text
from fadenstack_agent.sharedmounts import mount_at
from tests.agent.imagehelpers import AGENT_DIR, PYTHON
from tests.processes import free_port

# The stand-in for every program: records its argv, and mounts or unmounts in the pretend mountinfo.
# FAKE_FAIL: the words it fails with (exit 1); FAKE_BUSY: umount and fusermount fail unless lazy.
FAKE_PROGRAM = r'''
import json, os, sys
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps([name] + args) + "\n")
fail = os.environ.get("FAKE_FAIL_" + name.replace(".", "_").upper())
if fail:
    sys.stderr.write(fail + "\n")
    sys.exit(1)
info = os.environ["FADEN_SHARED_PROC"] + "/self/mountinfo"
lines = open(info).read().splitlines()
if name in ("umount", "fusermount3"):
    lazy = "-l" in args or "-z" in args
    if os.environ.get("FAKE_BUSY") and not lazy:
        sys.stderr.write("umount: %s: target is busy.\n" % args[-1])
        sys.exit(32)
    kept = [l for l in lines if l.split()[4] != args[-1]]
    open(info, "w").write("".join(l + "\n" for l in kept))
elif name in ("sshfs", "mount"):
    if name == "sshfs":
        source, point, fstype = args[0], args[1], "fuse.sshfs"
    else:
        source, point, fstype = args[-2], args[-1], "nfs4"
    flags = "rw,nosuid,nodev,relatime" if "nosuid" in ",".join(args) and "nodev" in ",".join(args) else "rw,relatime"
    open(info, "a").write("300 29 0:77 / %s %s - %s %s rw\n" % (point, flags, fstype, source))
'''
PROGRAMS = ("mount", "umount", "sshfs", "fusermount3", "exportfs", "mount.nfs")
HOSTFILE = "198.18.1.10 slots=2\n198.18.1.11 slots=2\n"


class Machine:
    """A pretend machine with the given programs installed (all of them by default)."""

    def __init__(self, tmp_path, programs=PROGRAMS, nfsd_threads=None):
        self.root, self.bin, self.proc = tmp_path / "machine", tmp_path / "bin", tmp_path / "proc"
        self.log = tmp_path / "programs.log"
        for directory in (self.root / "dev", self.bin, self.proc / "self", self.proc / "fs" / "nfsd"):
            directory.mkdir(parents=True)
        (self.root / "dev" / "fuse").write_text("")
        (self.proc / "self" / "mountinfo").write_text("22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n")
        (self.proc / "filesystems").write_text("nodev\tsysfs\nnodev\tfuse\n\text4\n" + ("nodev\tnfsd\n" if nfsd_threads is not None else ""))
        if nfsd_threads is not None:
            (self.proc / "fs" / "nfsd" / "threads").write_text("%d\n" % nfsd_threads)
        for name in programs:
            (self.bin / name).write_text("#!%s\n%s" % (PYTHON, FAKE_PROGRAM))
            (self.bin / name).chmod(0o755)
        self.env = dict(os.environ, PYTHONPATH=AGENT_DIR, PYTHONDONTWRITEBYTECODE="1", FADEN_NODE_FILES_ROOT=str(self.root),
                        FADEN_SHARED_PROC=str(self.proc), FADEN_SHARED_PATH=str(self.bin), FAKE_LOG=str(self.log))

    def file(self, path: str):
        return self.root / path.lstrip("/")

    def run(self, *words, **env):
        proc = subprocess.run([PYTHON, "-m", "fadenstack_agent", "shared", *words], capture_output=True, timeout=60,
                              env=dict(self.env, **env))
        events = [json.loads(line) for line in proc.stdout.decode().splitlines()]
        assert events and events[-1]["event"] in ("result", "error") and not proc.stderr, proc
        return proc.returncode, events

    def ok(self, *words, **env) -> dict:
        code, events = self.run(*words, **env)
        assert code == 0, events[-1]
        return events[-1]

    def programs_run(self) -> list:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def mounts(self) -> str:
        return (self.proc / "self" / "mountinfo").read_text()

    def mounted(self, fstype: str, source: str) -> None:
        """Something already mounted on /shared, as a mount another run or a person made."""
        with open(self.proc / "self" / "mountinfo", "a") as fh:
            fh.write("200 29 0:60 / %s rw - %s %s rw\n" % (self.file("/shared"), fstype, source))


@pytest.fixture
def machine(tmp_path):
    return Machine(tmp_path)


def test_the_export_names_each_member_address_on_a_line_of_its_own_with_root_squash():
    text = exports_text(["198.18.1.12", "198.18.1.13", "fd00::12"]).decode()

    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == ["/shared 198.18.1.12(rw,sync,no_subtree_check,root_squash)",
                     "/shared 198.18.1.13(rw,sync,no_subtree_check,root_squash)",
                     "/shared fd00::12(rw,sync,no_subtree_check,root_squash)"]
    assert "no_root_squash" not in text and "*" not in text and "/24" not in text


def test_mountinfo_gives_the_topmost_mount_on_the_path_with_its_escapes_read():
    text = ("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
            "40 22 8:1 /srv/shared /shared rw shared:5 - ext4 /dev/sda1 rw\n"
            "45 40 0:40 / /shared rw,nosuid,nodev - fuse.sshfs root@198.18.1.10:/shared rw,user_id=0\n"
            "46 22 0:41 / /my\\040files rw - nfs4 10.0.0.2:/a\\040b rw\n")
    assert mount_at(text, "/shared") == {"fstype": "fuse.sshfs", "source": "root@198.18.1.10:/shared",
                                         "options": ["rw", "nosuid", "nodev"]}
    assert mount_at(text, "/my files") == {"fstype": "nfs4", "source": "10.0.0.2:/a b", "options": ["rw"]}
    assert mount_at(text, "/nowhere") is None


def test_status_says_what_this_machine_can_do_and_why_not(tmp_path):
    machine = Machine(tmp_path, programs=("mount", "umount", "sshfs"))

    status = machine.ok("status")

    assert status["mounted"] is False and status["role"] is None
    assert status["can"] == {"nfs_export": False, "nfs_mount": False, "sshfs": False}
    assert status["cannot"] == {"nfs_export": "exportfs is not installed (apt-get install nfs-kernel-server)",
                                "nfs_mount": "mount.nfs is not installed (apt-get install nfs-common)",
                                "sshfs": "fusermount is not installed (apt-get install fuse3)"}


def test_status_can_export_nfs_only_when_the_kernel_runs_an_nfs_server(tmp_path):
    assert Machine(tmp_path / "a", nfsd_threads=8).ok("status")["can"] == {"nfs_export": True, "nfs_mount": True, "sshfs": True}
    stopped = Machine(tmp_path / "b", nfsd_threads=0).ok("status")
    assert stopped["cannot"]["nfs_export"].startswith("the NFS server is not running")
    assert Machine(tmp_path / "c").ok("status")["cannot"]["nfs_export"].startswith("this kernel has no NFS server")


def test_status_without_dev_fuse_cannot_use_sshfs(machine):
    (machine.root / "dev" / "fuse").unlink()

    assert machine.ok("status")["cannot"]["sshfs"].startswith("this machine has no /dev/fuse")


def test_export_with_sshfs_makes_shared_1777_and_copies_the_hostfile_exporting_nothing(machine):
    machine.file("/etc/fadenstack").mkdir(parents=True)
    machine.file("/etc/fadenstack/hostfile").write_text(HOSTFILE)

    result = machine.ok("export", "--method", "sshfs")

    assert result == {"event": "result", "path": "/shared", "method": "sshfs", "created": True,
                      "hostfile": "/shared/hostfile", "exported": False, "changed": True}
    assert os.stat(machine.file("/shared")).st_mode & 0o7777 == 0o1777
    assert machine.file("/shared/hostfile").read_text() == HOSTFILE
    assert not machine.file("/etc/exports.d/fadenstack.exports").exists() and machine.programs_run() == []
    again = machine.ok("export", "--method", "sshfs")
    assert again["changed"] is False and again["created"] is False


def test_export_with_nfs_exports_to_each_member_address_with_root_squash_and_once(machine):
    result = machine.ok("export", "--method", "nfs", "--members", "198.18.1.11,198.18.1.12")

    assert result["exported"] is True
    assert machine.file("/etc/exports.d/fadenstack.exports").read_text().splitlines()[1:] == [
        "/shared 198.18.1.11(rw,sync,no_subtree_check,root_squash)",
        "/shared 198.18.1.12(rw,sync,no_subtree_check,root_squash)"]
    assert machine.programs_run() == [["exportfs", "-ra"]]
    assert machine.ok("export", "--method", "nfs", "--members", "198.18.1.11,198.18.1.12")["changed"] is False
    assert machine.programs_run() == [["exportfs", "-ra"]]
    # A member leaves: the export is written without it, and exportfs runs again at once.
    assert machine.ok("export", "--method", "nfs", "--members", "198.18.1.11")["changed"] is True
    assert "198.18.1.12" not in machine.file("/etc/exports.d/fadenstack.exports").read_text()
    assert machine.programs_run() == [["exportfs", "-ra"]] * 2
    # Switching to sshfs takes the export away again.
    machine.ok("export", "--method", "sshfs")
    assert not machine.file("/etc/exports.d/fadenstack.exports").exists()
    assert machine.programs_run() == [["exportfs", "-ra"]] * 3


@pytest.mark.parametrize("members", ["198.18.1.0/24", "*", "198.18.1.*", "node-1", "198.18.1.11,@nodes", ""])
def test_export_with_nfs_takes_addresses_only_never_a_subnet_or_wildcard(machine, members):
    code, events = machine.run("export", "--method", "nfs", *(["--members", members] if members else []))

    assert code == 2 and events[-1]["kind"] == "bad_input" and "--members must be the other members' IP addresses" in events[-1]["message"]
    assert not machine.file("/etc/exports.d/fadenstack.exports").exists()


def test_a_refused_export_quotes_exportfs(machine):
    code, events = machine.run("export", "--method", "nfs", "--members", "198.18.1.11",
                               FAKE_FAIL_EXPORTFS="exportfs: /shared does not support NFS export")

    assert code == 1 and events[-1]["kind"] == "not_retryable"
    assert events[-1]["message"] == ("exportfs -ra refused the export of /shared: "
                                     "exportfs: /shared does not support NFS export")


def test_mount_with_sshfs_runs_sshfs_with_options_that_survive(machine):
    result = machine.ok("mount", "--head", "198.18.1.10", "--method", "sshfs")

    assert result["changed"] is True and result["source"] == "root@198.18.1.10:/shared"
    (run,) = machine.programs_run()
    point = str(machine.file("/shared"))
    assert run[:4] == ["sshfs", "root@198.18.1.10:/shared", point, "-o"]
    assert run[4].split(",") == ["reconnect", "ServerAliveInterval=15", "ServerAliveCountMax=3", "BatchMode=yes",
                                 "ConnectTimeout=10", "allow_other", "default_permissions", "nosuid", "nodev"]
    # A pretend machine's root SSH settings are under its root; on a real one ssh reads root's own.
    assert run[5:] == ["-F", str(machine.file("/root/.ssh/config"))]
    assert machine.ok("status")["method"] == "sshfs" and machine.ok("status")["role"] == "node"


def test_mount_with_nfs_runs_mount_t_nfs(machine):
    machine.ok("mount", "--head", "198.18.1.10", "--method", "nfs")

    assert machine.programs_run() == [["mount", "-t", "nfs", "-o", "rw,hard,noatime,nosuid,nodev", "198.18.1.10:/shared",
                                       str(machine.file("/shared"))]]
    status = machine.ok("status")
    assert (status["method"], status["source"], status["alive"]) == ("nfs", "198.18.1.10:/shared", True)


def test_a_live_mount_of_the_same_source_changes_nothing(machine):
    machine.ok("mount", "--head", "198.18.1.10", "--method", "sshfs")

    again = machine.ok("mount", "--head", "198.18.1.10", "--method", "sshfs")

    assert again["already"] is True and again["changed"] is False
    assert len(machine.programs_run()) == 1


def test_a_mount_of_ours_without_nosuid_nodev_is_mounted_again_with_them(machine):
    machine.ok("mount", "--head", "198.18.1.10", "--method", "sshfs")
    info = machine.proc / "self" / "mountinfo"
    info.write_text(info.read_text().replace("rw,nosuid,nodev,relatime", "rw,relatime"))  # as an older agent mounted it

    again = machine.ok("mount", "--head", "198.18.1.10", "--method", "sshfs")

    assert again["remounted"] is True and again["changed"] is True
    assert [run[0] for run in machine.programs_run()] == ["sshfs", "fusermount3", "sshfs"]
    assert "rw,nosuid,nodev" in machine.mounts()


def test_a_mount_of_ours_from_another_head_is_replaced(machine):
    machine.ok("mount", "--head", "198.18.1.10", "--method", "sshfs")

    moved = machine.ok("mount", "--head", "198.18.1.20", "--method", "sshfs")

    assert moved["replaced"] == "root@198.18.1.10:/shared" and moved["changed"] is True
    point = str(machine.file("/shared"))
    assert [r[:2] for r in machine.programs_run()[1:]] == [["fusermount3", "-u"], ["sshfs", "root@198.18.1.20:/shared"]]
    assert machine.mounts().count(point) == 1


def test_a_mount_that_is_not_ours_is_refused_and_left_alone(machine):
    machine.mounted("nfs4", "fileserver:/home")

    code, events = machine.run("mount", "--head", "198.18.1.10", "--method", "sshfs")

    assert code == 1 and events[-1]["kind"] == "not_retryable"
    assert events[-1]["message"].startswith("/shared here is mounted from fileserver:/home (nfs4), not by Fadenstack")
    assert machine.programs_run() == []
    assert machine.ok("unmount")["warnings"] == ["/shared is mounted from fileserver:/home, not by Fadenstack: left as it is"]
    assert "fileserver:/home" in machine.mounts()


def test_a_head_that_does_not_answer_is_unreachable_in_sshfs_words(machine):
    code, events = machine.run("mount", "--head", "198.18.1.10", "--method", "sshfs",
                               FAKE_FAIL_SSHFS="ssh: connect to host 198.18.1.10 port 22: Connection refused")

    assert code == 1 and events[-1]["kind"] == "unreachable"
    assert events[-1]["message"] == ("cannot mount /shared from the head 198.18.1.10 with sshfs: "
                                     "ssh: connect to host 198.18.1.10 port 22: Connection refused")
    assert machine.ok("status")["role"] is None  # nothing of ours is left to unmount


def test_a_refused_login_is_not_retryable(machine):
    code, events = machine.run("mount", "--head", "198.18.1.10", "--method", "sshfs",
                               FAKE_FAIL_SSHFS="root@198.18.1.10: Permission denied (publickey).")

    assert events[-1]["kind"] == "not_retryable" and "Permission denied (publickey)" in events[-1]["message"]


def test_the_head_address_must_be_an_ip_address(machine):
    code, events = machine.run("mount", "--head", "198.18.1.10;reboot", "--method", "sshfs")

    assert code == 2 and events[-1]["kind"] == "bad_input" and machine.programs_run() == []


def test_unmount_takes_our_mount_away_and_a_busy_one_lazily(machine):
    machine.ok("mount", "--head", "198.18.1.10", "--method", "sshfs")

    code, events = machine.run("unmount", FAKE_BUSY="1")

    assert code == 0 and events[-1]["unmounted"] is True and events[-1]["lazy"] is True
    assert any("in use here" in e.get("message", "") for e in events if e["event"] == "log")
    assert "fuse.sshfs" not in machine.mounts()
    assert machine.ok("unmount") == {"event": "result", "path": "/shared", "unmounted": False, "method": None, "lazy": False,
                                     "unexported": False, "kept": None, "warnings": []}


def test_unmount_on_the_head_takes_the_export_away_and_keeps_the_files(machine):
    machine.ok("export", "--method", "nfs", "--members", "198.18.1.11")
    machine.file("/shared/checkpoint.pt").write_text("weights")

    result = machine.ok("unmount")

    assert result["unexported"] is True and result["kept"] == "/shared"
    assert not machine.file("/etc/exports.d/fadenstack.exports").exists()
    assert machine.file("/shared/checkpoint.pt").read_text() == "weights"
    assert machine.programs_run()[-1] == ["exportfs", "-ra"]


def test_clear_empties_a_former_heads_shared_once_its_cluster_let_go_and_keeps_the_directory(machine):
    machine.ok("export", "--method", "nfs", "--members", "198.18.1.11")
    (machine.file("/shared/runs")).mkdir()
    machine.file("/shared/runs/checkpoint.pt").write_text("weights")

    code, events = machine.run("clear")  # the cluster still has it: the export, the head's record
    assert code == 1 and events[-1]["kind"] == "not_retryable"
    assert events[-1]["message"] == "/shared here is a cluster's (this machine is its head): its files stay while the cluster uses them"
    assert machine.file("/shared/runs/checkpoint.pt").exists()

    machine.ok("unmount")  # the cluster's delete
    result = machine.ok("clear")

    assert (result["path"], result["removed"], result["freed"]) == ("/shared", 2, len("weights"))  # runs/ and its file
    assert machine.file("/shared").is_dir() and not list(machine.file("/shared").iterdir())
    assert oct(machine.file("/shared").stat().st_mode & 0o7777) == "0o1777"


def test_clear_never_touches_a_mount_of_another_heads_shared(machine):
    machine.ok("mount", "--head", "198.18.1.10", "--method", "sshfs")
    code, events = machine.run("clear")
    assert code == 1 and events[-1]["message"] == "/shared here is mounted from root@198.18.1.10:/shared: its files are that machine's, not this one's"


def test_a_former_node_that_becomes_the_head_unmounts_its_old_mount_first(machine):
    machine.ok("mount", "--head", "198.18.1.10", "--method", "sshfs")

    result = machine.ok("export", "--method", "sshfs")

    assert result["changed"] is True and "fuse.sshfs" not in machine.mounts()
    assert machine.ok("status")["role"] == "head"


# ------------------------------------------------------------------ a real sshfs mount over loopback

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)
SSHFS = shutil.which("sshfs")


@pytest.fixture
def loopback(tmp_path):
    """An sshd on 127.0.0.1 whose sftp is chrooted to the head's pretend root, and a node whose root SSH
    settings reach it with a key of its own (as ``node files write`` makes them)."""
    if os.geteuid() != 0 or not (SSHD and SSHFS and os.path.exists("/dev/fuse")):
        pytest.skip("a real sshfs mount needs root, sshd, sshfs and /dev/fuse")
    # sshd's chroot: every directory on the way root's and writable by no one else (not /tmp's).
    head, node = pathlib.Path(tempfile.mkdtemp(prefix="faden-shared-head-", dir="/run")), tmp_path / "node"
    for path in (node / "root" / ".ssh", node / "dev", tmp_path / "ssh"):
        path.mkdir(parents=True, mode=0o755)
    (node / "dev" / "fuse").write_text("")
    ssh = tmp_path / "ssh"
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / name)], check=True)
    os.makedirs("/run/sshd", exist_ok=True)
    sshd, port = _sshd_listening(ssh, head)
    (node / "root" / ".ssh" / "known_hosts").write_text(f"[127.0.0.1]:{port} {(ssh / 'host.pub').read_text()}")
    (node / "root" / ".ssh" / "config").write_text(
        f"Host 127.0.0.1\n    Port {port}\n    User root\n    IdentityFile {ssh / 'user'}\n    IdentitiesOnly yes\n"
        f"    UserKnownHostsFile {node / 'root' / '.ssh' / 'known_hosts'}\n    StrictHostKeyChecking yes\n")
    env = dict(os.environ, PYTHONPATH=AGENT_DIR, PYTHONDONTWRITEBYTECODE="1")
    yield {"head": dict(env, FADEN_NODE_FILES_ROOT=str(head)), "node": dict(env, FADEN_NODE_FILES_ROOT=str(node)),
           "head_root": head, "node_root": node}
    subprocess.run(["fusermount3", "-u", "-z", str(node / "shared")], capture_output=True)
    sshd.terminate()
    sshd.wait(timeout=10)
    shutil.rmtree(head)


def _sshd_listening(ssh, head):
    """sshd in the foreground (-D: its exit is ours to see) on a port free a moment ago, once its log
    says it listens. A port taken since (another test's listener) ends it at its bind: another port.
    A daemonized sshd binds after its parent has exited 0, and a failed bind went unnoticed until
    sshfs met the port's other owner ('read: Connection reset by peer')."""
    for _ in range(5):
        port, log = free_port(), ssh / "sshd.log"
        (ssh / "sshd_config").write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {ssh / 'host'}\nPidFile none\n"
            f"AuthorizedKeysFile {ssh / 'user.pub'}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            f"UsePAM no\nStrictModes no\nSubsystem sftp internal-sftp\nChrootDirectory {head}\nForceCommand internal-sftp\n")
        log.write_text("")
        sshd = subprocess.Popen([SSHD, "-D", "-f", str(ssh / "sshd_config"), "-E", str(log)], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while sshd.poll() is None and "Server listening" not in log.read_text():
            assert time.monotonic() < deadline, f"sshd does not listen on {port}: {log.read_text()}"
            time.sleep(0.02)
        if sshd.poll() is None:
            return sshd, port
    pytest.fail(f"sshd did not start: {log.read_text()}")


def _agent(env, *words) -> dict:
    proc = subprocess.run([PYTHON, "-m", "fadenstack_agent", "shared", *words], capture_output=True, timeout=90, env=env)
    last = json.loads(proc.stdout.decode().splitlines()[-1])
    assert proc.returncode == 0 and not proc.stderr, (last, proc.stderr)
    return last


def _sshfs_pid(point) -> int:
    found = subprocess.run(["pgrep", "-f", f"sshfs root@127.0.0.1:/shared {point} "], capture_output=True, text=True).stdout.split()
    assert len(found) == 1, found
    return int(found[0])


def test_a_real_sshfs_mount_shares_files_both_ways_and_comes_back_after_it_died(loopback):
    _agent(loopback["head"], "export", "--method", "sshfs")
    head_shared, point = loopback["head_root"] / "shared", loopback["node_root"] / "shared"

    mounted = _agent(loopback["node"], "mount", "--head", "127.0.0.1", "--method", "sshfs")

    assert mounted["changed"] is True
    (point / "from-node.txt").write_text("written on the node\n")
    assert (head_shared / "from-node.txt").read_text() == "written on the node\n"
    (head_shared / "from-head.txt").write_text("written on the head\n")
    assert (point / "from-head.txt").read_text() == "written on the head\n"
    assert _agent(loopback["node"], "mount", "--head", "127.0.0.1", "--method", "sshfs")["already"] is True

    os.kill(_sshfs_pid(point), signal.SIGKILL)  # the sshfs process gone: "Transport endpoint is not connected"
    deadline = time.monotonic() + 5
    while _agent(loopback["node"], "status")["alive"] is not False:
        assert time.monotonic() < deadline, "the mount still answers after its sshfs died"
        time.sleep(0.1)
    assert "ENOTCONN" in _agent(loopback["node"], "status")["error"]

    again = _agent(loopback["node"], "mount", "--head", "127.0.0.1", "--method", "sshfs")

    assert again["remounted"] is True and (point / "from-head.txt").read_text() == "written on the head\n"
    gone = _agent(loopback["node"], "unmount")
    assert gone["unmounted"] is True and _agent(loopback["node"], "status")["mounted"] is False
    assert (head_shared / "from-node.txt").exists()

"""``shared export|mount|unmount|clear|status``: the cluster's shared files, ``/shared``.

``/shared`` lives on the head and every other node mounts it over the cluster's network, by one of
two methods the console picks from what ``shared status`` says each machine can do:

- ``nfs``: the head exports ``/shared`` to the other members' addresses only, one line each with
  ``root_squash`` (``/etc/exports.d/fadenstack.exports``, ``exportfs -ra``; nfs-kernel-server), the
  nodes ``mount -t nfs -o ...,nosuid,nodev HEAD:/shared /shared`` (nfs-common);
- ``sshfs``: the nodes mount ``root@HEAD:/shared`` with sshfs (FUSE) over the cluster's own SSH: the
  key, the known hosts and the user come from the block ``node files write`` put at the top of root's
  ``~/.ssh/config`` for the nodes' names and addresses. For kernels without an NFS server (the lab).

The head's ``/shared`` is made 1777, like ``/tmp``: every user of every node may make files there and
only a file's owner (and root) removes it. Both methods mount ``nosuid,nodev``: no set-user-id program
and no device file on /shared works on a node. With NFS root on a node is squashed to nobody on the
head's files (``root_squash``); sshfs logs in as root. ``shared export`` also copies the hostfile to
``/shared/hostfile``.

Everything is idempotent: a live mount of the same source changes nothing; a dead sshfs mount
("Transport endpoint is not connected") is unmounted and mounted again. What the agent did is recorded
in ``/etc/fadenstack/shared.json``, so that ``unmount`` takes away only what it made; the head keeps
its files. The root of every path moves under ``FADEN_NODE_FILES_ROOT`` for tests, ``FADEN_SHARED_PROC``
stands for ``/proc`` and ``FADEN_SHARED_PATH`` is where programs are looked for.
"""

import ipaddress
import os
import shutil

from .cli import arg, command, group
from .files import is_root
from .nodeedit import ensure_dir, put, read
from .protocol import BAD_INPUT, NOT_RETRYABLE, RETRYABLE, UNREACHABLE, AgentError
from .sharedmounts import SHARED, Machine, abilities, root_home

SHARED_MODE = 0o1777
HOSTFILE = "/etc/fadenstack/hostfile"
SHARED_HOSTFILE = SHARED + "/hostfile"
EXPORTS = "/etc/exports.d/fadenstack.exports"
METHODS = ("nfs", "sshfs")
# reconnect: sshfs logs in again after the head or the link went away; the keep-alives find a dead
# link within 45 s; BatchMode: never a password prompt; allow_other + default_permissions: every user
# of the node sees the files, and the kernel checks their modes as on a local disk.
# nosuid,nodev (both methods): a set-user-id program or a device file another node made does not work here.
SSHFS_OPTIONS = ("reconnect", "ServerAliveInterval=15", "ServerAliveCountMax=3", "BatchMode=yes",
                 "ConnectTimeout=10", "allow_other", "default_permissions", "nosuid", "nodev")
NFS_OPTIONS = "rw,hard,noatime,nosuid,nodev"
MOUNT_FLAGS = ("nosuid", "nodev")  # a mount of ours without them (an older agent's) is mounted again
EXPORT_OPTIONS = "rw,sync,no_subtree_check,root_squash"
MAX_MEMBERS = 1024
UNREACHABLE_WORDS = ("connection refused", "timed out", "no route to host", "network is unreachable",
                     "connection reset", "connection closed", "could not resolve")

group("shared", help="the cluster's shared files: /shared on the head, mounted on every other node")

METHOD = arg("--method", required=True, choices=METHODS, help="the network file system: nfs or sshfs")


# ------------------------------------------------------------------ the programs


def _require_root(machine: Machine) -> None:
    if not is_root() and not machine.root.overridden:
        raise AgentError(NOT_RETRYABLE, "mounting and exporting /shared is root's: the agent runs as uid %d here"
                                        % os.geteuid())


def _head_address(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise AgentError(BAD_INPUT, "--head must be the head's IP address on the cluster's network, got %r" % text)


def source_of(method: str, head: str) -> str:
    """What a mount of the head's /shared shows as its source in mountinfo."""
    return "%s:%s" % (head, SHARED) if method == "nfs" else "root@%s:%s" % (head, SHARED)


def mount_argv(machine: Machine, method: str, head: str) -> list:
    if method == "nfs":
        return [machine.program("mount") or "mount", "-t", "nfs", "-o", NFS_OPTIONS, source_of(method, head),
                machine.real(SHARED)]
    argv = [machine.program("sshfs") or "sshfs", source_of(method, head), machine.real(SHARED),
            "-o", ",".join(SSHFS_OPTIONS)]
    if machine.root.overridden:  # a test's machine: root's SSH settings are under its root
        argv += ["-F", machine.real(os.path.join(root_home(), ".ssh", "config"))]
    return argv


def unmount_argvs(machine: Machine, method: str, lazy: bool) -> list:
    """The commands to try in turn: fusermount for a FUSE mount (umount when there is none), umount for NFS."""
    path = machine.real(SHARED)
    umount = [machine.program("umount") or "umount", *(["-l"] if lazy else []), path]
    fuse = machine.program("fusermount3") or machine.program("fusermount")
    if method == "sshfs" and fuse:
        return [[fuse, "-u", *(["-z"] if lazy else []), path], umount]
    return [umount]


def _unmount(machine: Machine, method: str, lazy: bool) -> str:
    """Unmount /shared; '' when done, else the programs' words."""
    words = []
    for argv in unmount_argvs(machine, method, lazy):
        code, said = machine.run(argv)
        if code == 0 and machine.mount() is None:
            return ""
        words.append(said or "exit status %s" % code)
    return "; ".join(words)


def _unmount_or_fail(machine: Machine, mounted: dict, out) -> bool:
    """Take a mount of ours away (lazily when it is in use or dead); whether it was lazy."""
    lazy = not mounted["alive"]
    failed = _unmount(machine, mounted["method"], lazy=lazy)
    if failed and not lazy:
        out.log("/shared is in use here (%s): unmounted lazily, files open there stay open until closed" % failed)
        lazy, failed = True, _unmount(machine, mounted["method"], lazy=True)
    if failed:
        raise AgentError(RETRYABLE, "could not unmount /shared (%s from %s): %s"
                                    % (mounted["method"] or mounted["fstype"], mounted["source"], failed))
    return lazy


def _kind_of(words: str) -> str:
    low = words.lower()
    return UNREACHABLE if any(w in low for w in UNREACHABLE_WORDS) else NOT_RETRYABLE


def _exportfs(machine: Machine) -> None:
    code, said = machine.run([machine.program("exportfs") or "exportfs", "-ra"])
    if code != 0:
        raise AgentError(NOT_RETRYABLE, "exportfs -ra refused the export of /shared: %s" % (said or "exit status %s" % code))


def exports_text(members: list) -> bytes:
    """The export: one line per member address (never a subnet or a wildcard), each ``root_squash``."""
    lines = ["# The cluster's shared files, for its other members only (written by the Fadenstack agent: shared export)."]
    lines += ["%s %s(%s)" % (SHARED, address, EXPORT_OPTIONS) for address in members]
    return ("\n".join(lines) + "\n").encode("utf-8")


def members_arg(text) -> list:
    """``--members``: the other members' addresses, comma-separated, each one IP address (no subnet, no
    host name, no wildcard), without repeats, in the order given."""
    found = []
    for word in (text or "").split(","):
        try:
            address = str(ipaddress.ip_address(word.strip()))
        except ValueError:
            raise AgentError(BAD_INPUT, "--members must be the other members' IP addresses, comma-separated "
                                        "(198.18.1.11,198.18.1.12), got %r: no subnet, host name or wildcard" % word)
        if address not in found:
            found.append(address)
    if len(found) > MAX_MEMBERS:
        raise AgentError(BAD_INPUT, "--members names %d addresses, more than %d" % (len(found), MAX_MEMBERS))
    return found


# ------------------------------------------------------------------ the commands


@command("shared", "export", args=[
    arg("--method", required=True, choices=METHODS + ("none",), help="how the other nodes mount it"),
    arg("--members", metavar="ADDR[,ADDR...]", help="the other members' addresses: the only ones the NFS export serves")])
def cmd_export(args, out) -> int:
    """``shared export --method nfs|sshfs|none [--members ADDR,...]``: make this machine the head of /shared.

    Makes ``/shared`` (1777) when it is missing or empty (one that holds files keeps its mode), copies ``/etc/fadenstack/hostfile`` to
    ``/shared/hostfile``, and with ``nfs`` exports it to the ``--members`` addresses only, one line each,
    ``root_squash`` (``exportfs -ra`` when the text changed: a member that left loses it at once);
    with ``sshfs`` or ``none`` an export of ours is taken away (the nodes come over SSH, or not at all).
    A network mount of /shared left here by another cluster is unmounted first: the head's files are
    its own. Result: ``{"path", "method", "created", "hostfile", "exported", "changed"}``.
    """
    machine = Machine()
    _require_root(machine)
    members = members_arg(args.members) if args.method == "nfs" or args.members else None
    record, changed = machine.record(), False
    mounted = machine.mount()
    if mounted is not None and record.get("role") == "node" and record.get("source") == mounted["source"]:
        out.log("/shared here was mounted from %s: unmounted, this machine is the head now" % mounted["source"])
        _unmount_or_fail(machine, mounted, out)
        changed = True
    elif mounted is not None:
        raise AgentError(NOT_RETRYABLE, "/shared here is mounted from %s, not by Fadenstack: the head needs /shared "
                                        "on its own disk (unmount it first)" % mounted["source"])
    created = not os.path.isdir(machine.real(SHARED))
    if created:
        ensure_dir(machine.root, SHARED, SHARED_MODE, [])
    elif not os.listdir(machine.real(SHARED)) and os.stat(machine.real(SHARED)).st_mode & 0o7777 != SHARED_MODE:
        os.chmod(machine.real(SHARED), SHARED_MODE)  # an empty mount point (the lab's): nobody's files to keep
        created = True
    hostfile = read(machine.real(HOSTFILE))[0]
    copied = hostfile is not None and put(machine.real(SHARED_HOSTFILE), hostfile, 0o644)
    if hostfile is None:
        out.log("no %s on this machine yet: /shared/hostfile is written with the node settings" % HOSTFILE)
    exported = False
    if args.method == "nfs":
        ensure_dir(machine.root, os.path.dirname(EXPORTS), 0o755, [])
        if put(machine.real(EXPORTS), exports_text(members), 0o644) or not record.get("exported"):
            _exportfs(machine)
            changed = True
        exported = True
    elif read(machine.real(EXPORTS))[0] is not None:
        put(machine.real(EXPORTS), None, 0o644)
        if machine.program("exportfs"):
            _exportfs(machine)
        changed = True
    new_record = {"role": "head", "method": args.method, "exported": exported, "members": members}
    if new_record != record:
        machine.save_record(new_record)
    return out.result(path=SHARED, method=args.method, created=created, hostfile=SHARED_HOSTFILE if hostfile else None,
                      exported=exported, changed=bool(changed or created or copied))


@command("shared", "mount", args=[
    arg("--head", required=True, metavar="ADDR", help="the head's address on the cluster's network"), METHOD])
def cmd_mount(args, out) -> int:
    """``shared mount --head ADDR --method nfs|sshfs``: mount the head's /shared on /shared here.

    Idempotent: a live mount of the same source changes nothing (``already``). A dead one ("Transport
    endpoint is not connected": the sshfs process went away) is unmounted and mounted again
    (``remounted``), as is a mount of ours from another head or by another method. A mount that is not
    the agent's is left alone and refused. sshfs logs in as root with root's SSH settings for the
    nodes (``node files write``); a head that does not answer is ``unreachable``, a refusal
    ``not_retryable``, each with the program's words. A mount of ours without ``nosuid,nodev`` (an older
    agent's) is mounted again with them (``remounted``). Result: ``{"path", "method", "source",
    "changed", "already", "remounted", "replaced"}``.
    """
    machine = Machine()
    _require_root(machine)
    head = _head_address(args.head)
    source, record = source_of(args.method, head), machine.record()
    mounted = machine.mount()
    remounted, replaced = False, None
    if mounted is not None:
        hardened = all(flag in mounted.get("options", ()) for flag in MOUNT_FLAGS)
        if mounted["alive"] and mounted["method"] == args.method and mounted["source"] == source and hardened:
            if record.get("source") != source:
                machine.save_record({"role": "node", "method": args.method, "head": head, "source": source})
            return out.result(path=SHARED, method=args.method, source=source, changed=False, already=True,
                              remounted=False, replaced=None)
        if record.get("role") != "node" or record.get("source") != mounted["source"]:
            raise AgentError(NOT_RETRYABLE, "/shared here is mounted from %s (%s), not by Fadenstack: unmount it, "
                                            "then share the cluster's files again" % (mounted["source"], mounted["fstype"]))
        if not mounted["alive"]:
            out.log("/shared from %s does not answer (%s): unmounting it to mount it again" % (mounted["source"], mounted["error"]))
            remounted = True
        elif mounted["source"] == source and mounted["method"] == args.method:
            out.log("/shared from %s is mounted without nosuid,nodev: mounting it again with them" % source)
            remounted = True
        else:
            replaced = mounted["source"]
            out.log("/shared was mounted from %s: replaced by %s" % (replaced, source))
        _unmount_or_fail(machine, mounted, out)
    ensure_dir(machine.root, SHARED, 0o755, [])
    hidden = os.listdir(machine.real(SHARED))
    if hidden:
        out.log("/shared on this machine holds %d entries of its own: hidden under the mount until it is unmounted"
                % len(hidden))
    machine.save_record({"role": "node", "method": args.method, "head": head, "source": source})
    code, said = machine.run(mount_argv(machine, args.method, head), new_session=args.method == "sshfs")
    now = machine.mount()
    if code != 0 or now is None or not now["alive"]:
        machine.save_record(None)
        words = said or (now["error"] if now else "exit status %s" % code)
        raise AgentError(_kind_of(words), "cannot mount /shared from the head %s with %s: %s" % (head, args.method, words))
    return out.result(path=SHARED, method=args.method, source=source, changed=True, already=False,
                      remounted=remounted, replaced=replaced)


@command("shared", "unmount")
def cmd_unmount(args, out) -> int:
    """``shared unmount``: take away what ``shared mount`` or ``shared export`` did here.

    A node's mount of the head's /shared is unmounted (lazily when it is in use or dead: files open
    there stay open until closed); on the head the NFS export of ours goes, and ``/shared`` stays with
    its files (``kept``). A mount the agent did not make is left alone (a warning). Harmless when there
    is nothing. Result: ``{"path", "unmounted", "method", "lazy", "unexported", "kept", "warnings"}``.
    """
    machine = Machine()
    _require_root(machine)
    record, mounted = machine.record(), machine.mount()
    unmounted, lazy, unexported, warnings = False, False, False, []
    if mounted is not None:
        if record.get("role") == "node" and record.get("source") == mounted["source"]:
            lazy = _unmount_or_fail(machine, mounted, out)
            unmounted = True
        else:
            warnings.append("/shared is mounted from %s, not by Fadenstack: left as it is" % mounted["source"])
    if read(machine.real(EXPORTS))[0] is not None:
        put(machine.real(EXPORTS), None, 0o644)
        if machine.program("exportfs"):
            _exportfs(machine)
        unexported = True
    kept = SHARED if record.get("role") == "head" and os.path.isdir(machine.real(SHARED)) else None
    machine.save_record(None)
    for warning in warnings:
        out.log(warning)
    return out.result(path=SHARED, unmounted=unmounted, method=(mounted or {}).get("method") if unmounted else None,
                      lazy=lazy, unexported=unexported, kept=kept, warnings=warnings)


def _tree_size(path: str) -> tuple:
    """``(entries, bytes)`` under ``path``, links not followed."""
    entries = size = 0
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            entries += 1
            try:
                size += os.lstat(os.path.join(top, name)).st_size if name in files else 0
            except OSError:
                pass
    return entries, size


@command("shared", "clear")
def cmd_clear(args, out) -> int:
    """``shared clear``: remove the files a deleted cluster left in this machine's /shared (agent 0.9).

    For a former head, whose /shared keeps its files when the cluster is deleted (``shared unmount``'s
    ``kept``). Refused, ``not_retryable``, while /shared is a cluster's: a network file system mounted
    there (another head's files), an NFS export of ours, or the record of a head or node the agent made
    (the cluster's delete takes it away). The directory stays, with its mode; only what is in it goes.
    Result: ``{"path", "removed": entries, "freed": bytes}``.
    """
    machine = Machine()
    _require_root(machine)
    mounted, record = machine.mount(), machine.record()
    if mounted is not None:
        raise AgentError(NOT_RETRYABLE, "/shared here is mounted from %s: its files are that machine's, not this "
                                        "one's" % mounted["source"])
    if record.get("role") or read(machine.real(EXPORTS))[0] is not None:
        raise AgentError(NOT_RETRYABLE, "/shared here is a cluster's (this machine is its %s): its files stay while "
                                        "the cluster uses them" % (record.get("role") or "head"))
    path = machine.real(SHARED)
    if not os.path.isdir(path) or os.path.islink(path):
        return out.result(path=SHARED, removed=0, freed=0)
    removed, freed = _tree_size(path)
    for name in os.listdir(path):
        entry = os.path.join(path, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry)
        else:
            os.unlink(entry)
    return out.result(path=SHARED, removed=removed, freed=freed)


@command("shared", "status")
def cmd_status(args, out) -> int:
    """``shared status``: what /shared is here, and which methods this machine can serve or mount it with.

    Result: ``{"path", "mounted", "method", "fstype", "source", "alive", "error", "role", "exported",
    "local", "can": {"nfs_export", "nfs_mount", "sshfs"}, "cannot": {name: reason}}``. ``alive`` is
    false for a mount that does not answer (``error``: "Transport endpoint is not connected
    (ENOTCONN)"); ``local``: /shared is a directory of this machine's own disk; ``role``: ``head`` or
    ``node`` as the agent last made it, else null.
    """
    machine = Machine()
    mounted, record = machine.mount(), machine.record()
    can, cannot = abilities(machine)
    return out.result(path=SHARED, mounted=mounted is not None, method=(mounted or {}).get("method"),
                      fstype=(mounted or {}).get("fstype"), source=(mounted or {}).get("source"),
                      alive=mounted["alive"] if mounted else None, error=(mounted or {}).get("error"),
                      role=record.get("role"), exported=bool(record.get("exported")),
                      local=mounted is None and os.path.isdir(machine.real(SHARED)), can=can, cannot=cannot)

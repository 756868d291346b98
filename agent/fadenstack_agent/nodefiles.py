"""``node files write|remove``: the files that make this machine a node of its cluster.

``write`` puts, from the spec on stdin (``nodespec``; never argv: the cluster's private key is in
it), every file a node needs for the launchers and for logins:

- ``/etc/fadenstack/hostfile`` and ``/etc/fadenstack/cluster.env`` (the server's texts),
  ``/etc/profile.d/fadenstack-cluster.sh`` (every login shell loads cluster.env, exported);
- the block of ``/etc/hosts`` naming every node (``node-0`` ...);
- the cluster's own SSH between nodes: its private key (``~root/.ssh/fadenstack_cluster``, 0600),
  a block at the top of root's ``~/.ssh/config`` for ``node-*`` and the nodes' addresses,
  ``/etc/fadenstack/known_hosts`` from the nodes' host keys, and the public key in a block of the
  authorized keys file sshd reads for root, accepted only ``from=`` the cluster's subnet;
- sshd's trust in the console's certificate authority: the drop-in, the authority's key,
  root's principals file and the cluster's key revocation list (``/etc/fadenstack/ssh/``), an ``Include`` of the drop-in at the top of
  the sshd configuration when it has none, checked with ``sshd -t`` and sshd reloaded.  If sshd
  refuses the change, the previous files are put back and the error quotes sshd.

``remove`` undoes it: whole files deleted (or put back as they were before the first write),
blocks taken out, directories it made removed, sshd checked and reloaded.  Both are idempotent;
``changed`` says whether anything had to be done.  The record of what the first write found is
``/etc/fadenstack/node-files.json`` (``nodeedit.Record``); the root of every path moves under
``FADEN_NODE_FILES_ROOT`` for tests.
"""

import fnmatch
import json
import os
import pwd
import select
import time

from . import nodeedit, nodespec
from .blobspec import read_spec
from .cli import arg, command, group
from .files import Locked, agent_home, is_root
from .nodeedit import Record, Root, block_drop, block_put, decode, encode
from .nodesshd import Sshd, authorized_keys_file, first
from .protocol import BAD_INPUT, NOT_RETRYABLE, AgentError

HOSTFILE = "/etc/fadenstack/hostfile"
CLUSTER_ENV = nodespec.ENV_PATH
KNOWN_HOSTS = "/etc/fadenstack/known_hosts"
PROFILE = "/etc/profile.d/fadenstack-cluster.sh"
HOSTS = "/etc/hosts"
DROPIN = "/etc/ssh/sshd_config.d/fadenstack-ca.conf"
CA_KEY = nodespec.CA_KEY
ROOT_PRINCIPALS = nodespec.PRINCIPALS.replace("%u", "root")
REVOKED_KEYS = nodespec.REVOKED_KEYS
KEY_NAME = "fadenstack_cluster"
SSH_BEGIN, SSH_END = nodespec.HOSTS_BEGIN, nodespec.HOSTS_END
KEY_BEGIN, KEY_END = "# fadenstack cluster key: begin", "# fadenstack cluster key: end"
INCLUDE_BEGIN, INCLUDE_END = "# fadenstack sshd drop-in: begin", "# fadenstack sshd drop-in: end"
# Files a shared-file block goes into when the file has to be made for it: (mode, directory mode).
NEW_FILE_MODES = {"hosts": (0o644, 0o755), "ssh_config": (0o600, 0o700), "authorized_keys": (0o600, 0o700),
                  "sshd_config": (0o644, 0o755)}

group("node", help="this machine as a node of its cluster")
group("node", "files", help="the cluster's files on this machine: hostfile, settings, hosts, node SSH, sshd trust")


def root_home() -> str:
    try:
        return pwd.getpwnam("root").pw_dir or "/root"
    except KeyError:
        return "/root"


class Paths:
    """The machine paths of one run: the fixed ones, root's SSH files, and the two sshd decides."""

    def __init__(self, sshd_config: str, authorized_keys: str):
        home = root_home()
        self.node_key = os.path.join(home, ".ssh", KEY_NAME)
        self.ssh_config = os.path.join(home, ".ssh", "config")
        self.sshd_config = sshd_config
        self.authorized_keys = authorized_keys

    def whole(self) -> list:
        """Every file ``write`` owns whole, the sshd ones last."""
        return [HOSTFILE, CLUSTER_ENV, PROFILE, KNOWN_HOSTS, self.node_key, CA_KEY, ROOT_PRINCIPALS, REVOKED_KEYS, DROPIN]

    def sshd_files(self) -> set:
        return {DROPIN, CA_KEY, ROOT_PRINCIPALS, REVOKED_KEYS, self.sshd_config}


def _read_stdin_spec() -> dict:
    try:
        raw = read_spec(noun="node files")
    except AgentError:
        raise AgentError(BAD_INPUT, "no node files spec arrived on stdin: send one JSON object %s" % nodespec.SHAPE)
    try:
        spec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise AgentError(BAD_INPUT, "the node files spec on stdin is not valid JSON: %s" % exc)
    return nodespec.check_spec(spec)


def _require_root(root: Root) -> None:
    if not is_root() and not root.overridden:
        raise AgentError(NOT_RETRYABLE, "the node files are root's (/etc/hosts, sshd, root's SSH files): the agent "
                                        "runs as uid %d here" % os.geteuid())


def _lock():
    return Locked(os.path.join(agent_home(), "node-files.lock"), 30.0, "another node files command is running here")


# ------------------------------------------------------------------ what the files become


def _block_target(root: Root, record: Record, path: str, begin: str, end: str, body, top=False):
    """``(bytes or None, mode)`` for a shared file: with our block holding ``body``, or (``body``
    None) without it, as it was before the first write when the record says how it was."""
    data, mode, _, _ = nodeedit.read(root.real(path))
    text = decode(data)
    if body is None:
        state = record.block(path)
        rest = block_drop(text, begin, end, state["newline_added"])
        if data is None or (rest == "" and state["created"]):
            return None, mode
        return encode(rest), mode
    new, newline_added = block_put(text, begin, end, body, top)
    record.note_block(path, created=data is None, newline_added=newline_added)
    return encode(new), mode


def _include_target(root: Root, record: Record, paths: Paths, remove: bool):
    """The sshd configuration with an ``Include`` of the drop-in at its top, unless one of its own
    ``Include`` lines already reads it (Debian's ``Include /etc/ssh/sshd_config.d/*.conf``)."""
    data, _, _, _ = nodeedit.read(root.real(paths.sshd_config))
    rest = block_drop(decode(data), INCLUDE_BEGIN, INCLUDE_END)
    if remove or includes(rest, DROPIN):
        return _block_target(root, record, paths.sshd_config, INCLUDE_BEGIN, INCLUDE_END, None)
    return _block_target(root, record, paths.sshd_config, INCLUDE_BEGIN, INCLUDE_END, "Include %s\n" % DROPIN, top=True)


def includes(config_text: str, path: str) -> bool:
    """Whether a top-level ``Include`` of this configuration names ``path`` (globs as sshd reads
    them; a relative pattern is under /etc/ssh)."""
    for line in config_text.splitlines():
        words = line.split()
        if words and words[0].lower() == "match":
            return False  # what follows belongs to a Match block
        if words and words[0].lower() == "include":
            patterns = [w if w.startswith("/") else "/etc/ssh/" + w for w in words[1:]]
            if any(_glob_match(path, p) for p in patterns):
                return True
    return False


def _glob_match(path: str, pattern: str) -> bool:
    # fnmatch's * crosses "/", a shell glob's does not: compare part by part.
    path_parts, pattern_parts = path.split("/"), pattern.split("/")
    if len(path_parts) != len(pattern_parts):
        return False
    return all(fnmatch.fnmatchcase(a, b) for a, b in zip(path_parts, pattern_parts))


def _write_targets(spec: dict, root: Root, record: Record, paths: Paths) -> dict:
    ssh = spec["ssh"]
    home_key = paths.node_key
    targets = {
        HOSTFILE: (encode(spec["hostfile"]), 0o644),
        CLUSTER_ENV: (encode(spec["cluster_env"]), 0o644),
        PROFILE: (encode(nodespec.PROFILE_TEXT), 0o644),
        KNOWN_HOSTS: (encode(nodespec.known_hosts_text(spec["cluster"], ssh["nodes"])), 0o644),
        home_key: (encode(ssh["private_key"]), 0o600),
        CA_KEY: (encode(spec["sshd"]["ca_public_key"]), 0o644),
        ROOT_PRINCIPALS: (encode(spec["sshd"]["principals"]), 0o644),
        # Before the drop-in that names it: sshd refuses every public key while RevokedKeys cannot be read.
        REVOKED_KEYS: (spec["sshd"]["revoked_keys"], 0o644),
        DROPIN: (encode(spec["sshd"]["dropin"]), 0o644),
    }
    for path in targets:
        record.keep_original(path)
    shared = {
        HOSTS: (SSH_BEGIN, SSH_END, spec["hosts_body"], False, "hosts"),
        paths.ssh_config: (SSH_BEGIN, SSH_END, nodespec.ssh_config_body(spec["cluster"], ssh["nodes"], home_key,
                                                                        KNOWN_HOSTS), True, "ssh_config"),
        paths.authorized_keys: (KEY_BEGIN, KEY_END, nodespec.authorized_body(ssh["public_key"], ssh["allow_from"]),
                                False, "authorized_keys"),
    }
    for path, (begin, end, body, top, kind) in shared.items():
        data, mode = _block_target(root, record, path, begin, end, body, top)
        targets[path] = (data, mode if mode is not None else NEW_FILE_MODES[kind][0])
    data, mode = _include_target(root, record, paths, remove=False)
    if data is not None:
        targets[paths.sshd_config] = (data, mode if mode is not None else NEW_FILE_MODES["sshd_config"][0])
    return targets


def _remove_targets(root: Root, record: Record, paths: Paths) -> dict:
    targets = {}
    for path in paths.whole():
        original = record.original(path)
        targets[path] = original if original else (None, 0o644)
    for path, begin, end in ((HOSTS, SSH_BEGIN, SSH_END), (paths.ssh_config, SSH_BEGIN, SSH_END),
                             (paths.authorized_keys, KEY_BEGIN, KEY_END)):
        targets[path] = _block_target(root, record, path, begin, end, None)
    targets[paths.sshd_config] = _include_target(root, record, paths, remove=True)
    return targets


# ------------------------------------------------------------------ applying them


def _dir_mode(path: str, paths: Paths) -> int:
    return 0o700 if os.path.dirname(path) == os.path.dirname(paths.node_key) else 0o755


def _apply(root: Root, targets: dict, only=None) -> list:
    """Write (or remove) each target whose file differs; the machine paths that changed."""
    changed = []
    for path, (data, mode) in targets.items():
        if only is not None and path not in only:
            continue
        if nodeedit.put(root.real(path), data, mode if mode is not None else 0o644):
            changed.append(path)
    return changed


def _snapshot(root: Root, targets: dict, only: set) -> dict:
    return {path: nodeedit.read(root.real(path))[:2] for path in targets if path in only}


def _sshd_change(root: Root, sshd: Sshd, settings: dict, targets: dict, paths: Paths) -> dict:
    """Apply the sshd files; if sshd then refuses its configuration, put the previous files back
    and fail with sshd's words.  Reloads sshd when something changed."""
    only = paths.sshd_files()
    before = _snapshot(root, targets, only)
    changed = _apply(root, targets, only)
    result = {"config": paths.sshd_config, "changed": bool(changed), "checked": False, "reloaded": None}
    if not changed:
        return dict(result, paths=[])
    refused = sshd.check()
    if refused:
        for path, (data, mode) in before.items():
            nodeedit.put(root.real(path), data, mode if mode is not None else 0o644)
        still = sshd.check()
        raise AgentError(NOT_RETRYABLE, "sshd refuses its configuration with the cluster's sshd files (sshd -t: %s); "
                                        "the previous files are back%s" % (
                                            refused, "" if still is None else ", and sshd refuses those too: " + still))
    result["checked"] = True
    result["reloaded"], warning = sshd.reload(settings)
    return dict(result, paths=changed, warning=warning)


def _paths_for(root: Root, record: Record, sshd: Sshd, settings: dict) -> Paths:
    """The sshd configuration and authorized keys file: those the first write edited (remove
    must find its blocks where it put them), else those sshd reads."""
    config = record.paths.get("sshd_config") or sshd.config
    keys = record.paths.get("authorized_keys") or authorized_keys_file(settings, root_home())
    record.paths.update(sshd_config=config, authorized_keys=keys)
    return Paths(config, keys)


@command("node", "files", "write")
def cmd_write(args, out) -> int:
    """``node files write`` with the spec on stdin: put this node's cluster files in place.

    Stdin: ``{"cluster", "hostfile", "cluster_env", "hosts", "ssh": {"private_key",
    "public_key", "allow_from", "nodes": [{"name", "address", "port", "host_keys"}]}, "sshd":
    {"dropin", "ca_public_key", "principals"}}`` (``nodespec``).  A part that is not what it
    claims is ``bad_input``; sshd refusing its configuration before the change, or refusing the
    change (then the previous files are back), is ``not_retryable`` with sshd's words.  Result:
    ``{"cluster", "changed", "paths", "sshd": {"config", "include_added", "checked",
    "reloaded"}, "host_key_checking", "warnings"}``.
    """
    spec = _read_stdin_spec()
    root = Root.from_env()
    _require_root(root)
    with _lock():
        sshd = Sshd.find(root)
        settings = sshd.effective()
        record = Record(root)
        record.cluster = spec["cluster"]
        paths = _paths_for(root, record, sshd, settings)
        targets = _write_targets(spec, root, record, paths)
        for path in targets:
            nodeedit.ensure_dir(root, os.path.dirname(path), _dir_mode(path, paths), record.dirs)
        nodeedit.ensure_dir(root, os.path.dirname(nodeedit.RECORD), 0o755, record.dirs)
        record.save()  # before any change: what the files were is known even if this run stops half way
        sshd_result = _sshd_change(root, sshd, settings, targets, paths)
        changed = sshd_result.pop("paths") + _apply(root, {p: t for p, t in targets.items() if p not in paths.sshd_files()})
        warnings = [w for w in (sshd_result.pop("warning", None),) if w]
        if sshd_result["changed"] and first(sshd.effective(), "trustedusercakeys") != CA_KEY:
            warnings.append("sshd -T does not show TrustedUserCAKeys %s: a setting in %s before the drop-in wins, so "
                            "certificate logins stay off" % (CA_KEY, paths.sshd_config))
    include = block_drop(decode(nodeedit.read(root.real(paths.sshd_config))[0]), INCLUDE_BEGIN, INCLUDE_END)
    for warning in warnings:
        out.log(warning)
    return out.result(cluster=spec["cluster"], changed=bool(changed), paths=sorted(changed),
                      sshd={"config": paths.sshd_config, "include_added": not includes(include, DROPIN),
                            "checked": sshd_result["checked"], "reloaded": sshd_result["reloaded"]},
                      host_key_checking=nodespec.strict_checking(spec["ssh"]["nodes"]), warnings=warnings)


@command("node", "files", "remove")
def cmd_remove(args, out) -> int:
    """``node files remove``: take away everything ``node files write`` put on this machine.

    Whole files are deleted, or put back as they were before the first write; the blocks leave
    ``/etc/hosts``, root's SSH files and the sshd configuration, which are otherwise left byte
    for byte as they were; directories it made go when empty; sshd is checked and reloaded when
    its files changed.  Removing again is harmless.  Result: ``{"changed", "paths", "removed",
    "restored", "sshd": {"config", "checked", "reloaded"}, "warnings"}``.
    """
    root = Root.from_env()
    _require_root(root)
    with _lock():
        sshd = Sshd.find(root)
        settings = sshd.effective()
        record = Record(root)
        paths = _paths_for(root, record, sshd, settings)
        targets = _remove_targets(root, record, paths)
        sshd_result = _sshd_change(root, sshd, settings, targets, paths)
        changed = sshd_result.pop("paths") + _apply(root, {p: t for p, t in targets.items() if p not in paths.sshd_files()})
        warning = sshd_result.pop("warning", None)
        record.forget()
        gone = nodeedit.remove_dirs(root, record.dirs)
    removed = sorted(p for p in changed if targets[p][0] is None) + sorted(gone)
    restored = sorted(p for p in changed if p in paths.whole() and targets[p][0] is not None)
    if warning:
        out.log(warning)
    return out.result(changed=bool(changed or gone), paths=sorted(changed), removed=removed, restored=restored,
                      sshd={"config": paths.sshd_config, "checked": sshd_result["checked"],
                            "reloaded": sshd_result["reloaded"]}, warnings=[warning] if warning else [])


# ------------------------------------------------------------------ revocations

group("node", "revocations", help="the cluster's key revocation list: node-login certificates taken back")


@command("node", "revocations", "write", args=[
    arg("--cluster", required=True, metavar="CLUSTER", help="the cluster whose node settings this machine holds")])
def cmd_revocations_write(args, out) -> int:
    """``node revocations write --cluster C`` with the KRL's bytes on stdin: replace the key revocation list.

    Stdin: an OpenSSH key revocation list (KRL, format 1), as the console makes it for the cluster's
    node-login certificates taken back. It replaces ``/etc/fadenstack/ssh/revoked.krl`` (0644, written
    aside then renamed), which the node settings' drop-in names as sshd's ``RevokedKeys``; sshd reads it
    at every login, so nothing is reloaded. Refused, ``not_retryable``, when this machine's node settings
    are not the cluster's (another cluster's, or none: it left), or were written without a list; a
    list that is not a KRL is ``bad_input``. Result: ``{"cluster", "path", "changed", "bytes"}``.
    """
    root = Root.from_env()
    _require_root(root)
    if not nodespec.CLUSTER_RE.match(args.cluster or ""):
        raise AgentError(BAD_INPUT, "--cluster must be a cluster name, got %r" % args.cluster)
    data = _read_stdin_bytes(nodespec.KRL_MAX + 1)
    nodespec.check_krl(data, "the revocation list on stdin")
    with _lock():
        record = Record(root)
        if record.cluster != args.cluster:
            raise AgentError(NOT_RETRYABLE, "this machine holds the node settings of %s, not of %s: no revocation list "
                                            "written" % (record.cluster or "no cluster", args.cluster))
        if nodeedit.read(root.real(REVOKED_KEYS))[0] is None:
            raise AgentError(NOT_RETRYABLE, "the node settings here were written without a revocation list (an "
                                            "older console): write the node settings again first")
        changed = nodeedit.put(root.real(REVOKED_KEYS), data, 0o644)
    return out.result(cluster=args.cluster, path=REVOKED_KEYS, changed=changed, bytes=len(data))


def _read_stdin_bytes(limit: int, wait: float = 30.0) -> bytes:
    """Stdin up to its end (the console closes it after the list), within ``wait`` seconds."""
    chunks, size, deadline = [], 0, time.monotonic() + wait
    while size <= limit:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([0], [], [], left)[0]:
            raise AgentError(BAD_INPUT, "the revocation list did not end on stdin within %d s" % wait)
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise AgentError(BAD_INPUT, "the revocation list on stdin is larger than %d bytes" % (limit - 1))
    return b"".join(chunks)

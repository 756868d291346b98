"""``cluster secrets write|remove --cluster C``: the cluster's secrets on this machine.

Each cluster a machine belongs to has a directory of its own, ``/etc/fadenstack/clusters/<cluster>/``
(``<home>/clusters/<cluster>/`` for an agent not run as root; ``FADEN_AGENT_SECRETS`` overrides the
parent in tests), owned by the agent's user, mode 0700 (and its parent too), each file 0600.  Only the
agent writes there, and never through a link: every directory is opened with ``O_NOFOLLOW``, every
file is written under a temporary name with ``O_CREAT | O_EXCL | O_NOFOLLOW`` in that opened directory
and renamed over the old one (a reader sees the old file or the new).  The directory is mounted
read-only into the cluster's runtime container at ``/etc/fadenstack/cluster``
(``containers.SECRETS_IN_CONTAINER``).  ``secretsdir`` holds the safe writes, for other commands' files there.

- ``cluster secrets write --cluster C`` reads ``{"ray_token": "..."}`` on stdin (never a command line:
  ``ps`` would show it) and writes ``ray-token``: Ray's token (``RAY_AUTH_MODE=token``, read from
  ``RAY_AUTH_TOKEN_PATH``).  The answer names the files, never their content.
- ``cluster secrets remove --cluster C`` removes the directory and all in it (links are removed,
  never followed).  Running it again is a no-op.
"""

import json
import os
import re
import shutil
import stat

from .blobspec import read_spec
from .cli import arg, command, group
from .protocol import BAD_INPUT, AgentError
from .secretsdir import RAY_TOKEN, check_cluster, cluster_dir, open_cluster_dir, write_file

FIELDS = {"ray_token": RAY_TOKEN}           # stdin's key -> the file it is written to
TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{16,256}$")
SHAPE = '{"ray_token": "..."} (16 to 256 letters, digits, - and _)'

group("cluster", help="this machine's part of a cluster")
group("cluster", "secrets", help="the cluster's secrets on this machine (Ray's token)")
CLUSTER = arg("--cluster", required=True, metavar="NAME", help="the cluster's name")


def parse_secrets(data: bytes) -> dict:
    """stdin's JSON -> ``{file name: content}``; anything else is refused (the value never in the message)."""
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise AgentError(BAD_INPUT, "send one JSON object on stdin: %s" % SHAPE)
    if not isinstance(value, dict) or not value:
        raise AgentError(BAD_INPUT, "send one JSON object on stdin: %s" % SHAPE)
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise AgentError(BAD_INPUT, "unknown secret(s) %s: send %s" % (", ".join(map(repr, unknown))[:200], SHAPE))
    files = {}
    for key, name in FIELDS.items():
        if key not in value:
            raise AgentError(BAD_INPUT, "%s is missing: send %s" % (key, SHAPE))
        token = value[key]
        if not isinstance(token, str) or not TOKEN_RE.match(token):
            raise AgentError(BAD_INPUT, "%s is not a token: send %s" % (key, SHAPE))
        files[name] = token.encode("ascii")
    return files


def write_secrets(cluster: str, files: dict) -> str:
    fd = open_cluster_dir(cluster)
    try:
        for name, data in files.items():
            write_file(fd, name, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return cluster_dir(cluster)


def remove_secrets(cluster: str) -> bool:
    """Remove the cluster's directory (a link there is removed, not followed); False when none was there."""
    path = cluster_dir(cluster)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(path)
        return True
    shutil.rmtree(path)   # fd-based where the platform allows: a link inside is removed, never followed
    return True


# ------------------------------------------------------------------ commands


@command("cluster", "secrets", "write", args=[CLUSTER])
def cmd_write(args, out):
    """``cluster secrets write --cluster C``: write the cluster's secrets sent on stdin as
    ``{"ray_token": "..."}`` into ``/etc/fadenstack/clusters/C/`` (0700, files 0600, never through a link).

    Result: ``{"cluster", "dir", "files": ["ray-token"]}``; the secrets themselves are never printed."""
    check_cluster(args.cluster)
    try:
        data = read_spec(noun="secrets")
    except AgentError as exc:
        raise AgentError(exc.kind, "no secrets arrived on stdin: send %s" % SHAPE)
    files = parse_secrets(data)
    directory = write_secrets(args.cluster, files)
    return out.result(cluster=args.cluster, dir=directory, files=sorted(files))


@command("cluster", "secrets", "remove", args=[CLUSTER])
def cmd_remove(args, out):
    """``cluster secrets remove --cluster C``: remove the cluster's secrets directory from this machine.

    Result: ``{"cluster", "removed": true | false}`` (false: there was none)."""
    return out.result(cluster=args.cluster, removed=remove_secrets(check_cluster(args.cluster)))

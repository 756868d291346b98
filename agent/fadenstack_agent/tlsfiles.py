"""Where a cluster's TLS files are on this machine, and the environment that turns Ray's TLS on.

The files are in the ``tls/`` directory of the cluster's secrets directory
(``/etc/fadenstack/clusters/<cluster>/tls/``; ``<home>/clusters/...`` for an agent not run as root;
``FADEN_AGENT_SECRETS`` overrides the parent, as for the cluster's other secrets), 0700, each file 0600:

- ``ca.pem``: the console's certificate authority, the only one Ray and the copies trust;
- ``node.key`` / ``node.pem``: the Ray node's key (made here, never sent anywhere) and certificate;
- ``copy.key`` / ``copy.pem``: the copy server's;
- ``<role>.key.new``: a key made by ``tls request`` whose certificate has not come yet.

The runtime container sees the cluster's directory read-only at ``/etc/fadenstack/cluster``. Ray reads
its TLS files when it starts, so a renewed certificate takes effect at Ray's next start; the copies'
engines read theirs at their start too. The standard library only; nothing here runs a command.
"""

import os
import stat

from .containers import CLUSTER_RE
# The cluster's directory is the secrets directory's (clustersecrets.py writes Ray's token there).
from .secretsdir import cluster_dir, open_path

IN_CONTAINER = "/etc/fadenstack/cluster"     # the cluster's directory as its runtime container sees it
TLS = "tls"
ROLES = ("node", "copy")
CA = "ca.pem"
# Ray's variables for TLS: on, and the node's certificate, key and the authority it trusts.
RAY_TLS_NAMES = ("RAY_USE_TLS", "RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def tls_dir(cluster: str) -> str:
    return os.path.join(cluster_dir(cluster), TLS)


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def installed(cluster: str, role: str = "node") -> bool:
    """Whether the role's certificate, its key and the authority are all here (regular files, no links)."""
    directory = tls_dir(cluster)
    return all(_regular(os.path.join(directory, name)) for name in (CA, role + ".pem", role + ".key"))


def ray_tls_environ(cluster, in_container: bool) -> dict:
    """Ray's TLS variables for the cluster when its node certificate is installed here, else {} (Ray
    without TLS). Paths as Ray sees them: in the runtime container, or on this machine (``process``)."""
    if not cluster or not CLUSTER_RE.match(str(cluster)) or not installed(cluster, "node"):
        return {}
    base = IN_CONTAINER + "/" + TLS if in_container else tls_dir(cluster)
    return {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": base + "/node.pem",
            "RAY_TLS_SERVER_KEY": base + "/node.key", "RAY_TLS_CA_CERT": base + "/" + CA}


def export_ray_tls(cluster, in_container: bool) -> dict:
    """Put the cluster's Ray TLS variables into this process's environment (Ray's commands and the
    container's ``-e NAME`` take them from there), or take them out when it has none."""
    values = ray_tls_environ(cluster, in_container)
    for name in RAY_TLS_NAMES:
        os.environ.pop(name, None)
    os.environ.update(values)
    return values


def open_dir(path: str, create: bool = False) -> int:
    """Open ``path`` (each part from the secrets root down) without following a link; made 0700 when
    created, refused when another user owns it, narrowed to 0700 otherwise."""
    return open_path(path, create, what="the cluster's TLS files")


def read_file(dir_fd: int, name: str):
    """The content of regular file ``name`` in ``dir_fd`` (never through a link), or None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)

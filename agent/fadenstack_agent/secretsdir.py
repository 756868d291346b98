"""Where the cluster's secrets live on this machine (``clustersecrets`` writes them; the runtime
container mounts them read-only at ``containers.SECRETS_IN_CONTAINER``).

``/etc/fadenstack/clusters/<cluster>/`` as root, ``<home>/clusters/<cluster>/`` otherwise;
``FADEN_AGENT_SECRETS`` overrides the parent (tests).
"""

import errno
import os
import stat

from .containers import CLUSTER_RE, RAY_TOKEN_FILE
from .files import agent_home, is_root
from .protocol import BAD_INPUT, NOT_RETRYABLE, AgentError

SYSTEM_ROOT = "/etc/fadenstack/clusters"
ENV_ROOT = "FADEN_AGENT_SECRETS"
RAY_TOKEN = RAY_TOKEN_FILE


def secrets_root() -> str:
    """The parent of every cluster's directory."""
    configured = os.environ.get(ENV_ROOT)
    if configured:
        return os.path.abspath(configured)
    return SYSTEM_ROOT if is_root() else os.path.join(agent_home(), "clusters")


def check_cluster(cluster) -> str:
    if not isinstance(cluster, str) or not CLUSTER_RE.match(cluster):
        raise AgentError(BAD_INPUT, "--cluster must be 1 to 63 lowercase letters, digits and dashes, not "
                                    "starting or ending with a dash, got %r" % (cluster,))
    return cluster


def cluster_dir(cluster: str) -> str:
    """The cluster's secrets directory on this machine (not created here)."""
    return os.path.join(secrets_root(), check_cluster(cluster))


def ray_token_path(cluster: str):
    """Ray's token file on this machine when it is there (a regular file, not a link), else None."""
    path = os.path.join(cluster_dir(cluster), RAY_TOKEN)
    try:
        return path if stat.S_ISREG(os.lstat(path).st_mode) else None
    except OSError:
        return None


def _open_dir(name: str, parent_fd, create: bool, what: str) -> int:
    """Open directory ``name`` (in ``parent_fd``) without following a link; made 0700 when created,
    refused when another user owns it, its mode narrowed to 0700 otherwise. ``what`` names the files
    it holds, in the refusals."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except FileNotFoundError:
        raise AgentError(NOT_RETRYABLE, "%s is not there: %s are not on this machine" % (name, what))
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise AgentError(NOT_RETRYABLE, "%s is not a directory (a link or a file is there): %s are not "
                                            "written through it" % (name, what))
        raise
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        os.close(fd)
        raise AgentError(NOT_RETRYABLE, "%s belongs to user %d, not to the agent's: %s are not written there"
                         % (name, info.st_uid, what))
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def open_path(path: str, create: bool = False, what: str = "the cluster's secrets") -> int:
    """Open directory ``path``, under the secrets root, each part from the root down as ``_open_dir``
    opens one (never through a link, 0700, the agent's own)."""
    root = secrets_root()
    os.makedirs(os.path.dirname(root), mode=0o755, exist_ok=True)
    fd = _open_dir(root, None, create, what)
    try:
        for part in os.path.relpath(path, root).split(os.sep):
            if part in ("", "."):
                continue
            child = _open_dir(part, fd, create, what)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_cluster_dir(cluster: str) -> int:
    return open_path(cluster_dir(cluster), create=True)


def make_cluster_dir(cluster: str) -> str:
    """The cluster's directory, made (0700, never through a link) when it is not there yet."""
    os.close(open_cluster_dir(cluster))
    return cluster_dir(cluster)


def write_file(dir_fd: int, name: str, data: bytes) -> None:
    """``name`` in ``dir_fd``, 0600: a temporary name made with O_EXCL|O_NOFOLLOW, then a rename (which
    replaces a link of that name, never what it points to)."""
    temporary = "." + name + ".new"
    try:
        os.unlink(temporary, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

"""The head's launches for ``allreduce run``: the runtime's launcher asks, the agent reaches the node.

The cluster's SSH (root's key) stays on the machine: neither the key nor any copy of it enters the
runtime. mpirun, in the runtime, calls its launcher (``allreducespec.LAUNCHER``) for each other node;
the launcher connects to this run's socket, an abstract Unix socket of a random name (the runtime
shares the machine's network namespace, so it reaches it without a mount; nothing on disk to plant a
link in), and sends ``{"host", "command"}`` with its stdout and stderr (SCM_RIGHTS). The agent:

- takes only callers from the run's runtime: the peer's pid (``SO_PEERCRED``, which the kernel gives,
  in the machine's pid namespace) must be in the runtime container's pid namespace, or, with the
  ``process`` driver, a descendant of the run's mpirun;
- launches only what the run needs: each node of the spec once (never another address), the command
  one line of text, which goes as a single quoted word to that node's
  ``allreduce exec`` and runs in that node's runtime, never on the machine;
- runs ``ssh`` itself (on the machine, as root, with the run's SSH config), the daemon's output going
  to the launcher's stdout and stderr, and answers ``exit N`` with ssh's exit status (the daemon's);
- ends the ssh when the launcher goes (mpirun ended or killed it: its socket closes), which closes the
  node's session and makes its ``allreduce exec`` end its part; and at the run's end, whatever is left.
"""

import array
import json
import os
import secrets
import signal
import socket
import stat
import struct
import subprocess
import threading

from .allreducespec import check_launch
from .files import agent_home
from .protocol import NOT_RETRYABLE, AgentError

RUN_DIR = "allreduce"  # under the agent's home (root's only): the run's record and SSH config, the process driver's files
REQUEST_MAX = 128 * 1024
REQUEST_SECONDS = 30
END_GRACE = 5.0


# ------------------------------------------------------------------ the agent's own files for the run


def private_dir(store: str) -> str:
    """``<agent home>/allreduce``: made 0700, and refused unless it is a real directory that only this
    agent's user owns, outside the store (which the runtime sees)."""
    path = os.path.join(agent_home(), RUN_DIR)
    os.makedirs(path, mode=0o700, exist_ok=True)
    found = os.lstat(path)
    real, store_real = os.path.realpath(path), os.path.realpath(store)
    if (not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid()
            or real == store_real or real.startswith(store_real.rstrip("/") + "/")):
        raise AgentError(NOT_RETRYABLE, "%s must be a directory of the agent's own, outside the store %s"
                         % (path, store))
    os.chmod(path, 0o700)
    return path


def write_private(path: str, data: bytes, mode: int = 0o600) -> None:
    """``data`` into ``path`` (in ``private_dir``): a fresh name opened with ``O_NOFOLLOW|O_CREAT|O_EXCL``,
    then renamed over, so a link in its place is replaced, never followed."""
    tmp = "%s.%d.tmp" % (path, os.getpid())
    remove_quietly(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.rename(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def read_private(path: str):
    """A file of ``private_dir`` (``O_NOFOLLOW``), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        return handle.read(1 << 20)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass



# ------------------------------------------------------------------ the launches


def socket_name() -> str:
    return "fadenstack-allreduce-" + secrets.token_hex(16)


def peer_pid(conn: socket.socket) -> int:
    pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid


def _pid_namespace(pid: int):
    try:
        return os.stat("/proc/%d/ns/pid" % pid).st_ino
    except OSError:
        return None


def in_namespace_of(anchor: int):
    """A peer check: the peer is in the pid namespace of ``anchor`` (the runtime container's first
    process), which is not the agent's own."""
    def check(pid: int) -> bool:
        theirs, ours = _pid_namespace(anchor), _pid_namespace(os.getpid())
        return theirs is not None and theirs != ours and _pid_namespace(pid) == theirs
    return check


def descendant_of(root: int):
    """A peer check: the peer is ``root`` or one of its descendants (the ``process`` driver's mpirun)."""
    def check(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            if pid == root:
                return True
            seen.add(pid)
            try:
                with open("/proc/%d/stat" % pid) as handle:
                    pid = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return False
        return False
    return check


def _receive(conn: socket.socket):
    """The request's bytes (one line) and the fds that came with it."""
    data, fds = b"", []
    conn.settimeout(REQUEST_SECONDS)
    while not data.endswith(b"\n"):
        chunk, ancillary, _flags, _addr = conn.recvmsg(65536, socket.CMSG_SPACE(2 * array.array("i").itemsize))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                given = array.array("i")
                given.frombytes(payload[:len(payload) - len(payload) % given.itemsize])
                fds += list(given)
        if not chunk:
            break
        data += chunk
        if len(data) > REQUEST_MAX:
            break
    return data, fds


class LaunchServer:
    """One run's socket, served on a thread while the run lasts (``close`` ends it and its launches)."""

    def __init__(self, name: str, hosts, ssh_for, allowed, logger=None):
        self.name, self.hosts, self.ssh_for, self.allowed = name, set(hosts), ssh_for, allowed
        self.log = logger or (lambda text: None)
        self.lock = threading.Lock()
        self.procs = []
        self.closed = False
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + name)
        self.sock.listen(64)
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        fds = []
        try:
            pid = peer_pid(conn)
            if not self.allowed(pid):
                self.log("refused a launch from pid %d: not the run's runtime" % pid)
                conn.sendall(b"refused not the run's runtime\n")
                return
            data, fds = _receive(conn)
            try:
                request = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                request = None
            with self.lock:
                host, command = check_launch(request, self.hosts)
                if self.closed:
                    raise AgentError(NOT_RETRYABLE, "the run has ended")
                self.hosts.discard(host)  # each node once
            out = fds[0] if len(fds) > 0 else subprocess.DEVNULL
            err = fds[1] if len(fds) > 1 else subprocess.DEVNULL
            argv = self.ssh_for(host, command)
            self.log("launching on %s: %s" % (host, " ".join(argv[:-1])))
            with self.lock:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd="/",
                                        start_new_session=True)
                self.procs.append(proc)
            for fd in fds:
                os.close(fd)
            fds = []
            code = self._wait(proc, conn)
            conn.sendall(b"exit %d\n" % code)
        except AgentError as exc:
            self._answer(conn, "refused " + exc.message)
        except (OSError, socket.timeout) as exc:
            self._answer(conn, "refused %s" % exc)
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()

    @staticmethod
    def _answer(conn, text: str) -> None:
        try:
            conn.sendall(text.replace("\n", " ").encode("utf-8", "replace") + b"\n")
        except OSError:
            pass

    @staticmethod
    def _wait(proc, conn: socket.socket) -> int:
        """ssh's exit status (128 + a signal); SIGTERM to it when the launcher goes first."""
        conn.settimeout(0.5)
        while proc.poll() is None:
            try:
                if conn.recv(1) == b"":
                    proc.terminate()  # the launcher is gone: mpirun ended it
                    break
            except socket.timeout:
                continue
            except OSError:
                proc.terminate()
                break
        code = proc.wait()
        return 128 - code if code < 0 else code

    def close(self) -> None:
        """No more launches; the ssh sessions still open get SIGTERM, SIGKILL after a grace."""
        with self.lock:
            self.closed = True
            procs = list(self.procs)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(END_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

"""A Docker daemon of the tests' own, for the docker driver's real-engine tests.

When no Docker daemon answers here, ``dockerd`` is installed (Debian's
``docker.io``) and we are root, ``docker_env`` starts a private daemon: its
data root, exec root (where it keeps its own containerd), pid file, config
file and unix socket all in a fresh directory under /tmp, no TCP socket, and
``--iptables=false --ip6tables=false --bridge=none`` (the containers run on
the host's network, as the agent's do; nothing of the host's firewall or
links is touched). It answers in about 0.2 s. At the end of the session it
is stopped (its containers removed, SIGTERM, SIGKILL after a while), any
process still naming its directory (a containerd or a shim) is killed, any
mount left under its directory is unmounted, and the directory is removed.

A daemon that already answers (the system's, or DOCKER_HOST's) is used as it
is and never stopped, and the private daemon never speaks to the system's
socket (/var/run/docker.sock): everything that talks to it is given
DOCKER_HOST.
"""

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

START_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0
PR_SET_PDEATHSIG = 1


def docker_answers(env=None, timeout=20):
    """(True, version) when the ``docker`` client reaches a daemon with ``env``, else (False, its words)."""
    try:
        proc = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "docker version did not answer within %d s" % timeout
    return proc.returncode == 0, proc.stdout.decode(errors="replace").strip()


def _die_with_parent():
    """In the child: SIGTERM when the test process dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (AttributeError, OSError):
        pass


def _unescape(field):
    """A path as /proc/mounts writes it (space, tab, newline, backslash as octal escapes)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mounts_under(root):
    """The mount points at or below ``root``, deepest first."""
    found = []
    with open("/proc/mounts") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) > 1:
                point = _unescape(fields[1])
                if point == root or point.startswith(root + os.sep):
                    found.append(point)
    return sorted(set(found), key=lambda p: p.count(os.sep), reverse=True)


def daemon_pids(root):
    """The Docker daemon's own processes (dockerd, containerd, shims) whose command line names ``root``."""
    found = []
    needle = root.encode() + b"/"
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/comm" % entry, "rb") as fh:
                comm = fh.read().strip()
            with open("/proc/%s/cmdline" % entry, "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if comm.startswith((b"dockerd", b"containerd", b"docker-")) and needle in cmdline:
            found.append(int(entry))
    return found


class DidNotStart(Exception):
    pass


class PrivateDockerd:
    """One dockerd in a directory of its own; ``start`` then ``stop`` (which is safe to call at any point)."""

    def __init__(self, dockerd="dockerd"):
        self.dockerd = dockerd
        self.root = tempfile.mkdtemp(prefix="faden-dockerd-")
        self.socket = os.path.join(self.root, "docker.sock")
        self.host = "unix://" + self.socket
        self.log_path = os.path.join(self.root, "dockerd.log")
        self.proc = None
        self.startup_seconds = None

    @property
    def env(self):
        return dict(os.environ, DOCKER_HOST=self.host)

    def argv(self):
        config = os.path.join(self.root, "daemon.json")
        with open(config, "w") as fh:
            fh.write("{}\n")  # not /etc/docker/daemon.json
        return [self.dockerd, "--data-root", os.path.join(self.root, "data"),
                "--exec-root", os.path.join(self.root, "exec"), "--pidfile", os.path.join(self.root, "dockerd.pid"),
                "--config-file", config, "-H", self.host,
                "--iptables=false", "--ip6tables=false", "--bridge=none"]

    def last_log_lines(self, count=15):
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-count:]).strip()
        except OSError:
            return ""

    def start(self, timeout=START_TIMEOUT):
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.root, start_new_session=True, preexec_fn=_die_with_parent)
        words = ""
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise DidNotStart("dockerd exited with status %s:\n%s" % (self.proc.returncode, self.last_log_lines()))
            if os.path.exists(self.socket):
                ok, words = docker_answers(self.env, timeout=5)
                if ok:
                    self.startup_seconds = time.monotonic() - started
                    return self
            time.sleep(0.05)
        raise DidNotStart("dockerd did not answer within %d s (%s):\n%s" % (timeout, words, self.last_log_lines()))

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            # Its containers first, so no shim outlives the daemon.
            try:
                ids = subprocess.run(["docker", "ps", "-aq"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=self.env, timeout=20).stdout.decode().split()
                if ids:
                    subprocess.run(["docker", "rm", "-f"] + ids, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env=self.env, timeout=60)
            except subprocess.TimeoutExpired:
                pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid in daemon_pids(self.root):  # its containerd or shims, should the daemon have left any
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for point in mounts_under(self.root):
            if subprocess.run(["umount", point], stderr=subprocess.DEVNULL).returncode:
                subprocess.run(["umount", "-R", "-l", point], stderr=subprocess.DEVNULL)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def docker_env():
    """What the docker tests add to the environment of their ``docker`` calls and of the agents they start:
    nothing when a Docker daemon already answers, else DOCKER_HOST of a private daemon. Skips when neither."""
    ok, words = docker_answers()
    if ok:
        yield {}
        return
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        pytest.skip("no Docker daemon answers here (%s) and dockerd (docker.io) is not installed" % words[:200])
    if os.geteuid() != 0:
        pytest.skip("no Docker daemon answers here (%s) and a private one needs root" % words[:200])
    daemon = PrivateDockerd(dockerd)
    try:
        daemon.start()
    except DidNotStart as exc:
        daemon.stop()
        pytest.skip("a private dockerd did not come up: %s" % exc)
    except BaseException:
        daemon.stop()
        raise
    try:
        yield {"DOCKER_HOST": daemon.host}
    finally:
        daemon.stop()

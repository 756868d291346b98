"""The machine's sshd as ``node files`` meets it: which sshd serves this machine and from which
configuration, what it reads (``sshd -T``), whether it accepts a change (``sshd -t``), and its
reload.

The sshd that matters is the one the console's own session came through: the topmost ``sshd``
among this process's ancestors (the listener; the per-connection ``sshd``/``sshd-session``
processes sit below it).  Its command line says which configuration it reads (``-f``; the lab's
machines run ``sshd -f /run/fadenstack-lab/ssh/sshd_config``), else ``/etc/ssh/sshd_config``.
Where no ancestor is sshd (tests, a console session that is not SSH), ``sshd`` from the usual
places and the default configuration.  ``FADEN_NODE_FILES_SSHD`` names the binary instead (the
tests' stand-in); under ``FADEN_NODE_FILES_ROOT`` no ancestor is looked at and systemd is not asked.

Reload: ``systemctl reload`` of ``ssh.service`` or ``sshd.service`` where systemd runs and that
unit is active, else SIGHUP to the pid in sshd's pid file (``sshd -T``'s ``pidfile``), else to the
listener found above.  sshd re-executes itself on SIGHUP, which is why ``sshd -t`` comes first: a
configuration it refuses would end it.
"""

import os
import shutil
import signal
import subprocess

from .protocol import NOT_RETRYABLE, RETRYABLE, AgentError

ENV_SSHD = "FADEN_NODE_FILES_SSHD"
DEFAULT_CONFIG = "/etc/ssh/sshd_config"
SEARCH_PATH = "/usr/sbin:/usr/local/sbin:/sbin:/usr/bin:/bin"
UNITS = ("ssh.service", "sshd.service")
TIMEOUT = 30


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    stat = _read("/proc/%d/stat" % pid).decode("ascii", "replace")
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0


def _exe(pid: int) -> str:
    try:
        return os.readlink("/proc/%d/exe" % pid).split(" (deleted)")[0]
    except OSError:
        return ""


def cmdline(pid: int) -> list:
    """A process's arguments; a title sshd set for itself (``sshd: /usr/sbin/sshd -f ... [listener]``)
    comes as one string and is split at blanks."""
    words = [w for w in _read("/proc/%d/cmdline" % pid).decode("utf-8", "replace").split("\0") if w]
    return words[0].split() if len(words) == 1 else words


def listener():
    """``(pid, exe)`` of the sshd this process came through, or None."""
    found, pid, steps = None, os.getppid(), 0
    while pid > 1 and steps < 64:
        exe = _exe(pid)
        if os.path.basename(exe) == "sshd":
            found = (pid, exe)
        pid, steps = _parent(pid), steps + 1
    return found


def config_flag(words: list):
    """The ``-f FILE`` of an sshd command line, or None."""
    for i, word in enumerate(words):
        if word == "-f" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("-f") and len(word) > 2:
            return word[2:]
    return None


def _last_words(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-5:]) or "no words"


class Sshd:
    """This machine's sshd: its binary, its configuration (a machine path), the listener's pid."""

    def __init__(self, root, binary: str, config: str, listener_pid=None):
        self.root, self.binary, self.config, self.listener_pid = root, binary, config, listener_pid

    @classmethod
    def find(cls, root) -> "Sshd":
        found = None if root.overridden else listener()
        binary = os.environ.get(ENV_SSHD) or (found[1] if found else None) or shutil.which("sshd", path=SEARCH_PATH)
        if not binary:
            raise AgentError(NOT_RETRYABLE, "no sshd on this machine (looked in %s): the node files need the "
                                            "machine's sshd" % SEARCH_PATH.replace(":", ", "))
        config = (config_flag(cmdline(found[0])) if found else None) or DEFAULT_CONFIG
        return cls(root, binary, config, found[0] if found else None)

    def _run(self, argv: list) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  timeout=TIMEOUT)
        except FileNotFoundError:
            raise AgentError(NOT_RETRYABLE, "%s is not there to run" % argv[0])
        except subprocess.TimeoutExpired:
            raise AgentError(RETRYABLE, "%s did not answer within %d s" % (" ".join(argv[:2]), TIMEOUT))

    def effective(self) -> dict:
        """What sshd reads, from ``sshd -T``: keyword -> its values (a list per line it printed).
        A configuration sshd refuses already is ``not_retryable``: nothing is changed then."""
        done = self._run([self.binary, "-T", "-f", self.root.real(self.config)])
        if done.returncode != 0:
            raise AgentError(NOT_RETRYABLE, "sshd refuses its configuration %s as it is, before any change (sshd -T: "
                                            "%s): nothing was changed" % (self.config, _last_words(done.stderr.decode(
                                                "utf-8", "replace"))))
        settings = {}
        for line in done.stdout.decode("utf-8", "replace").splitlines():
            parts = line.split()
            if parts:
                settings.setdefault(parts[0].lower(), []).append(parts[1:])
        return settings

    def check(self):
        """``sshd -t``: None when sshd accepts its configuration, else sshd's own words."""
        done = self._run([self.binary, "-t", "-f", self.root.real(self.config)])
        return None if done.returncode == 0 else _last_words(done.stderr.decode("utf-8", "replace") + "\n"
                                                             + done.stdout.decode("utf-8", "replace"))

    def reload(self, settings: dict):
        """Have the running sshd read its files again: ``(how, warning)``; ``how`` None when no
        running sshd was found (it reads them when it next starts: the warning says so)."""
        if not self.root.overridden and os.path.isdir("/run/systemd/system") and shutil.which("systemctl"):
            for unit in UNITS:
                if self._run(["systemctl", "is-active", "--quiet", unit]).returncode == 0:
                    if self._run(["systemctl", "reload", unit]).returncode == 0:
                        return "systemctl reload %s" % unit, None
        pid_file = first(settings, "pidfile")
        pid = self._pid_in(pid_file) or self.listener_pid
        if pid:
            try:
                os.kill(pid, signal.SIGHUP)
                return "SIGHUP to sshd (pid %d)" % pid, None
            except ProcessLookupError:
                pass
        return None, ("no running sshd was found (pid file %s): sshd reads the new files when it next starts"
                      % (pid_file or "none"))

    def _pid_in(self, pid_file):
        if not pid_file or pid_file == "none":
            return None
        text = _read(self.root.real(pid_file)).decode("ascii", "replace").strip()
        if not text.isdigit():
            return None
        pid = int(text)
        # A pid file outlives its sshd, and pids are reused: only a process that is sshd gets the signal.
        return pid if any("sshd" in word for word in cmdline(pid)[:1]) else None


def first(settings: dict, keyword: str):
    """The first value sshd -T printed for ``keyword``, or None."""
    values = settings.get(keyword) or [[]]
    return values[0][0] if values[0] else None


def authorized_keys_file(settings: dict, home: str, user: str = "root") -> str:
    """The first file sshd reads ``user``'s keys from (``AuthorizedKeysFile``, tokens put in,
    a relative path under the home); ``~/.ssh/authorized_keys`` when sshd reads none."""
    values = (settings.get("authorizedkeysfile") or [[]])[0]
    path = values[0] if values and values[0] != "none" else ".ssh/authorized_keys"
    path = path.replace("%%", "\0").replace("%h", home).replace("%u", user).replace("%U", "0").replace("\0", "%")
    return path if path.startswith("/") else os.path.join(home, path)

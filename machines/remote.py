"""SSH to the machines: the console's own key, pinned host keys, timeouts everywhere.

Every command is an argv list joined with ``shlex.join``: nothing a user typed
is ever pasted into a shell string. A connection trusts exactly one host key,
the one pinned on the machine's row; any other key is refused with both
fingerprints named.
"""
from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import os
import shlex
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import paramiko
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from fabric import Config, Connection

from console.choices import ErrorKind
from console.files import write_once, writer_temporary

log = logging.getLogger(__name__)


class RemoteError(Exception):
    """A failure talking to a machine, in words for the administrator; ``kind`` decides retries."""

    def __init__(self, message: str, *, kind: str = ErrorKind.RETRYABLE):
        super().__init__(message)
        self.message = message
        self.kind = kind


class HostKeyMismatch(RemoteError):
    def __init__(self, *, address: str, pinned: str, offered: str):
        super().__init__(
            f"The host key of {address} changed: the console trusts {pinned}, the machine offered {offered}. "
            "This happens after a reinstall, or when something else answers at this address. "
            "If you know why, accept the new key on the machine's page.",
            kind=ErrorKind.NOT_RETRYABLE,
        )
        self.pinned = pinned
        self.offered = offered


@dataclass(frozen=True)
class Target:
    """Where and how to reach one machine. Build it from a validated Machine row only."""

    address: str
    port: int
    user: str
    fingerprint: str  # the pinned host key; empty only for scan_host_key


# -- the console's key ------------------------------------------------------------------


def console_key_path() -> Path:
    return Path(settings.FADEN_SSH_KEY_PATH)


def console_key() -> paramiko.Ed25519Key:
    """The console's ed25519 key, made on first use and kept 0600 in the data directory. Workers that
    make it at once keep the first one written; the public file beside it is that key's."""
    path = console_key_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
        write_once(path, pem)
    key = paramiko.Ed25519Key.from_private_key_file(str(path))
    public = path.with_suffix(".pub")
    if not public.exists():  # for the administrator (ssh-keygen -lf); the console reads the private key
        temporary = writer_temporary(public)
        temporary.write_text(_public_line(key) + "\n")
        os.replace(temporary, public)
    return key


def _public_line(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.get_base64()} fadenstack-console@{socket.gethostname()}"


def console_public_key() -> str:
    """The line to put in the machine's ``~/.ssh/authorized_keys``: the private key's own public part."""
    return _public_line(console_key())


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


# -- host keys --------------------------------------------------------------------------


def scan_host_key(address: str, port: int) -> str:
    """Fetch the machine's host key fingerprint without logging in."""
    timeout = settings.FADEN_SSH_CONNECT_TIMEOUT
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError as exc:
        raise RemoteError(f"Could not reach {address} port {port}: {exc.strerror or exc}.", kind=ErrorKind.UNREACHABLE) from exc
    transport = paramiko.Transport(sock)
    transport.banner_timeout = timeout
    try:
        transport.start_client(timeout=timeout)
        return fingerprint(transport.get_remote_server_key())
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise RemoteError(f"{address} port {port} did not answer as an SSH server: {exc}.", kind=ErrorKind.UNREACHABLE) from exc
    finally:
        transport.close()


class _PinnedHostKey(paramiko.MissingHostKeyPolicy):
    """Accept exactly the pinned key. No known_hosts file is read, so every key comes here."""

    def __init__(self, target: Target):
        self.target = target

    def missing_host_key(self, client, hostname, key):
        offered = fingerprint(key)
        if offered != self.target.fingerprint:
            raise HostKeyMismatch(address=self.target.address, pinned=self.target.fingerprint, offered=offered)


@contextmanager
def connect(target: Target) -> Iterator[Connection]:
    """An open Fabric connection to the machine, its host key checked against the pinned one."""
    if not target.fingerprint:
        raise RemoteError("The machine's host key has not been confirmed yet.", kind=ErrorKind.NOT_RETRYABLE)
    timeout = settings.FADEN_SSH_CONNECT_TIMEOUT
    config = Config(overrides={"load_ssh_configs": False, "connect_kwargs": {}})
    conn = Connection(
        host=target.address,
        port=target.port,
        user=target.user,
        config=config,
        connect_timeout=timeout,
        connect_kwargs={
            "pkey": console_key(),
            "look_for_keys": False,
            "allow_agent": False,
            "banner_timeout": timeout,
            "auth_timeout": timeout,
            "channel_timeout": timeout,
        },
    )
    # A fresh client: nothing from ~/.ssh/known_hosts, only the pin.
    conn.client = paramiko.SSHClient()
    conn.client.set_missing_host_key_policy(_PinnedHostKey(target))
    try:
        conn.open()
    except HostKeyMismatch:
        raise
    except paramiko.AuthenticationException as exc:
        raise RemoteError(
            f"{target.user}@{target.address} did not accept the console's key. "
            "Add the console's public key (on the Add a machine page) to that user's ~/.ssh/authorized_keys.",
            kind=ErrorKind.NOT_RETRYABLE,
        ) from exc
    except (socket.timeout, TimeoutError) as exc:
        raise RemoteError(f"{target.address} port {target.port} did not answer within {timeout} s.", kind=ErrorKind.UNREACHABLE) from exc
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise RemoteError(f"Could not connect to {target.address} port {target.port}: {exc}.", kind=ErrorKind.UNREACHABLE) from exc
    try:
        yield conn
    finally:
        conn.close()


# -- commands ---------------------------------------------------------------------------


@dataclass
class CommandResult:
    exit_status: int
    stdout: str
    stderr: str


def run(conn: Connection, argv: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
    """Run one command (an argv list) and collect its output; a silent command is cut off at the timeout."""
    lines: list[str] = []
    result = _exec(conn, argv, stdin=stdin, timeout=timeout, on_line=lines.append)
    result.stdout = "".join(lines)
    return result


def run_agent(
    conn: Connection,
    argv: Sequence[str],
    *,
    stdin: bytes | None = None,
    timeout: float | None = None,
    on_event: Callable[[dict], None] | None = None,
    abort: Callable[[], str | None] | None = None,
) -> dict:
    """Run an agent command and return its result event; raise its error event as a RemoteError.

    The agent prints one JSON object per line; progress and log events go to
    ``on_event`` as they arrive. ``abort`` is asked every second or so; a
    reason it returns ends the command as unreachable (a machine that went
    offline mid-way, say) instead of waiting for the timeout.
    """
    outcome: dict = {}

    def on_line(line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            log.debug("agent said: %s", line.rstrip())
            return
        if event.get("event") in ("result", "error"):
            outcome.update(event)
        elif on_event:
            on_event(event)

    result = _exec(conn, argv, stdin=stdin, timeout=timeout, on_line=on_line, abort=abort)
    if outcome.get("event") == "result":
        return outcome
    if outcome.get("event") == "error":
        raise RemoteError(outcome.get("message", "The agent failed without saying why."), kind=outcome.get("kind", ErrorKind.RETRYABLE))
    words = (result.stderr.strip().splitlines() or ["no output"])[-1]
    raise RemoteError(f"The agent stopped with exit status {result.exit_status}: {words}")


def _exec(
    conn: Connection, argv: Sequence[str], *, stdin: bytes | None, timeout: float | None, on_line, abort=None
) -> CommandResult:
    timeout = timeout or settings.FADEN_SSH_COMMAND_TIMEOUT
    command = shlex.join(argv)
    transport = conn.client.get_transport()
    try:
        channel = transport.open_session(timeout=settings.FADEN_SSH_CONNECT_TIMEOUT)
        channel.settimeout(1.0)
        channel.exec_command(command)
        if stdin is not None:
            channel.sendall(stdin)
        channel.shutdown_write()
    except (paramiko.SSHException, OSError) as exc:
        raise RemoteError(f"Could not run {argv[0]} on {conn.host}: {exc}.", kind=ErrorKind.UNREACHABLE) from exc
    deadline = time.monotonic() + timeout
    buffer, stderr = b"", b""
    while True:
        if time.monotonic() > deadline:
            channel.close()
            raise RemoteError(f"{argv[0]} on {conn.host} did not finish within {timeout:.0f} s.", kind=ErrorKind.RETRYABLE)
        while channel.recv_stderr_ready():
            stderr = (stderr + channel.recv_stderr(65536))[-65536:]
        try:
            chunk = channel.recv(65536)
        except socket.timeout:
            if abort and (reason := abort()):
                channel.close()
                raise RemoteError(reason, kind=ErrorKind.UNREACHABLE) from None
            continue
        if not chunk:  # stdout closed: the command is ending
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            on_line(line.decode(errors="replace") + "\n")
    if buffer:
        on_line(buffer.decode(errors="replace"))
    if not channel.status_event.wait(max(0.1, deadline - time.monotonic())):
        channel.close()
        raise RemoteError(f"{argv[0]} on {conn.host} did not finish within {timeout:.0f} s.", kind=ErrorKind.RETRYABLE)
    while channel.recv_stderr_ready():
        stderr += channel.recv_stderr(65536)
    status = channel.recv_exit_status()
    channel.close()
    return CommandResult(exit_status=status, stdout="", stderr=stderr.decode(errors="replace"))


def console_url(conn: Connection, seen_as: str = "") -> str:
    """The console's URL as the machine sees it: the setting, or the address its SSH session came from."""
    if settings.FADEN_CONSOLE_URL:
        return settings.FADEN_CONSOLE_URL.rstrip("/")
    seen_as = seen_as or (run(conn, ["printenv", "SSH_CONNECTION"]).stdout.split() or [""])[0]
    try:
        seen_as = ipaddress.ip_address(seen_as)
    except ValueError as exc:
        raise RemoteError(
            "Could not tell the console's address as the machine sees it; set FADEN_CONSOLE_URL.", kind=ErrorKind.NOT_RETRYABLE
        ) from exc
    host = f"[{seen_as}]" if seen_as.version == 6 else str(seen_as)
    return f"http://{host}:{settings.FADEN_WEB_PORT}"


def agent_console_url(conn: Connection, seen_as: str = "") -> str:
    """The agents' TLS listener as the machine sees it (console/agent_tls.py): FADEN_AGENT_TLS_URL, or the
    host of FADEN_CONSOLE_URL (else the address the SSH session came from) on FADEN_AGENT_TLS_PORT."""
    if settings.FADEN_AGENT_TLS_URL:
        return settings.FADEN_AGENT_TLS_URL
    host = urlsplit(console_url(conn, seen_as)).hostname
    host = f"[{host}]" if ":" in host else host
    return f"https://{host}:{settings.FADEN_AGENT_TLS_PORT}"


def upload(conn: Connection, local: Path, remote: str) -> None:
    """Copy a file over SFTP (the caller checks its digest afterwards)."""
    try:
        sftp = conn.sftp()
        sftp.get_channel().settimeout(settings.FADEN_SSH_COMMAND_TIMEOUT)
        sftp.put(str(local), remote)
    except (OSError, paramiko.SSHException) as exc:
        raise RemoteError(f"Could not copy {local.name} to {conn.host}: {exc}.") from exc

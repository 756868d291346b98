"""``faden ssh``: the user's key, a certificate for one node saved beside it, and OpenSSH's argv."""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from client.api import ClientError, Console

DEFAULT_KEY = "~/.ssh/id_ed25519"
# What the console may answer for ssh's argv: each must stay one word ssh does not read as an option.
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[?[0-9A-Fa-f:.]+\]?)$")
_JUMP = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class Key:
    identity: Path  # what ssh -i gets: the private key, or the .pub when only an agent holds the private key
    public_line: str


def key_read(named: str | None) -> Key:
    """The key ``-i`` names (the private key or its .pub), ``~/.ssh/id_ed25519`` when none is."""
    path = Path(os.path.expanduser(named or DEFAULT_KEY))
    public = path if path.name.endswith(".pub") else path.with_name(path.name + ".pub")
    private = public.with_name(public.name.removesuffix(".pub"))
    try:
        line = public.read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:
        raise ClientError(f"No public key at {public}: make one with ssh-keygen -t ed25519, or name yours with -i.") from None
    except OSError as unreadable:
        raise ClientError(f"Could not read {public}: {unreadable.strerror}.") from None
    return Key(identity=private if private.exists() else public, public_line=line)


def private_dir() -> Path:
    """A directory only this user can enter, for certificates: under $XDG_RUNTIME_DIR when there is
    one, else the temporary directory. One that exists must be ours, a directory, and 0700."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    uid = os.getuid() if hasattr(os, "getuid") else 0
    where = base / f"faden-ssh-{uid}"
    try:
        where.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(where)
    if not os.path.isdir(where) or os.path.islink(where) or info.st_uid != uid or info.st_mode & 0o077:
        raise ClientError(f"{where} is not a directory private to you: remove it, and try again.")
    return where


def certificate_write(certificate: str, *, cluster: str, serial: int, valid_before: str, where: Path | None = None) -> Path:
    """Save the certificate (0600, a new file, never through a link) and remove the ones that expired."""
    where = where or private_dir()
    now = time.time()
    for old in where.glob("*-cert.pub"):
        expiry = old.name.removesuffix("-cert.pub").rsplit("-", 1)[-1]
        if expiry.isdigit() and int(expiry) < now:
            old.unlink(missing_ok=True)
    expires = int(datetime.fromisoformat(valid_before.replace("Z", "+00:00")).timestamp())
    path = where / f"{_SAFE_NAME.sub('_', cluster)[:60] or 'cluster'}-{int(serial)}-{expires}-cert.pub"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as file:
        file.write(certificate.strip() + "\n")
    return path


def _ssh_option_path(path: Path) -> str:
    """A path as ssh's -o reads it: % starts a token there, and blanks need quotes."""
    text = str(path).replace("%", "%%")
    if '"' in text:
        raise ClientError(f"{path} has a double quote in it, which ssh's options cannot hold: set TMPDIR elsewhere.")
    return f'"{text}"' if any(c.isspace() for c in text) else text


def ssh_argv(node: dict, *, jump: str, key: Key, certificate: Path, options=(), command=()) -> list[str]:
    """OpenSSH's argv for a login to ``node`` (as the API answers it) with ``certificate``. What the
    console answered is checked to be one word each that ssh cannot read as an option."""
    user, address, port = node.get("ssh_user"), node.get("ssh_address"), node.get("ssh_port")
    if not isinstance(user, str) or not _USER.match(user):
        raise ClientError(f"The console named a login ssh would misread: {user!r}.")
    if not isinstance(address, str) or not _HOST.match(address):
        raise ClientError(f"The console named an address ssh would misread: {address!r}.")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ClientError(f"The console named a port that is not one: {port!r}.")
    if jump and not _JUMP.match(jump):
        raise ClientError(f"The console named a jump host ssh would misread: {jump!r}.")
    argv = ["ssh", "-i", str(key.identity), "-o", f"CertificateFile={_ssh_option_path(certificate)}", "-o", "IdentitiesOnly=yes"]
    argv += ["-J", jump] if jump else []
    argv += ["-p", str(port)] if port != 22 else []
    return [*argv, *options, "--", f"{user}@{address}", *command]


# -- the command -------------------------------------------------------------------------------------

_exec = os.execvp  # replaced in tests


@dataclass(frozen=True)
class NodeCertificate:
    answer: dict  # the console's answer: certificate, key_id, serial, valid_before, jump
    node: dict  # the one node it opens, as the API describes it
    path: Path  # where the certificate was saved


def node_certificate(console: Console, cluster: dict, key: Key, node: str) -> NodeCertificate:
    """Ask for a certificate for one node of ``cluster``, save it (0600) and say so on stderr."""
    answer = console.ssh_certificate(cluster["id"], public_key=key.public_line, node=node)
    nodes = answer.get("nodes") or []
    if len(nodes) != 1 or not isinstance(nodes[0], dict) or not answer.get("certificate"):
        raise ClientError("The console's answer holds no certificate for one node: is it a console of this version?")
    path = certificate_write(answer["certificate"], cluster=cluster["name"], serial=answer["serial"],
                             valid_before=answer["valid_before"])
    print(f"Certificate {answer['key_id']} for {nodes[0].get('name')} ({nodes[0].get('machine')}), valid until "
          f"{answer['valid_before']}.", file=sys.stderr)
    if fingerprint := nodes[0].get("host_key_fingerprint"):
        # The user's known_hosts has never seen the machine: this is what ssh's question should show.
        print(f"Its host key, as the console trusts it: {fingerprint}", file=sys.stderr)
    return NodeCertificate(answer=answer, node=nodes[0], path=path)


def ssh(arguments: argparse.Namespace, console: Console) -> int:
    """Sign a certificate for one node and log in to it with ssh, in this process's place."""
    key = key_read(arguments.identity)
    cluster = console.cluster_named(arguments.cluster)
    signed = node_certificate(console, cluster, key, arguments.node if arguments.node is not None else "node-0")
    argv = ssh_argv(signed.node, jump=signed.answer.get("jump") or "", key=key, certificate=signed.path,
                    command=arguments.command)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        _exec(argv[0], argv)
    except FileNotFoundError:
        raise ClientError("OpenSSH's ssh is not on PATH: install it (openssh-client), then try again.") from None
    return 0  # only when _exec returns (a test's stand-in)

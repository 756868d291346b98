"""``faden ssh``, ``faden clusters tunnel`` and ``faden clusters test``: the console's client, for any
computer that has the console's URL and an API token.

It speaks to the console through the REST API only (``FADEN_URL`` and ``FADEN_TOKEN``, or ``--url`` and
``--token``), never through the database or the settings, and imports nothing of the server's and no
Django: ``config/cli.py`` hands it these commands before Django is set up, so it runs where the
console's data directory does not exist.

    faden ssh [-i KEY] CLUSTER [NODE] [-- COMMAND...]

finds the cluster by name, reads the public key beside ``KEY`` (``~/.ssh/id_ed25519`` by default),
asks ``POST /api/clusters/<id>/ssh-certificates/`` for a certificate for that one node (node-0, the
head, when none is named), writes it into a directory private to the user, and runs OpenSSH's ``ssh``
in this process's place with ``-i KEY -o CertificateFile=...`` and the node's address, as an argv (no
shell line is built). The certificate is printed nowhere; its key id is.

    faden clusters tunnel [-i KEY] [--local-port 8265] [--client-port 10001] CLUSTER

signs the same certificate for node-0 (the head) and runs ``ssh -N -L 127.0.0.1:8265:127.0.0.1:8265
-L 127.0.0.1:10001:127.0.0.1:10001`` as a child until Ctrl-C: Ray's dashboard and job API and Ray
Client, which listen on the head's loopback only. The certificate file is removed when it ends.

    faden clusters test [--yes] CLUSTER

starts the NCCL test (``POST /api/clusters/<id>/tests/``), asks once to confirm when the console says
copies are serving, then asks for the test every second and prints each message size as it finishes,
then the peak and the console's sentence; exit status 1 when the test failed.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

COMMANDS = frozenset({"ssh", "clusters"})  # the faden commands this module answers (config/cli.py asks)
ENV_URL, ENV_TOKEN = "FADEN_URL", "FADEN_TOKEN"
DEFAULT_KEY = "~/.ssh/id_ed25519"
TIMEOUT_SECONDS = 30
# What the console may answer for ssh's argv: each must stay one word ssh does not read as an option.
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[?[0-9A-Fa-f:.]+\]?)$")
_JUMP = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")

# (method, url, headers, body) -> (status, body): urllib's by default; tests answer with the Django test client.
Send = Callable[[str, str, dict, bytes | None], tuple[int, bytes]]


class ClientError(Exception):
    """What went wrong, in one sentence for the terminal; ``code`` is the exit status. When the console
    refused: ``status`` its HTTP status, ``said`` its sentence, ``answer`` its whole JSON answer."""

    def __init__(self, message: str, code: int = 1, *, status: int = 0, said: str = "", answer: dict | None = None):
        super().__init__(message)
        self.message, self.code, self.status, self.said, self.answer = message, code, status, said, answer or {}


def urllib_send(method: str, url: str, headers: dict, body: bytes | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:  # noqa: S310 (the URL is checked: http or https)
            return response.status, response.read()
    except urllib.error.HTTPError as answered:
        return answered.code, answered.read()
    except (urllib.error.URLError, OSError) as failed:
        reason = getattr(failed, "reason", failed)
        raise ClientError(f"Could not reach the console at {url.split('/api/')[0]}: {reason}.") from None


class Console:
    """The console's REST API, as one person's token sees it."""

    def __init__(self, url: str, token: str, *, send: Send = urllib_send):
        url = (url or "").strip().rstrip("/")
        if not url:
            raise ClientError(f"Give the console's URL: {ENV_URL}=https://console.example.com, or --url.", code=2)
        if urllib.parse.urlsplit(url).scheme not in ("http", "https") or not urllib.parse.urlsplit(url).netloc:
            raise ClientError(f"{url} is not the console's URL: it starts with http:// or https://.", code=2)
        if not token:
            raise ClientError(f"Give an API token: {ENV_TOKEN}=... (an Administrator makes one with faden drf_create_token "
                              f"USER), or --token.", code=2)
        self.url, self._token, self._send = url, token.strip(), send

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        """The answer's JSON; a refusal raises ClientError with the console's own sentence."""
        headers = {"Authorization": f"Token {self._token}", "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body).encode()
        status, raw = self._send(method, f"{self.url}{path}", headers, data)
        try:
            answer = json.loads(raw or b"null")
        except ValueError:
            answer = None
        if status >= 400:
            said = refusal_sentence(answer)
            if said:
                raise ClientError(f"The console refused: {said}" if status != 401 else f"The console refused the token: {said}",
                                  status=status, said=said, answer=answer)
            raise ClientError(f"The console at {self.url} answered {status}: is {ENV_URL} the console's address?",
                              status=status)
        if not isinstance(answer, dict):
            raise ClientError(f"The console at {self.url} answered with something that is not its API's JSON: "
                              f"is {ENV_URL} the console's address?")
        return answer

    def cluster_named(self, name: str) -> dict:
        found = self.request("GET", f"/api/clusters/?{urllib.parse.urlencode({'name': name})}").get("results") or []
        cluster = next((c for c in found if isinstance(c, dict) and c.get("name") == name), None)
        if cluster is None:
            raise ClientError(f"There is no cluster named {name} on {self.url}.")
        return cluster

    def ssh_certificate(self, cluster_id: int, *, public_key: str, node: str | None) -> dict:
        body = {"public_key": public_key} | ({"node": node} if node is not None else {})
        return self.request("POST", f"/api/clusters/{int(cluster_id)}/ssh-certificates/", body)

    def nccl_test_start(self, cluster_id: int, *, confirm: bool) -> dict:
        return self.request("POST", f"/api/clusters/{int(cluster_id)}/tests/", {"confirm": bool(confirm)})

    def nccl_test(self, cluster_id: int, test_id: int) -> dict:
        return self.request("GET", f"/api/clusters/{int(cluster_id)}/tests/{int(test_id)}/")


def refusal_sentence(answer) -> str:
    """The console's own sentence in a refusal: ``message`` (the console's refusals), ``detail`` (DRF's
    and the NCCL test's), else the first message of a field (DRF's validation errors)."""
    if not isinstance(answer, dict):
        return ""
    for name in ("message", "detail"):
        if isinstance(answer.get(name), str) and answer[name]:
            return answer[name]
    for value in answer.values():
        first = value[0] if isinstance(value, list) and value else value
        if isinstance(first, str) and first:
            return first
    return ""


# -- the user's key and the certificate beside it ---------------------------------------------------


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


# -- the commands -----------------------------------------------------------------------------------

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


# -- faden clusters tunnel ----------------------------------------------------------------------------

RAY_DASHBOARD_PORT = 8265  # Ray's dashboard and job API, on the head's loopback only (agent rayargs.DASHBOARD_PORT)
RAY_CLIENT_PORT = 10001  # Ray Client (ray://), Ray's default; it listens on the head's loopback and cluster address
STOP_GRACE_SECONDS = 5.0  # after Ctrl-C: how long ssh gets to end before it is killed
_spawn = subprocess.Popen  # replaced in tests


def tunnel_argv(node: dict, *, jump: str, key: Key, certificate: Path, local_port: int, client_port: int) -> list[str]:
    """``ssh -N`` forwarding Ray's dashboard and job API, and Ray Client, from this computer's loopback
    to the head's. Both ends are 127.0.0.1 written out: a GatewayPorts in the user's ssh config would
    otherwise open the forwards to their whole network. ExitOnForwardFailure: a local port in use ends
    ssh with its reason instead of a tunnel that forwards nothing."""
    forwards = ["-L", f"127.0.0.1:{int(local_port)}:127.0.0.1:{RAY_DASHBOARD_PORT}",
                "-L", f"127.0.0.1:{int(client_port)}:127.0.0.1:{RAY_CLIENT_PORT}"]
    return ssh_argv(node, jump=jump, key=key, certificate=certificate,
                    options=["-N", "-o", "ExitOnForwardFailure=yes", *forwards])


def tunnel_instructions(cluster: str, node: dict, *, local_port: int, client_port: int) -> str:
    """What to open and what to run on this computer while the tunnel is up."""
    dashboard = f"http://127.0.0.1:{int(local_port)}"
    return (f"Tunnel to {cluster}'s head, {node.get('name')} ({node.get('machine')}): Ctrl-C closes it.\n"
            f"  Ray's dashboard:  {dashboard}\n"
            f"  Submit a job:     ray job submit --address {dashboard} --working-dir . -- python train.py\n"
            f"  Ray Client:       ray.init(\"ray://127.0.0.1:{int(client_port)}\")")


def tunnel(arguments: argparse.Namespace, console: Console) -> int:
    """Sign a certificate for the head and hold ``ssh -N -L ...`` open until Ctrl-C. The certificate is
    saved 0600 in the private directory for ssh to read, and removed however this ends."""
    key = key_read(arguments.identity)
    cluster = console.cluster_named(arguments.cluster)
    signed = node_certificate(console, cluster, key, "node-0")
    try:
        argv = tunnel_argv(signed.node, jump=signed.answer.get("jump") or "", key=key, certificate=signed.path,
                           local_port=arguments.local_port, client_port=arguments.client_port)
        print(tunnel_instructions(cluster["name"], signed.node, local_port=arguments.local_port,
                                  client_port=arguments.client_port), flush=True)
        status = ssh_until_interrupted(argv)
    finally:
        signed.path.unlink(missing_ok=True)
    if status in (None, 0):
        print("Tunnel closed.", file=sys.stderr)
        return 0
    raise ClientError(f"The tunnel closed: ssh exited with status {status} (its own words are above).")


def ssh_until_interrupted(argv: list[str]) -> int | None:
    """Run ssh as a child until it ends (its exit status) or Ctrl-C or SIGTERM ends this (None). A
    child rather than an exec, so that this process is still there to remove the certificate."""
    try:
        child = _spawn(argv)
    except FileNotFoundError:
        raise ClientError("OpenSSH's ssh is not on PATH: install it (openssh-client), then try again.") from None
    with _terminate_as_interrupt():
        try:
            return child.wait()
        except KeyboardInterrupt:
            pass
    # Ctrl-C reached ssh too (the terminal signals the whole group); SIGTERM reached only this process.
    child.terminate()
    try:
        child.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    return None


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (and SIGHUP: the terminal closed) end a wait as Ctrl-C does, so the cleanup runs; SIGINT
    too when it came ignored (a background job of a script, which `kill -INT` should still end)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = {number: signal.signal(number, interrupt) for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def tcp_port(text: str) -> int:
    """argparse's type for a port on this computer."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1-65535)")
    return int(text)


# -- faden clusters test ------------------------------------------------------------------------------

POLL_SECONDS = 1.0
_sleep = time.sleep  # replaced in tests
_ask = input  # replaced in tests
TABLE_HEADER = ("#       size        time   algbw   busbw\n"
                "#        (B)        (us)  (GB/s)  (GB/s)")


def size_line(row: dict) -> str:
    """One size of the sweep, aligned as all_reduce_perf prints its columns."""
    return (f"{int(row['size_bytes']):12d} {float(row['time_us']):11.1f} {float(row['algbw']):7.2f} "
            f"{float(row['busbw']):7.2f}")


def peak_line(peak: dict | None) -> str:
    if not peak:
        return ""
    return f"Peak bus bandwidth: {float(peak['busbw']):.2f} GB/s at {int(peak['size_bytes'])} bytes."


def nccl_test_start(console: Console, cluster: dict, *, yes: bool) -> dict:
    """Start the test; when the console asks to confirm (409 with ``confirm: true``: copies are
    serving), ask the person once, or take --yes as the answer."""
    try:
        return console.nccl_test_start(cluster["id"], confirm=yes)
    except ClientError as refused:
        if yes or refused.status != 409 or refused.answer.get("confirm") is not True:
            raise
        print(refused.said.replace(" Send confirm: true to run it anyway.", ""), file=sys.stderr)
        if not sys.stdin.isatty():
            raise ClientError("Not started: run it again with --yes to run it anyway.") from None
        if _ask("Run it anyway? [y/N] ").strip().lower() not in ("y", "yes"):
            raise ClientError("Not started.") from None
        return console.nccl_test_start(cluster["id"], confirm=True)


def nccl_test_follow(console: Console, cluster: dict, test: dict) -> dict:
    """Print each size as the console records it, asking once a second, until the test ends; the
    test as it ended."""
    printed = 0
    while True:
        rows = test.get("rows") or []
        for row in rows[printed:]:
            print(size_line(row), flush=True)
        printed = max(printed, len(rows))
        if test.get("state") != "running":
            return test
        _sleep(POLL_SECONDS)
        test = console.nccl_test(cluster["id"], test["id"])


def nccl_test(arguments: argparse.Namespace, console: Console) -> int:
    """``faden clusters test NAME``: start the NCCL test, print the sweep, then the peak and the
    console's sentence; 1 when the test failed."""
    cluster = console.cluster_named(arguments.cluster)
    test = nccl_test_start(console, cluster, yes=arguments.yes)
    print(f"NCCL test {test['id']} on {cluster['name']}: {test.get('nodes')} nodes, {test.get('gpus')} GPUs, "
          f"{test.get('minbytes')} to {test.get('maxbytes')} bytes.", flush=True)
    print(TABLE_HEADER, flush=True)
    try:
        ended = nccl_test_follow(console, cluster, test)
    except KeyboardInterrupt:
        print("\nStopped following: the test goes on, and the cluster's page shows it.", file=sys.stderr)
        return 130
    if line := peak_line(ended.get("peak")):
        print(line)
    print(f"{ended.get('state', '').capitalize()}: {ended.get('message') or 'no message'}")
    return 1 if ended.get("state") == "failed" else 0


def parser() -> argparse.ArgumentParser:
    """Every client command, each with ``--url`` and ``--token`` (a subcommand per command: ``clusters
    tunnel`` is one more ``add_parser`` with its own ``run``)."""
    reach = argparse.ArgumentParser(add_help=False)
    reach.add_argument("--url", default=None, help=f"the console's URL (default ${ENV_URL})")
    reach.add_argument("--token", default=None, help=f"an API token (default ${ENV_TOKEN}, which keeps it out of ps)")
    top = argparse.ArgumentParser(prog="faden", description="The console's client commands, over its REST API.")
    commands = top.add_subparsers(dest="command_name", required=True)
    login = commands.add_parser("ssh", parents=[reach], help="log in to a node of a cluster as root with a short-lived certificate",
                                usage="faden ssh [-i KEY] [--url URL] [--token TOKEN] CLUSTER [NODE] [-- COMMAND...]",
                                description="Sign a certificate for your key and log in to the node with ssh; a command "
                                            "after -- runs there instead of a shell.")
    login.add_argument("cluster", help="the cluster's name")
    login.add_argument("node", nargs="?", help="node-1, its rank (1) or its machine's name; node-0 (the head) by default")
    login.add_argument("-i", dest="identity", default=None, metavar="KEY",
                       help=f"your private key or its .pub ({DEFAULT_KEY} by default)")
    login.set_defaults(run=ssh)
    clusters = commands.add_parser("clusters", help="a cluster's tunnel and NCCL test").add_subparsers(
        dest="clusters_command", required=True)
    forward = clusters.add_parser("tunnel", parents=[reach], help="forward Ray's dashboard, job API and Ray Client from the head",
                                  description="Sign a certificate for your key and hold ssh -N -L to the head's Ray "
                                              "dashboard and job API (8265) and Ray Client (10001) open until Ctrl-C.")
    forward.add_argument("cluster", help="the cluster's name")
    forward.add_argument("-i", "--key", dest="identity", default=None, metavar="KEY",
                         help=f"your private key or its .pub ({DEFAULT_KEY} by default)")
    forward.add_argument("--local-port", type=tcp_port, default=RAY_DASHBOARD_PORT,
                         help=f"this computer's port for the dashboard and job API ({RAY_DASHBOARD_PORT})")
    forward.add_argument("--client-port", type=tcp_port, default=RAY_CLIENT_PORT,
                         help=f"this computer's port for Ray Client ({RAY_CLIENT_PORT})")
    forward.set_defaults(run=tunnel)
    sweep = clusters.add_parser("test", parents=[reach], help="run the NCCL test and print each size as it finishes",
                                description="An all-reduce across every GPU of every node; prints the bus bandwidth "
                                            "of each message size, then the peak.")
    sweep.add_argument("cluster", help="the cluster's name")
    sweep.add_argument("--yes", action="store_true", help="run it even while copies are serving on the cluster's GPUs")
    sweep.set_defaults(run=nccl_test)
    return top


def main(argv: list[str], *, send: Send = urllib_send, environ=os.environ) -> int:
    """``faden <command> ...`` for the commands of ``COMMANDS``; the exit status."""
    # What follows -- is the command to run on the node, whatever it looks like (as ssh takes it).
    argv, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    arguments = parser().parse_args(argv)
    arguments.command = command
    try:
        console = Console(arguments.url or environ.get(ENV_URL, ""), arguments.token or environ.get(ENV_TOKEN, ""), send=send)
        return arguments.run(arguments, console)
    except ClientError as failed:
        name = " ".join(filter(None, (arguments.command_name, getattr(arguments, "clusters_command", None))))
        print(f"faden {name}: {failed.message}", file=sys.stderr)
        return failed.code

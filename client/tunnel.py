"""``faden clusters tunnel``: ``ssh -N -L`` to Ray's dashboard, job API and Ray Client on the head, held
open until Ctrl-C, with a certificate that is removed however it ends."""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

from client.api import ClientError, Console
from client.ssh import Key, key_read, node_certificate, ssh_argv

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
    # The cluster's Ray offers no GPUs (copies hold theirs outside it): a job is told the head's free ones, as
    # the Connect card's command does.
    free = ",".join(str(int(index)) for index in node.get("free_gpus") or [])
    runtime_env = shlex.quote(json.dumps({"env_vars": {"CUDA_VISIBLE_DEVICES": free}})) if "free_gpus" in node else ""
    return (f"Tunnel to {cluster}'s head, {node.get('name')} ({node.get('machine')}): Ctrl-C closes it.\n"
            f"  Ray's dashboard:  {dashboard}\n"
            f"  Submit a job:     ray job submit --address {dashboard} --working-dir ."
            f"{' --runtime-env-json ' + runtime_env if runtime_env else ''} -- python3 train.py\n"
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

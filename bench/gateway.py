#!/usr/bin/env python
"""The gateway against the engine directly: the same requests both ways, in one run.

    .venv/bin/python bench/gateway.py                                  # the builtin engine (tests/upstreams.py)
    .venv/bin/python bench/gateway.py --engine lab                     # the lab's vllm stand-in (lab/stubs/vllm)
    .venv/bin/python bench/gateway.py --engine-url http://127.0.0.1:8100 --model llama   # an engine already running
    .venv/bin/python bench/gateway.py --tokens 64 --pause 0.005 --json out.json
    .venv/bin/python bench/gateway.py --tls                            # mutual TLS to the copy against plain
    .venv/bin/python bench/gateway.py --workload shared-prefix         # cache-aware routing against least busy
    .venv/bin/python bench/gateway.py --limits                         # a key with limits against one without
    .venv/bin/python bench/gateway.py --peers                          # beside vLLM's router and LiteLLM's proxy (bench/peers.py)

It makes a console of its own (SQLite in a temporary directory, Redis at REDIS_URL under a prefix of
its own), records one deployment whose one serving copy is the engine, and a key; starts the gateway as
``faden serve`` does (uvicorn, uvloop, httptools, one worker); then sends chat completions, answered
whole and streamed, one at a time and 16 at a time, to the engine and through the gateway, from a
small keep-alive HTTP/1.1 client of its own in this process (an HTTP library would cost the machine
more than the gateway). It reports:

- added latency at 1 concurrent: the gateway's p50 and p99 minus the engine's (goal: at most 3 ms and 15 ms);
- time to the first chunk of a stream, through the gateway against direct;
- requests per second at 16 concurrent through the gateway against direct (goal: at least 70 %), with
  the CPU the engine, the gateway and this client each used: they share this machine's cores.

``--tls`` measures what mutual TLS between the gateway and a copy adds instead: two builtin engines, one plain
and one serving HTTPS with a certificate of the console's authority and requiring a client certificate (as a
copy behind TLS does), each the one copy of a deployment of its own on the same gateway; whole answers through
the gateway to each, on kept-alive connections, one at a time and 16 at a time. It reports the added latency
p50 and p99 (goal: at most 0.3 ms at p50) and the requests per second at 16 concurrent against plain.

``--limits`` measures what a key's limits cost a request (bench/gateway_limits.py): the check's CPU in this
process, then a key with limits against one without through the gateway.

The engine answers ``--tokens`` words (16), ``--pause`` seconds apart when streamed (0: as fast as it
can, the gateway's share at its largest). ``--engine lab`` runs ``lab/stubs/vllm`` on a tiny model it
writes (its pace ``--pace`` tokens per second per request; ``--lab-stub`` names the file when it is
elsewhere). Every loop is bounded by --requests and --seconds; everything started is stopped at the end.

``--workload shared-prefix`` measures cache-aware routing against least busy instead (bench/shared_prefix.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import gateway_limits, shared_prefix, teardown  # noqa: E402 (--limits, --workload shared-prefix: beside this file)

PYTHON = sys.executable
MODEL = "bench"
GOALS = {"added_p50_ms": 3.0, "added_p99_ms": 15.0, "rps_ratio": 0.70}
TLS_MODEL = "bench-tls"
TLS_GOAL_P50_MS = 0.3
TLS_ROUNDS = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, *, timeout: float = 30.0, process: subprocess.Popen | None = None) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            sys.exit(f"{' '.join(process.args[:4])} stopped with exit status {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    sys.exit(f"Nothing answered at {url} within {timeout:.0f} s")


# -- the engine -----------------------------------------------------------------------------------------------


def tiny_model(directory: Path) -> Path:
    """A model the lab's engine accepts: config.json and one small safetensors file."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 4096,
        "hidden_size": 16, "vocab_size": 32, "torch_dtype": "float16"}))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F16", "shape": [32, 16], "data_offsets": [0, 1024]}}).encode()
    header += b" " * (-len(header) % 8)
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(1024))
    return directory


def engine_start(args, work: Path) -> tuple[str, subprocess.Popen | None, str]:
    """The engine's URL, its process (None when it was already running) and what it is, in words."""
    if args.engine_url:
        return args.engine_url.rstrip("/"), None, f"an engine already running at {args.engine_url}"
    port = free_port()
    if args.engine == "lab":
        stub = Path(args.lab_stub or ROOT / "lab" / "stubs" / "vllm")
        if not stub.exists():
            sys.exit(f"{stub} does not exist (yet): run with --engine builtin, --engine-url, or --lab-stub PATH")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "FADEN_LAB_ENGINE_PACE": str(args.pace)}
        argv = ["python3", str(stub), "serve", str(tiny_model(work / "model")), "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", MODEL, "--max-model-len", "4096", "--disable-log-requests"]
        what = f"the lab's engine ({stub.relative_to(ROOT) if stub.is_relative_to(ROOT) else stub}, {args.pace:g} tokens/s per request)"
    else:
        env = dict(os.environ)
        argv = [PYTHON, "-m", "tests.upstreams", "--port", str(port), "--name", "engine", "--tokens", str(args.tokens),
                "--pause", str(args.pause)]
        what = (f"the builtin engine (tests/upstreams.py: the standard library's threaded server, {args.tokens} tokens"
                f"{f', {args.pause * 1000:g} ms apart when streamed' if args.pause else ', streamed as fast as it can'})")
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(work / "engine.log", "w"),
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", process=process)
    return url, process, what


# -- a console of its own, and the gateway -----------------------------------------------------------------------


def console_setup(work: Path, engine_url: str, redis_url: str, prefix: str) -> tuple[str, dict]:
    """The database with one deployment whose one serving copy is the engine; the key's secret and the env."""
    env = {**os.environ, "FADEN_DATA_DIR": str(work / "data"), "DATABASE_URL": f"sqlite:///{work / 'data' / 'bench.sqlite3'}",
           "REDIS_URL": redis_url, "FADEN_GATEWAY_REDIS_PREFIX": prefix, "DJANGO_SETTINGS_MODULE": "config.settings",
           "FADEN_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})
    import django

    django.setup()
    from django.core.management import call_command
    from django.utils import timezone

    call_command("migrate", verbosity=0)
    from deployments.gateway_keys import gateway_key_create
    from deployments.models import Copy
    from tests.builders import cluster_of, deployment_of, gpu_machine

    host, port = engine_url.removeprefix("http://").rsplit(":", 1)
    deployment = deployment_of(cluster_of([gpu_machine("bench-a", 11)]), name=MODEL)
    Copy.objects.create(deployment=deployment, number=1, state="serving", address=host, port=int(port),
                        serving_since=timezone.now())
    _, secret = gateway_key_create(name="bench")
    return secret, env


def tls_engine_start(args, work: Path) -> tuple[int, subprocess.Popen]:
    """The second builtin engine, behind mutual TLS: its key made here, its certificate signed by the bench's
    console authority (console/pki.py) for 127.0.0.1, client certificates of that authority required; recorded
    as the one copy (``tls``) of a deployment of its own."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    from django.utils import timezone

    import ipaddress

    from console import pki
    from deployments.models import Copy
    from tests.builders import cluster_of, deployment_of, gpu_machine, ready_model

    directory = work / "copy-tls"
    directory.mkdir(mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
           .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
           .sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode())
    (directory / "copy.pem").write_text(pki.sign_request(csr, address="127.0.0.1", role="copy").pem)
    (directory / "copy.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    (directory / "ca.pem").write_text(pki.ca_pem())
    port = free_port()
    argv = [PYTHON, "-m", "tests.upstreams", "--port", str(port), "--name", "engine-tls", "--tokens", str(args.tokens),
            "--pause", str(args.pause), "--tls-dir", str(directory)]
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=open(work / "engine-tls.log", "w"),
                               start_new_session=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"The engine behind TLS did not listen on port {port}: see {work / 'engine-tls.log'}")
            time.sleep(0.1)
    deployment = deployment_of(cluster_of([gpu_machine("bench-b", 12)], name="bench-tls"), ready_model("org/bench-tls"),
                               name=TLS_MODEL)
    Copy.objects.create(deployment=deployment, number=1, state="serving", address="127.0.0.1", port=port, tls=True,
                        serving_since=timezone.now())
    return port, process


def merged(total: dict | None, one: dict) -> dict:
    """Rounds of one path put together: requests, seconds, latencies, and CPU as cores used over all of it."""
    if total is None:
        return dict(one, cpu_seconds={name: cores * one["seconds"] for name, cores in one["cpu"].items()})
    seconds = total["seconds"] + one["seconds"]
    cpu_seconds = {name: total["cpu_seconds"][name] + one["cpu"][name] * one["seconds"] for name in one["cpu"]}
    requests = total["requests"] + one["requests"]
    return {"requests": requests, "failed": total["failed"] + one["failed"], "seconds": seconds, "rps": requests / seconds,
            "latency": sorted(total["latency"] + one["latency"]), "first": sorted(total["first"] + one["first"]),
            "cpu_seconds": cpu_seconds, "cpu": {name: value / seconds for name, value in cpu_seconds.items()}}


def tls_report(results: dict) -> dict:
    """Mutual TLS to the copy against plain, both through the gateway."""
    one, many = results[1], results[16]
    added_p50 = quantile(one["tls"]["latency"], .5) - quantile(one["plain"]["latency"], .5)
    added_p99 = quantile(one["tls"]["latency"], .99) - quantile(one["plain"]["latency"], .99)
    ratio = many["tls"]["rps"] / many["plain"]["rps"]
    lines = [f"Machine: {platform.machine()}, {psutil.cpu_count()} CPUs, Python {platform.python_version()}", "",
             f"{'conc':>5}  {'copy':<7}{'requests':>9}{'req/s':>9}{'p50':>11}{'p99':>11}   CPU (cores): engine / gateway / client"
             "   CPU per request (us): engine / gateway"]
    for concurrency, pair in results.items():
        for path in ("plain", "tls"):
            r = pair[path]
            cpu = " / ".join(f"{r['cpu'].get(name, float('nan')):.2f}" for name in ("engine", "gateway", "client"))
            per = " / ".join(f"{r['cpu'].get(name, float('nan')) / r['rps'] * 1e6:.0f}" for name in ("engine", "gateway"))
            lines.append(f"{concurrency:>5}  {path:<7}{r['requests']:>9}{r['rps']:>9.0f}{ms(quantile(r['latency'], .5)):>11}"
                         f"{ms(quantile(r['latency'], .99)):>11}   {cpu:<36}{per}{f'  ({r['failed']} failed)' if r['failed'] else ''}")
    verdict = "meets the goal" if added_p50 * 1000 <= TLS_GOAL_P50_MS else "MISSES the goal"
    lines += ["", f"Added by mutual TLS to the copy, kept-alive connections, 1 concurrent: p50 {added_p50 * 1000:.3f} ms "
                  f"(goal <= {TLS_GOAL_P50_MS} ms: {verdict}), p99 {added_p99 * 1000:.3f} ms",
              f"Requests per second at 16 concurrent: {many['tls']['rps']:.0f} behind TLS, {many['plain']['rps']:.0f} plain: "
              f"{ratio:.0%}"]
    print("\n".join(lines))
    gateway_us = {path: many[path]["cpu"]["gateway"] / many[path]["rps"] * 1e6 for path in ("plain", "tls")}
    print(f"The gateway's CPU per request at 16 concurrent: {gateway_us['tls']:.0f} us behind TLS, {gateway_us['plain']:.0f} us plain")
    return {"tls_added_p50_ms": added_p50 * 1000, "tls_added_p99_ms": added_p99 * 1000, "tls_rps_ratio": ratio,
            "gateway_cpu_us_tls": gateway_us["tls"], "gateway_cpu_us_plain": gateway_us["plain"],
            "tls_rps": many["tls"]["rps"], "plain_rps": many["plain"]["rps"]}


def gateway_start(work: Path, env: dict) -> tuple[str, subprocess.Popen]:
    from console.management.commands.serve import gateway_argv

    port = free_port()
    process = subprocess.Popen(gateway_argv(PYTHON, bind="127.0.0.1", port=port, workers=1), cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=open(work / "gateway.log", "w"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", process=process)
    return url, process


def gateway_worker(process: subprocess.Popen) -> psutil.Process:
    """The process that serves: uvicorn's own with one worker (more would run in child processes)."""
    return psutil.Process(process.pid)


# -- the client -------------------------------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection, just enough of the protocol for these answers."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        self.writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def post(self, request: bytes) -> tuple[int, float, float]:
        """Send ``request`` (the whole of it), read the answer: its status, seconds to the first body
        chunk, seconds to its end."""
        started = time.perf_counter()
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lowered = head.lower()
        first = None
        if b"transfer-encoding: chunked" in lowered:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                if first is None:
                    first = time.perf_counter()
        else:
            length = int(lowered.split(b"content-length:")[1].split(b"\r\n")[0])
            await self.reader.readexactly(length)
            first = time.perf_counter()
        if b"connection: close" in lowered:
            self.writer.close()
            await self.open()
        ended = time.perf_counter()
        return status, (first or ended) - started, ended - started

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def request_bytes(url: str, secret: str | None, *, stream: bool, model: str | None = None) -> bytes:
    body = json.dumps({"model": model or MODEL, "stream": stream, "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Say something about gateways."}]}).encode()
    host = url.removeprefix("http://")
    auth = f"Authorization: Bearer {secret}\r\n".encode() if secret else b""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
            + auth + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def run(url: str, request: bytes, *, concurrency: int, requests: int, seconds: float) -> dict:
    """``concurrency`` connections sending ``request`` back to back until ``requests`` answered or ``seconds`` passed."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connections = [Connection(host, int(port)) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in connections))
    for connection in connections:  # warm: a first request on each connection, not counted
        await connection.post(request)
    results: list[tuple[int, float, float]] = []
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()

    async def worker(connection: Connection) -> None:
        while len(results) < requests and time.perf_counter() < deadline:
            results.append(await connection.post(request))

    await asyncio.gather(*(worker(c) for c in connections))
    elapsed = time.perf_counter() - started
    for connection in connections:
        connection.close()
    failed = sum(1 for status, _, _ in results if status != 200)
    return {"requests": len(results), "failed": failed, "seconds": elapsed, "rps": len(results) / elapsed,
            "latency": sorted(total for _, _, total in results), "first": sorted(first for _, first, _ in results)}


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    found = {}
    for name, process in processes.items():
        try:
            times = process.cpu_times()
            found[name] = times.user + times.system
        except psutil.Error:
            found[name] = float("nan")
    return found


def measure(url: str, request: bytes, processes: dict, *, concurrency: int, requests: int, seconds: float) -> dict:
    before = cpu_seconds(processes)
    result = asyncio.run(run(url, request, concurrency=concurrency, requests=requests, seconds=seconds))
    after = cpu_seconds(processes)
    result["cpu"] = {name: (after[name] - before[name]) / result["seconds"] for name in processes}  # cores used
    return result


# -- the report --------------------------------------------------------------------------------------------


def ms(value: float) -> str:
    return f"{value * 1000:.2f} ms"


def report(results: dict, args, what: str) -> dict:
    lines, summary = [], {}
    one = results[("whole", 1)]
    added_p50 = quantile(one["gateway"]["latency"], .5) - quantile(one["direct"]["latency"], .5)
    added_p99 = quantile(one["gateway"]["latency"], .99) - quantile(one["direct"]["latency"], .99)
    summary.update(added_p50_ms=added_p50 * 1000, added_p99_ms=added_p99 * 1000)
    streamed = results[("stream", 1)]
    summary.update(first_chunk_direct_p50_ms=quantile(streamed["direct"]["first"], .5) * 1000,
                   first_chunk_gateway_p50_ms=quantile(streamed["gateway"]["first"], .5) * 1000,
                   first_chunk_direct_p99_ms=quantile(streamed["direct"]["first"], .99) * 1000,
                   first_chunk_gateway_p99_ms=quantile(streamed["gateway"]["first"], .99) * 1000)
    many = results[("whole", 16)]
    summary["rps_ratio"] = many["gateway"]["rps"] / many["direct"]["rps"]
    summary["rps_ratio_streamed"] = results[("stream", 16)]["gateway"]["rps"] / results[("stream", 16)]["direct"]["rps"]

    lines.append(f"Engine: {what}")
    lines.append(f"Machine: {platform.machine()}, {psutil.cpu_count()} CPUs, Python {platform.python_version()}")
    lines.append("")
    lines.append(f"{'answers':<9}{'conc':>5}  {'path':<8}{'requests':>9}{'req/s':>9}{'p50':>11}{'p99':>11}"
                 f"{'1st chunk p50':>15}{'p99':>11}   CPU (cores): engine / gateway / client")
    for (kind, concurrency), pair in results.items():
        for path in ("direct", "gateway"):
            r = pair[path]
            cpu = " / ".join(f"{r['cpu'][name]:.2f}" if name in r["cpu"] else "-" for name in ("engine", "gateway", "client"))
            lines.append(f"{kind:<9}{concurrency:>5}  {path:<8}{r['requests']:>9}{r['rps']:>9.0f}{ms(quantile(r['latency'], .5)):>11}"
                         f"{ms(quantile(r['latency'], .99)):>11}{ms(quantile(r['first'], .5)):>15}{ms(quantile(r['first'], .99)):>11}"
                         f"   {cpu}{f'  ({r['failed']} failed)' if r['failed'] else ''}")
    lines.append("")

    def verdict(ok: bool) -> str:
        return "meets the goal" if ok else "MISSES the goal"

    lines.append(f"Added latency at 1 concurrent, whole answers: p50 {added_p50 * 1000:.2f} ms (goal <= 3 ms: "
                 f"{verdict(added_p50 * 1000 <= GOALS['added_p50_ms'])}), p99 {added_p99 * 1000:.2f} ms "
                 f"(goal <= 15 ms: {verdict(added_p99 * 1000 <= GOALS['added_p99_ms'])})")
    lines.append(f"Time to the first chunk at 1 concurrent, streamed: p50 {summary['first_chunk_gateway_p50_ms']:.2f} ms through the "
                 f"gateway, {summary['first_chunk_direct_p50_ms']:.2f} ms direct (p99 {summary['first_chunk_gateway_p99_ms']:.2f} "
                 f"against {summary['first_chunk_direct_p99_ms']:.2f} ms)")
    lines.append(f"Requests per second at 16 concurrent, whole answers: {many['gateway']['rps']:.0f} through the gateway, "
                 f"{many['direct']['rps']:.0f} direct: {summary['rps_ratio']:.0%} (goal >= 70 %: "
                 f"{verdict(summary['rps_ratio'] >= GOALS['rps_ratio'])}); streamed: {summary['rps_ratio_streamed']:.0%}")
    gw = many["gateway"]["cpu"]
    lines.append(f"CPU at 16 concurrent through the gateway (cores of {psutil.cpu_count()}): engine {gw.get('engine', float('nan')):.2f}, "
                 f"gateway {gw['gateway']:.2f}, client {gw['client']:.2f}; the gateway's CPU per request: "
                 f"{gw['gateway'] / many['gateway']['rps'] * 1e6:.0f} us")
    print("\n".join(lines))
    return summary


def main() -> None:
    global MODEL
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=["builtin", "lab"], default="builtin")
    parser.add_argument("--engine-url", help="an OpenAI-compatible engine already running, serving --model")
    parser.add_argument("--model", default=MODEL, help="the name the engine serves (with --engine-url)")
    parser.add_argument("--lab-stub", help="lab/stubs/vllm elsewhere than in this tree")
    parser.add_argument("--tokens", type=int, default=16, help="words in an answer (builtin engine)")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between streamed tokens (builtin engine)")
    parser.add_argument("--pace", type=float, default=100000.0, help="tokens per second per request (lab engine)")
    parser.add_argument("--requests", type=int, default=20000, help="requests per run at most")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per run at most")
    parser.add_argument("--json", help="write the figures to this file too")
    parser.add_argument("--tls", action="store_true", help="mutual TLS to the copy against plain, through the gateway")
    parser.add_argument("--workload", choices=["overhead", "shared-prefix"], default="overhead",
                        help="the gateway's overhead against the engine (the default), or cache-aware routing against "
                             "least busy on conversations sharing long prefixes (bench/shared_prefix.py)")
    shared_prefix.add_arguments(parser)
    parser.add_argument("--limits", action="store_true", help="a key with limits against one without, through the gateway")
    parser.add_argument("--rounds", type=int, help="rounds per figure, alternating which path goes first (shared-prefix: "
                                                   "1, --peers: 3, --seconds split among them)")
    from bench import peers  # --peers: vLLM's router and LiteLLM's proxy beside the gateway (bench/peers.py)

    peers.add_arguments(parser)
    args = parser.parse_args()
    if args.tls and args.limits:
        parser.error("--tls and --limits each run a comparison of their own: give one")
    if args.tls and (args.engine != "builtin" or args.engine_url):
        parser.error("--tls runs the builtin engine twice (plain and behind TLS): leave out --engine and --engine-url")
    if args.tls and args.peers:
        parser.error("--tls and --peers are two runs: give one")
    MODEL = args.model

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    if args.workload == "shared-prefix":
        shared_prefix.run(args, sys.modules[__name__])
        return
    work = Path(tempfile.mkdtemp(prefix="fadenstack-bench-gateway-"))
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/9")
    prefix = f"bench-gateway-{uuid.uuid4().hex[:8]}"
    started: list[subprocess.Popen] = []
    try:
        engine_url, engine, what = engine_start(args, work)
        if engine is not None:
            started.append(engine)
        secret, env = console_setup(work, engine_url, redis_url, prefix)
        if args.tls:
            _, engine_tls = tls_engine_start(args, work)
            started.append(engine_tls)
        limited_secret = gateway_limits.limits_key() if args.limits else None
        gateway_url, gateway = gateway_start(work, env)
        started.append(gateway)
        if args.peers:
            summary = peers.compare(args, work=work, env=env, engine_url=engine_url, engine=engine, what=what,
                                    gateway_url=gateway_url, gateway=gateway, secret=secret, started=started)
            if args.json:
                Path(args.json).write_text(json.dumps(summary, indent=2))
            return
        processes = {"gateway": gateway_worker(gateway), "client": psutil.Process()}
        if engine is not None:
            processes["engine"] = psutil.Process(engine.pid)
        if args.limits:
            summary = gateway_limits.limits_report(sys.modules[__name__], gateway_limits.limits_check_cost(),
                                                   gateway_limits.limits_through_gateway(
                                                       sys.modules[__name__], gateway_url, secret, limited_secret, processes, args))
            if args.json:
                Path(args.json).write_text(json.dumps({"summary": summary}, indent=2))
            return
        if args.tls:
            # Plain and TLS in alternating short rounds (the order swapped each round), so that what else runs on
            # the machine weighs on both alike; the rounds of each are put together.
            results = {}
            paths = (("plain", MODEL, engine.pid), ("tls", TLS_MODEL, engine_tls.pid))
            for concurrency in (1, 16):
                pair = {}
                for turn in range(TLS_ROUNDS):
                    for path, model, pid in (paths if turn % 2 == 0 else paths[::-1]):
                        processes["engine"] = psutil.Process(pid)
                        request = request_bytes(gateway_url, secret, stream=False, model=model)
                        one = measure(gateway_url, request, processes, concurrency=concurrency,
                                      requests=args.requests // TLS_ROUNDS, seconds=args.seconds / TLS_ROUNDS)
                        pair[path] = merged(pair.get(path), one)
                results[concurrency] = pair
            summary = tls_report(results)
            if args.json:
                Path(args.json).write_text(json.dumps({"summary": summary}, indent=2))
            return
        results = {}
        for kind in ("whole", "stream"):
            for concurrency in (1, 16):
                pair = {}
                for path, url, key in (("direct", engine_url, None), ("gateway", gateway_url, secret)):
                    request = request_bytes(url, key, stream=kind == "stream")
                    pair[path] = measure(url, request, processes, concurrency=concurrency, requests=args.requests,
                                         seconds=args.seconds)
                results[(kind, concurrency)] = pair
        summary = report(results, args, what)
        if args.json:
            Path(args.json).write_text(json.dumps({"engine": what, "summary": summary, "runs": {
                f"{kind}-{conc}-{path}": {k: v for k, v in r.items() if k not in ("latency", "first")} | {
                    "p50_ms": quantile(r["latency"], .5) * 1000, "p99_ms": quantile(r["latency"], .99) * 1000,
                    "first_p50_ms": quantile(r["first"], .5) * 1000}
                for (kind, conc), pair in results.items() for path, r in pair.items()}}, indent=2))
    finally:
        teardown.clean_up(started, redis_url=redis_url, prefix=prefix, work=work)


if __name__ == "__main__":
    main()

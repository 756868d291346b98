#!/usr/bin/env python
"""The lab's engine (lab/stubs/vllm) under load: short streamed chats, requests/s and time to first token.

    .venv/bin/python bench/engine.py                                   # pace 200 and 100000, 1 to 128 clients
    .venv/bin/python bench/engine.py --pace 200 --clients 64 --seconds 20

The engine runs on the lab hub's small model (generated on first use), with /usr/bin/python3 as in the
runtime image, pinned to CPU 0 (`taskset`); the clients are one asyncio process on CPU 1, each a
keep-alive connection sending the same short streamed chat (`max_tokens`, `ignore_eos`) again as soon
as its answer ends. For each pace and number of clients: completed requests/s, tokens/s, the time to
first token (from the request's first byte sent to the first `data:` chunk) at p50/p95/p99, and the
engine's CPU (its user + system time over the run's wall time: 100 % is the one core it has). At
pace 100000 tokens/s the decode takes no time, so the numbers are the engine's own cost per request.
"""
import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ENGINE = ROOT / "lab" / "stubs" / "vllm"
PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_engine(model_dir: str, port: int, pace: float, log: Path) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", FADEN_LAB_ENGINE_PACE=str(pace))
    with open(log, "wb") as out:
        proc = subprocess.Popen(["taskset", "-c", "0", PYTHON, str(ENGINE), "serve", model_dir, "--host", "127.0.0.1",
                                 "--port", str(port), "--served-model-name", "tiny", "--max-num-seqs", "1024"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 30
    while b"Application startup complete." not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the engine did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def client(port: int, request: bytes, until: float, ttfts: list, done: list) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < until:
            sent = time.monotonic()
            writer.write(request)
            first, buffer = None, b""
            while not buffer.endswith(b"0\r\n\r\n"):
                chunk = await reader.read(65536)
                if not chunk:
                    raise ConnectionError("the engine closed the connection")
                if first is None and b"data: " in buffer + chunk:
                    first = time.monotonic() - sent
                buffer = (buffer + chunk)[-64:] if first is not None else buffer + chunk
            ttfts.append(first)
            done.append(time.monotonic())
    finally:
        writer.close()


async def load(port: int, clients: int, seconds: float, max_tokens: int) -> tuple:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Say something short."}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    ttfts, done = [], []
    until = time.monotonic() + seconds
    await asyncio.gather(*(client(port, request, until, ttfts, done) for _ in range(clients)))
    return ttfts, done


def run_client(port: int, clients: int, seconds: float, max_tokens: int) -> dict:
    """One measurement in a process of its own on CPU 1 (this process prints it as JSON)."""
    asyncio.run(load(port, clients, 1.0, max_tokens))  # warm-up: connections, the engine's threads
    started = time.monotonic()
    ttfts, done = asyncio.run(load(port, clients, seconds, max_tokens))
    wall = max(done) - started if done else seconds
    ttfts.sort()

    def pick(q):
        return round(1000 * ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))], 2) if ttfts else None

    return {"requests": len(done), "wall": wall, "requests_per_s": round(len(done) / wall, 1),
            "tokens_per_s": round(len(done) * max_tokens / wall), "ttft_ms": {"p50": pick(0.5), "p95": pick(0.95),
                                                                               "p99": pick(0.99)},
            "ttft_mean_ms": round(1000 * statistics.fmean(ttfts), 2) if ttfts else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pace", default="200,100000", help="tokens per second per request, comma-separated")
    parser.add_argument("--clients", default="1,8,32,128", help="concurrent clients, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--client-of", type=int, help=argparse.SUPPRESS)  # internal: be the client process
    args = parser.parse_args()
    if args.client_of:
        print(json.dumps(run_client(args.client_of, int(args.clients), args.seconds, args.max_tokens)))
        return

    from lab.hub_models import MODELS, ModelStore

    model_dir = str(ModelStore().files(MODELS["fadenstack-lab/tiny-chat"])["config.json"].local_path.parent)
    log = Path(f"/tmp/fadenstack-bench-engine-{os.getpid()}.log")
    print(f"engine: {PYTHON} {ENGINE} on CPU 0; clients: one asyncio process on CPU 1; "
          f"{args.max_tokens}-token streamed chats, {args.seconds:g} s each")
    print(f"{'pace':>7} {'clients':>7} {'req/s':>8} {'tok/s':>8} {'ttft p50':>9} {'p95':>8} {'p99':>8} {'engine cpu':>10}")
    for pace in [float(p) for p in args.pace.split(",")]:
        port = free_port()
        engine = start_engine(model_dir, port, pace, log)
        try:
            for clients in [int(c) for c in args.clients.split(",")]:
                cpu_before, wall_before = cpu_seconds(engine.pid), time.monotonic()
                measured = subprocess.run(["taskset", "-c", "1", sys.executable, __file__, "--client-of", str(port),
                                           "--clients", str(clients), "--seconds", str(args.seconds),
                                           "--max-tokens", str(args.max_tokens)],
                                          capture_output=True, text=True, check=True)
                cpu = (cpu_seconds(engine.pid) - cpu_before) / (time.monotonic() - wall_before)
                row = json.loads(measured.stdout)
                ttft = row["ttft_ms"]
                print(f"{pace:>7g} {clients:>7} {row['requests_per_s']:>8} {row['tokens_per_s']:>8} "
                      f"{ttft['p50']:>7}ms {ttft['p95']:>6}ms {ttft['p99']:>6}ms {100 * cpu:>9.0f}%", flush=True)
        finally:
            engine.terminate()
            engine.wait(10)
    log.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

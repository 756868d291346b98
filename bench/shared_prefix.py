"""``bench/gateway.py --workload shared-prefix``: cache-aware routing against least busy, on conversations whose
prompts share long prefixes, through the gateway to the lab's engines on loopback.

Two deployments of ``--copies`` copies each, every copy a ``lab/stubs/vllm`` of its own (the vLLM stand-in with
its prefix cache: prefill at ``--prefill`` prompt tokens per second, one at a time per copy, a cache of
``--cache-tokens`` tokens; decode at ``--decode`` tokens per second per request): ``bench`` routed least busy,
``bench-cache`` cache-aware. ``--conversations`` conversations at once, each with a system prompt of
``--system-tokens`` tokens (its own, or one of ``--system-prompts`` they share) and ``--turns`` turns sent back
to back (each turn's messages are the whole conversation so far, the answers ``--answer-tokens`` long,
streamed), on one deployment, then the same on the other; ``--rounds`` rounds alternate which goes first, each
with system prompts no engine has seen. It reports for each routing: time to first token p50 and p99, requests
per second, each copy's share of the requests (its highest against the mean) and the engines' prefix cache hit
rate (their ``vllm:prefix_cache_*`` counters).

Goals (issue 29): time to first token p50 at least 2x better cache-aware, requests per second no worse, no copy
above 1.5x the mean load.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from bench import teardown

base = None  # bench/gateway.py, which runs this (run): its tiny model, console, gateway start and client

ROUTINGS = (("least-busy", "bench"), ("cache-aware", "bench-cache"))
GOALS = {"ttft_p50_ratio": 2.0, "rps_ratio": 1.0, "max_over_mean": 1.5}
WORDS = ("river stone garden window harbour lantern meadow ribbon summer winter autumn spring quiet bright gentle "
         "rapid steady careful simple clear open green blue amber silver golden early late near far").split()


ARGUMENTS = ("conversations", "turns", "copies", "system_tokens", "system_prompts", "answer_tokens", "prefill", "decode",
             "cache_tokens", "bound", "rounds")


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--workload shared-prefix")
    group.add_argument("--conversations", type=int, default=32)
    group.add_argument("--turns", type=int, default=8)
    group.add_argument("--copies", type=int, default=4, help="copies of each deployment (an engine each)")
    group.add_argument("--system-tokens", type=int, default=2000, help="tokens of each conversation's system prompt")
    group.add_argument("--system-prompts", type=int, default=None,
                       help="system prompts the conversations share (conversation n has prompt n modulo this); "
                            "the default: one each")
    group.add_argument("--answer-tokens", type=int, default=32)
    group.add_argument("--prefill", type=float, default=20000, help="prompt tokens per second a copy prefills")
    group.add_argument("--decode", type=float, default=200, help="answer tokens per second per request")
    group.add_argument("--cache-tokens", type=int, default=32768, help="tokens each copy's prefix cache holds")
    group.add_argument("--bound", type=int, default=None, help="FADEN_GATEWAY_PREFIX_BOUND (the setting's default)")


# -- engines, console, gateway ------------------------------------------------------------------------------


def engines_start(args, work: Path, name: str, started: list) -> list[str]:
    """``args.copies`` lab engines serving ``name``, each with its prefill pace and prefix cache."""
    stub = Path(args.lab_stub or base.ROOT / "lab" / "stubs" / "vllm")
    model = base.tiny_model(work / "model")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "FADEN_LAB_ENGINE_PACE": f"{args.decode:g}",
           "FADEN_LAB_ENGINE_PREFILL": f"{args.prefill:g}", "FADEN_LAB_ENGINE_PREFIX_CACHE": str(args.cache_tokens)}
    urls = []
    for number in range(1, args.copies + 1):
        port = base.free_port()
        process = subprocess.Popen(
            ["python3", str(stub), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--served-model-name", name, "--max-model-len", "4096", "--max-num-seqs", "256", "--disable-log-requests"],
            cwd=base.ROOT, env=env, stdout=open(work / f"{name}-{number}.log", "w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        started.append(process)
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        base.wait_http(f"{url}/health")
    return urls


def console_setup(work: Path, redis_url: str, prefix: str, engines: dict[str, list[str]]) -> tuple[str, dict]:
    """The bench's console (bench/gateway.py's: SQLite, Redis under a prefix of its own) with the two deployments:
    ``bench`` (least busy) and ``bench-cache`` (cache-aware), their copies serving at the engines."""
    secret, env = base.console_setup(work, engines["bench"][0], redis_url, prefix)  # bench, copy 1
    from django.utils import timezone

    from deployments.models import Copy, Deployment
    from tests.builders import cluster_of, deployment_of, gpu_machine, ready_model

    least = Deployment.objects.get(name="bench")
    aware = deployment_of(cluster_of([gpu_machine("bench-c", 13)], name="bench-cache"), ready_model("org/bench-cache"),
                          name="bench-cache", routing="cache-aware")
    for deployment, urls, first in ((least, engines["bench"][1:], 2), (aware, engines["bench-cache"], 1)):
        for number, url in enumerate(urls, start=first):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            Copy.objects.create(deployment=deployment, number=number, state="serving", address=host, port=int(port),
                                serving_since=timezone.now())
    return secret, env


# -- the workload -----------------------------------------------------------------------------------------------


def system_prompt(seed: str, tokens: int) -> str:
    rng = random.Random(seed)
    return f"You are assistant {seed}. " + " ".join(rng.choice(WORDS) for _ in range(tokens - 4))


def turn_body(model: str, system: str, conversation: int, turn: int, answer_tokens: int) -> bytes:
    """Turn ``turn`` (from 1) of a conversation: its system prompt, the user's turns and the answers so far."""
    messages = [{"role": "system", "content": system}]
    for n in range(1, turn + 1):
        messages.append({"role": "user", "content": f"Question {n} of conversation {conversation}: where does the "
                                                    f"{WORDS[(conversation + n) % len(WORDS)]} river go after turn {n}?"})
        if n < turn:
            messages.append({"role": "assistant", "content": " ".join(WORDS[(conversation * n + i) % len(WORDS)]
                                                                       for i in range(answer_tokens))})
    return json.dumps({"model": model, "messages": messages, "stream": True, "max_tokens": answer_tokens,
                       "ignore_eos": True}).encode()


def request_bytes(url: str, secret: str, body: bytes) -> bytes:
    host = url.removeprefix("http://")
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + secret.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body)


async def conversations(url: str, secret: str, model: str, args, seed: str) -> dict:
    """Every conversation at once, each its turns back to back on a kept-alive connection of its own."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    results: list[tuple[int, float, float]] = []

    async def one(number: int) -> None:
        system = system_prompt(f"{seed}-{number % (args.system_prompts or args.conversations)}", args.system_tokens)
        connection = base.Connection(host, int(port))
        await connection.open()
        try:
            for turn in range(1, args.turns + 1):
                results.append(await connection.post(request_bytes(url, secret, turn_body(
                    model, system, number, turn, args.answer_tokens))))
        finally:
            connection.close()

    started = time.perf_counter()
    await asyncio.gather(*(one(n) for n in range(args.conversations)))
    seconds = time.perf_counter() - started
    return {"requests": len(results), "failed": sum(1 for status, _, _ in results if status != 200), "seconds": seconds,
            "rps": len(results) / seconds, "first": sorted(first for _, first, _ in results),
            "latency": sorted(total for _, _, total in results)}


def engine_counters(urls: list[str]) -> list[dict]:
    """Each engine's requests answered and prefix cache tokens queried and hit, from its /metrics."""
    import httpx

    found = []
    for url in urls:
        counts = {"requests": 0.0, "queries": 0.0, "hits": 0.0}
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0]
            if name == "vllm:request_success_total":
                counts["requests"] += float(line.rsplit(" ", 1)[1])
            elif name == "vllm:prefix_cache_queries_total":
                counts["queries"] = float(line.rsplit(" ", 1)[1])
            elif name == "vllm:prefix_cache_hits_total":
                counts["hits"] = float(line.rsplit(" ", 1)[1])
        found.append(counts)
    return found


def measure(gateway_url: str, secret: str, model: str, urls: list[str], args, seed: str) -> dict:
    before = engine_counters(urls)
    result = asyncio.run(conversations(gateway_url, secret, model, args, seed))
    after = engine_counters(urls)
    result["copies"] = [{name: a[name] - b[name] for name in a} for a, b in zip(after, before)]
    return result


def merged(total: dict | None, one: dict) -> dict:
    if total is None:
        return one
    seconds = total["seconds"] + one["seconds"]
    requests = total["requests"] + one["requests"]
    return {"requests": requests, "failed": total["failed"] + one["failed"], "seconds": seconds,
            "rps": requests / seconds, "first": sorted(total["first"] + one["first"]), "latency": sorted(total["latency"] + one["latency"]),
            "copies": [{name: a[name] + b[name] for name in a} for a, b in zip(total["copies"], one["copies"])]}


# -- the report ---------------------------------------------------------------------------------------------------


def figures(result: dict) -> dict:
    loads = [copy["requests"] for copy in result["copies"]]
    mean = sum(loads) / len(loads) if loads else 0
    queried = sum(copy["queries"] for copy in result["copies"])
    return {"requests": result["requests"], "failed": result["failed"], "rps": result["rps"],
            "ttft_p50_ms": base.quantile(result["first"], .5) * 1000,
            "ttft_p99_ms": base.quantile(result["first"], .99) * 1000,
            "latency_p50_ms": base.quantile(result["latency"], .5) * 1000,
            "loads": [int(n) for n in loads], "max_over_mean": max(loads) / mean if mean else float("nan"),
            "hit_rate": sum(copy["hits"] for copy in result["copies"]) / queried if queried else 0.0}


def report(results: dict, args) -> dict:
    least, aware = figures(results["least-busy"]), figures(results["cache-aware"])
    ratios = {"ttft_p50_ratio": least["ttft_p50_ms"] / aware["ttft_p50_ms"],
              "ttft_p99_ratio": least["ttft_p99_ms"] / aware["ttft_p99_ms"],
              "rps_ratio": aware["rps"] / least["rps"], "max_over_mean": aware["max_over_mean"]}
    lines = [f"Machine: {platform.machine()}, {psutil.cpu_count()} CPUs, Python {platform.python_version()}, load average "
             f"{os.getloadavg()[0]:.1f}",
             f"Workload: {args.conversations} conversations of {args.turns} turns at once, {args.system_tokens:,}-token system "
             f"prompts ({f'{args.system_prompts} shared' if args.system_prompts else 'one each'}), {args.answer_tokens}-token streamed answers, {(args.rounds or 1)} round(s); {args.copies} copies "
             f"per deployment, each a lab engine prefilling {args.prefill:g} tokens/s with a {args.cache_tokens:,}-token "
             f"prefix cache, decoding {args.decode:g} tokens/s per request",
             "",
             f"{'routing':<12}{'requests':>9}{'req/s':>8}{'TTFT p50':>11}{'p99':>11}{'latency p50':>13}{'cache hits':>12}"
             f"   requests per copy (max / mean)"]
    for routing, row in (("least-busy", least), ("cache-aware", aware)):
        lines.append(f"{routing:<12}{row['requests']:>9}{row['rps']:>8.1f}{row['ttft_p50_ms']:>8.0f} ms{row['ttft_p99_ms']:>8.0f} ms"
                     f"{row['latency_p50_ms']:>10.0f} ms{row['hit_rate']:>11.0%}   {' / '.join(map(str, row['loads']))} "
                     f"({row['max_over_mean']:.2f}){f'  ({row['failed']} failed)' if row['failed'] else ''}")

    def verdict(ok: bool) -> str:
        return "meets the goal" if ok else "MISSES the goal"

    lines += ["",
              f"Time to first token p50: {ratios['ttft_p50_ratio']:.1f}x better cache-aware (goal >= 2x: "
              f"{verdict(ratios['ttft_p50_ratio'] >= GOALS['ttft_p50_ratio'])}); p99 {ratios['ttft_p99_ratio']:.1f}x",
              f"Requests per second: {ratios['rps_ratio']:.2f}x least busy's (goal >= 1: "
              f"{verdict(ratios['rps_ratio'] >= GOALS['rps_ratio'])})",
              f"Busiest copy cache-aware: {ratios['max_over_mean']:.2f}x the mean load (goal <= 1.5: "
              f"{verdict(ratios['max_over_mean'] <= GOALS['max_over_mean'])})"]
    print("\n".join(lines))
    return {"least-busy": least, "cache-aware": aware, **ratios}


def run(args, gateway_bench) -> None:
    """The workload, with bench/gateway.py's pieces (``gateway_bench``: that module, as it runs)."""
    global base
    base = gateway_bench
    work = Path(tempfile.mkdtemp(prefix="fadenstack-bench-prefix-"))
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/9")
    prefix = f"bench-prefix-{uuid.uuid4().hex[:8]}"
    started: list[subprocess.Popen] = []
    try:
        engines = {name: engines_start(args, work, name, started) for _, name in ROUTINGS}
        secret, env = console_setup(work, redis_url, prefix, engines)
        if args.bound is not None:
            env["FADEN_GATEWAY_PREFIX_BOUND"] = str(args.bound)
        gateway_url, gateway = base.gateway_start(work, env)
        started.append(gateway)
        time.sleep(1.0)  # the gateway's routes: read at its start, and every FADEN_GATEWAY_REFRESH after
        results: dict[str, dict] = {}
        for round_number in range((args.rounds or 1)):
            order = ROUTINGS if round_number % 2 == 0 else ROUTINGS[::-1]
            for routing, name in order:
                seed = f"r{round_number}-{uuid.uuid4().hex[:6]}"  # system prompts no engine has seen
                one = measure(gateway_url, secret, name, engines[name], args, seed)
                results[routing] = merged(results.get(routing), one)
        summary = report(results, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"workload": "shared-prefix", "arguments": {
                name: getattr(args, name) for name in ARGUMENTS}, "summary": summary}, indent=2))
    finally:
        teardown.clean_up(started, redis_url=redis_url, prefix=prefix, work=work)

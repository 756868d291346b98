"""``bench/gateway.py --limits``: what a key's limits cost a request (deployments/gateway/limits.py).

First the check in the benchmark's own process (``Limits.admit`` and ``answered`` with the answer's tokens, for
a key without limits and one with both, in CPU time), then through the gateway: a key with limits too high to
refuse against one without, in alternating rounds, whole answers at 1 and 16 concurrent. The functions that
measure through the gateway take ``bench``, the gateway benchmark's module (its client, ``measure`` and figures).
"""
from __future__ import annotations

import asyncio
import json
import platform
import time

import psutil

ROUNDS = 10  # alternating rounds of each key


def limits_key() -> str:
    """A second key, with limits no run reaches (so every request is checked and none refused)."""
    from deployments.gateway_keys import gateway_key_create

    return gateway_key_create(name="bench-limited", requests_per_minute=10_000_000, tokens_per_minute=10**12)[1]


def limits_check_cost(rounds: int = 100_000) -> dict:
    """Microseconds a request spends in limits.py, key_usage.py and answer.py: the check, the gateway's
    ``Answer`` on a whole answer (its start and one body chunk) and the reading of its usage, for a key without
    limits and one with both, less the two sends the gateway makes anyway. (The gateway makes that one
    ``Answer`` for the metrics as well, which read the same tokens.)"""
    from deployments.gateway.answer import Answer
    from deployments.gateway.limits import Limits
    from deployments.gateway.routes import KeyEntry

    body = json.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "the gateway passes each token on " * 4}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28}}).encode()
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    chunk = {"type": "http.response.body", "body": body}

    async def sent(message):
        pass

    async def one(limits, key) -> None:
        if key is None:  # what the gateway does anyway: send the answer on
            await sent(start)
            await sent(chunk)
            return
        limits.admit(key)
        answer = Answer(sent)
        await answer(start)
        await answer(chunk)
        limits.answered(key, answer.tokens(), error=False)

    async def timed(key) -> float:
        limits = Limits()
        for _ in range(1000):
            await one(limits, key)
        began = time.process_time()  # this process's CPU: what other processes on the machine take is left out
        for _ in range(rounds):
            await one(limits, key)
        return (time.process_time() - began) / rounds * 1e6

    free = KeyEntry(id=1, allowed=None)
    limited = KeyEntry(id=2, allowed=None, requests_per_minute=10**9, tokens_per_minute=10**15, limited=True)
    found = {"sending": [], "without": [], "with": []}
    for _ in range(5):  # alternating, the best of five each: what the machine's other work leaves
        for name, key in (("sending", None), ("without", free), ("with", limited)):
            found[name].append(asyncio.run(timed(key)))
    best = {name: min(values) for name, values in found.items()}
    return {"without": best["without"] - best["sending"], "with": best["with"] - best["sending"]}


def limits_through_gateway(bench, url: str, free_secret: str, limited_secret: str, processes: dict, args) -> dict:
    """Whole answers through the gateway with each key, in alternating short rounds (as --tls does)."""
    measure, merged, request_bytes = bench.measure, bench.merged, bench.request_bytes
    results = {}
    keys = (("without", free_secret), ("with", limited_secret))
    for concurrency in (1, 16):
        pair = {}
        for turn in range(ROUNDS):
            for name, secret in (keys if turn % 2 == 0 else keys[::-1]):
                one = measure(url, request_bytes(url, secret, stream=False), processes, concurrency=concurrency,
                              requests=args.requests // ROUNDS, seconds=args.seconds / ROUNDS)
                pair[name] = merged(pair.get(name), one)
        results[concurrency] = pair
    return results


def limits_report(bench, check: dict, results: dict) -> dict:
    quantile, ms = bench.quantile, bench.ms
    one, many = results[1], results[16]
    added_p50 = (quantile(one["with"]["latency"], .5) - quantile(one["without"]["latency"], .5)) * 1e6
    added_p99 = (quantile(one["with"]["latency"], .99) - quantile(one["without"]["latency"], .99)) * 1e6
    cpu = {name: many[name]["cpu"]["gateway"] / many[name]["rps"] * 1e6 for name in ("without", "with")}
    lines = [f"Machine: {platform.machine()}, {psutil.cpu_count()} CPUs, Python {platform.python_version()}", "",
             f"The check in this process, CPU per request (admit, the answer's wrapper, its usage read; less the two sends "
             f"it wraps): {check['without']:.1f} us for a key without limits, {check['with']:.1f} us with both limits",
             "", f"{'conc':>5}  {'key':<9}{'requests':>9}{'req/s':>9}{'p50':>11}{'p99':>11}   gateway CPU per request"]
    for concurrency, pair in results.items():
        for name in ("without", "with"):
            r = pair[name]
            lines.append(f"{concurrency:>5}  {name + ' limits':<9}{r['requests']:>9}{r['rps']:>9.0f}{ms(quantile(r['latency'], .5)):>11}"
                         f"{ms(quantile(r['latency'], .99)):>11}   {r['cpu']['gateway'] / r['rps'] * 1e6:.0f} us"
                         f"{f'  ({r['failed']} failed)' if r['failed'] else ''}")
    lines += ["", f"Added by the limits through the gateway at 1 concurrent: p50 {added_p50:+.0f} us, p99 {added_p99:+.0f} us; "
                  f"requests per second at 16 concurrent: {many['with']['rps']:.0f} with, {many['without']['rps']:.0f} without "
                  f"({many['with']['rps'] / many['without']['rps']:.0%}); the gateway's CPU per request {cpu['with']:.0f} us "
                  f"with, {cpu['without']:.0f} us without"]
    print("\n".join(lines))
    return {"check_us_without": check["without"], "check_us_with": check["with"], "added_p50_us": added_p50,
            "added_p99_us": added_p99, "rps_with": many["with"]["rps"], "rps_without": many["without"]["rps"],
            "gateway_cpu_us_with": cpu["with"], "gateway_cpu_us_without": cpu["without"]}

#!/usr/bin/env python
"""Cache-aware routing's cost in the gateway: the prefix index's memory after a million requests, and the time a
request spends on it (deployments/gateway/prefix.py).

    .venv/bin/python bench/prefix_index.py                         # 1,000,000 requests, the default settings
    .venv/bin/python bench/prefix_index.py --entries 1000000 --requests 300000 --json out.json

Memory: ``--requests`` chat requests routed through one ``CacheAware`` (4 copies), as conversations of
``--turns`` turns over ``--system-prompts`` system prompts of ``--system-tokens`` tokens; then the index's bytes
as Python counts them (``sys.getsizeof`` of the OrderedDict, which includes its hash table, its order's nodes
and their index, and of each key), the process's resident memory before and after, and with ``--trace`` the
bytes tracemalloc saw allocated and still live (traced from the start: several times slower).

Time (this process's CPU time, not the wall clock: the machine is shared): one 2,000-token chat's keys
(``prompt_text`` and the hash chain) and its choice of a copy, each taken ``--repeat`` times, against
``json.loads`` of the same body (which every request pays anyway) and a least-busy pick.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
import tracemalloc
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deployments.choices import Routing  # noqa: E402
from deployments.gateway.prefix import DEFAULT_BLOCK, DEFAULT_BOUND, DEFAULT_ENTRIES, CacheAware  # noqa: E402
from deployments.gateway.routes import CopyRoute, DeploymentRoute  # noqa: E402

WORDS = ("river stone garden window harbour lantern meadow ribbon summer winter autumn spring quiet bright gentle "
         "rapid steady careful simple clear open green blue amber silver golden early late near far").split()


def words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def system_prompt(n: int, tokens: int) -> str:
    return f"System prompt {n}. " + words(random.Random(n), tokens)


def chat(system: str, turns: list[str]) -> dict:
    messages = [{"role": "system", "content": system}]
    for n, turn in enumerate(turns):
        if n:
            messages.append({"role": "assistant", "content": f"Answer {n}: {turn[::-1]}"})
        messages.append({"role": "user", "content": turn})
    return {"model": "bench", "messages": messages, "stream": True}


def route_of(cache: CacheAware, count: int = 4) -> DeploymentRoute:
    copies = [CopyRoute(id=n, number=n, deployment="bench", host="127.0.0.1", port=8100 + n, since="")
              for n in range(1, count + 1)]
    return DeploymentRoute(id=1, name="bench", copies=copies, routing=Routing.CACHE_AWARE, cache=cache)


def memory(args) -> dict:
    """The index after ``args.requests`` requests: its keys, live bytes and the process's growth."""
    process = psutil.Process()
    systems = [system_prompt(n, args.system_tokens) for n in range(args.system_prompts)]
    rng = random.Random(1)
    open_conversations = 64  # this many at a time, each a turn further every time it is picked
    gc.collect()
    rss_before = process.memory_info().rss
    if args.trace:
        tracemalloc.start()
    cache = CacheAware(entries=args.entries, bound=args.bound, block=args.block)
    route = route_of(cache)
    traced_before = tracemalloc.get_traced_memory()[0] if args.trace else 0
    conversations = [(rng.randrange(len(systems)), []) for _ in range(open_conversations)]
    started = time.perf_counter()
    for n in range(args.requests):
        slot = rng.randrange(open_conversations)
        system, turns = conversations[slot]
        turns.append(words(rng, 30))
        request = chat(systems[system], turns)
        route.pick((), route.prompt_keys(request))
        if len(turns) >= args.turns:
            conversations[slot] = (rng.randrange(len(systems)), [])
        if n and n % 100_000 == 0:
            print(f"  {n:,} requests, {len(cache.index):,} keys, {time.perf_counter() - started:.0f} s", flush=True)
    del request, conversations
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - traced_before if args.trace else None
    if args.trace:
        tracemalloc.stop()
    rss_after = process.memory_info().rss
    table = cache.index.copies
    # The values are the copies' ids, ints the routes hold anyway.
    counted = sys.getsizeof(table) + sum(sys.getsizeof(key) for key in table)
    return {"requests": args.requests, "entries_setting": args.entries, "keys": len(table),
            "index_bytes": counted, "bytes_per_key": counted / len(table), "traced_bytes": traced,
            "rss_growth_bytes": rss_after - rss_before, "sent": dict(cache.sent),
            "seconds": time.perf_counter() - started}


def timing(args) -> dict:
    """Microseconds per request: a 2,000-token chat's keys and choice, against json.loads of its body."""
    system = system_prompt(0, 2000)
    request = chat(system, ["Where does the river go, and how far?"])
    body = json.dumps(request).encode()
    cache = CacheAware(entries=args.entries, bound=args.bound, block=args.block)
    route = route_of(cache)

    def per_call(function) -> float:
        """CPU microseconds a call (this process's CPU time, not the wall clock: the machine is shared), the best
        of five rounds."""
        best = float("inf")
        for _ in range(5):
            started = time.process_time()
            for _ in range(args.repeat):
                function()
            best = min(best, (time.process_time() - started) / args.repeat)
        return best * 1e6

    keys = route.prompt_keys(request)
    figures = {
        "prompt_characters": len(system), "blocks": len(keys),
        "json_loads_us": per_call(lambda: json.loads(body)),
        "keys_us": per_call(lambda: route.prompt_keys(request)),
        "choose_us": per_call(lambda: route.pick((), keys)),
        "least_busy_pick_us": per_call(lambda: route.pick(())),
    }
    figures["added_us"] = figures["keys_us"] + figures["choose_us"] - figures["least_busy_pick_us"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--entries", type=int, default=DEFAULT_ENTRIES, help="FADEN_GATEWAY_PREFIX_ENTRIES")
    parser.add_argument("--bound", type=int, default=DEFAULT_BOUND, help="FADEN_GATEWAY_PREFIX_BOUND")
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="FADEN_GATEWAY_PREFIX_BLOCK")
    parser.add_argument("--system-prompts", type=int, default=2000)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2000, help="calls per timing round")
    parser.add_argument("--trace", action="store_true", help="tracemalloc's count too (several times slower)")
    parser.add_argument("--json", help="write the figures to this file too")
    args = parser.parse_args()

    print(f"Machine: {platform.machine()}, {psutil.cpu_count()} CPUs, Python {platform.python_version()}")
    spent = timing(args)
    print(f"A {spent['prompt_characters']:,}-character (2,000-token) chat, {spent['blocks']} blocks of {args.block}: "
          f"its keys {spent['keys_us']:.1f} us, its choice {spent['choose_us']:.1f} us, a least-busy pick "
          f"{spent['least_busy_pick_us']:.2f} us: {spent['added_us']:.1f} us added per request "
          f"(json.loads of its body: {spent['json_loads_us']:.1f} us)")
    print(f"Routing {args.requests:,} requests (conversations of {args.turns} turns over {args.system_prompts:,} "
          f"system prompts of {args.system_tokens:,} tokens) through an index of {args.entries:,} keys…")
    held = memory(args)
    traced = (f", {held['traced_bytes'] / 1e6:.1f} MB by tracemalloc ({held['traced_bytes'] / held['keys']:.0f} a key)"
              if held["traced_bytes"] is not None else "")
    print(f"After {held['requests']:,} requests ({held['seconds']:.0f} s): {held['keys']:,} keys, "
          f"{held['index_bytes'] / 1e6:.1f} MB by sys.getsizeof ({held['bytes_per_key']:.0f} bytes a key){traced}; "
          f"the process grew {held['rss_growth_bytes'] / 1e6:.1f} MB")
    print(f"Sent to the copy holding the prefix: {held['sent']['held']:,}, to the least busy (none held it): "
          f"{held['sent']['new']:,}, over the bound: {held['sent']['busy']:,}")
    if args.json:
        Path(args.json).write_text(json.dumps({"timing": spent, "memory": held}, indent=2))


if __name__ == "__main__":
    main()

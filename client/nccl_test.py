"""``faden clusters test``: start the NCCL test, follow it size by size, print the peak and the console's sentence."""
from __future__ import annotations

import argparse
import sys
import time

from client.api import ClientError, Console

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

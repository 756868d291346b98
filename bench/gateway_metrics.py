#!/usr/bin/env python
"""What the gateway's metrics cost a request, and what a scrape costs (deployments/gateway/metrics.py).

    .venv/bin/python bench/gateway_metrics.py                      # 200,000 requests a run, 7 runs
    .venv/bin/python bench/gateway_metrics.py --requests 50000 --chunks 64 --deployments 50

No server, no copy: the part of a request the metrics add, alone. Each request is the ASGI messages the
gateway sends its client for one answer: the head, ``--chunks`` body chunks (the last with the usage, as a
vLLM answer ends) and the end, sent to a ``send`` that does nothing, through ``answer.Answer`` (the one
wrapper of a forwarded request: its tail and the reading of its usage serve the key's limits too) and then
``GatewayMetrics.record`` (instrumented), against the same messages sent straight to it (bare). The
difference over the number of requests is the cost per request, in microseconds of CPU (the process's own
CPU time, steadier than the clock when others share the CPUs); the median of --runs runs.

The scrape: ``/metrics`` answered for --deployments deployments of 4 copies each that all had traffic, the
text built by the process alone, and through the files workers share (metrics_files.py), both in the metrics
thread; and the event loop's own share of a scrape (``reading()``: the figures copied).
"""
import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deployments.gateway.answer import Answer  # noqa: E402 (after the path)
from deployments.gateway.metrics import GatewayMetrics, MetricsConfig  # noqa: E402
from deployments.gateway.routes import RouteTable, Snapshot  # noqa: E402

USAGE_END = (b'{"index":0,"finish_reason":"length"}],"usage":{"prompt_tokens":12,"total_tokens":28,'
             b'"completion_tokens":16,"prompt_tokens_details":null},"prompt_logprobs":null,"kv_transfer_params":null}')


def messages(chunks: int) -> list[dict]:
    body = [{"type": "http.response.body", "body": b"data: " + b"x" * 120 + b"\n\n", "more_body": True}
            for _ in range(chunks - 1)]
    return [{"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]},
            *body, {"type": "http.response.body", "body": USAGE_END, "more_body": True},
            {"type": "http.response.body", "body": b""}]


async def bare(send, answer_messages, requests: int) -> None:
    for _ in range(requests):
        for message in answer_messages:
            await send(message)


async def instrumented(send, answer_messages, requests: int, metrics: GatewayMetrics) -> None:
    perf_counter = time.perf_counter
    for _ in range(requests):
        started = perf_counter()
        answer = Answer(send)
        for message in answer_messages:
            await answer(message)
        metrics.record("llama", answer, started, False)


def cpu_of(coroutine) -> float:
    before = time.process_time()
    asyncio.run(coroutine)
    return time.process_time() - before


def table_of(deployments: int) -> RouteTable:
    table = RouteTable()
    names = tuple((f"model-{n:03d}", n, 0) for n in range(1, deployments + 1))
    copies = tuple((n * 10 + c, n, c, "10.0.0.1", 8000 + c, "t") for n in range(1, deployments + 1) for c in (1, 2, 3, 4))
    table.apply(Snapshot(deployments=names, copies=copies, keys=()))
    return table


def scrape_ms(metrics: GatewayMetrics, runs: int) -> float:
    sent = []

    async def send(message):
        sent.append(message)

    async def one():
        await metrics.scrape({"method": "GET", "headers": [(b"authorization", b"Bearer " + b"t" * 32)]}, send)

    times = []
    for _ in range(runs):
        started = time.perf_counter()
        asyncio.run(one())
        times.append(time.perf_counter() - started)
    assert sent[0]["status"] == 200, sent[0]
    return statistics.median(times) * 1000, len(sent[1]["body"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--chunks", type=int, default=1, help="body chunks per answer (1: a whole answer)")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--deployments", type=int, default=20, help="for the scrape")
    args = parser.parse_args()

    async def send(message):
        pass

    answer_messages = messages(args.chunks)
    costs = []
    for _ in range(args.runs):
        metrics = GatewayMetrics(RouteTable())
        base = cpu_of(bare(send, answer_messages, args.requests))
        with_metrics = cpu_of(instrumented(send, answer_messages, args.requests, metrics))
        costs.append((with_metrics - base) / args.requests * 1e6)
    assert metrics.deployments["llama"].completion_tokens == 16 * args.requests, "the usage was not read"
    print(f"{args.chunks} body chunk(s) per answer: the answer and the metrics cost {statistics.median(costs):.2f} us of CPU per request "
          f"(median of {args.runs} runs of {args.requests:,}; runs {min(costs):.2f} to {max(costs):.2f})")

    table = table_of(args.deployments)
    token = MetricsConfig(token="t" * 32)
    alone = GatewayMetrics(table, token)
    with tempfile.TemporaryDirectory() as directory:
        shared = GatewayMetrics(table, MetricsConfig(token="t" * 32, directory=directory))
        for metrics in (alone, shared):
            for name, *_ in table.snapshot.deployments:
                for _ in range(3):  # an answer as Answer saw it go
                    started = time.perf_counter()
                    answer = Answer(lambda message: None)
                    answer({"type": "http.response.start", "status": 200, "headers": []})
                    answer({"type": "http.response.body", "body": USAGE_END})
                    metrics.record(name, answer, started, False)
        from deployments.gateway import metrics_files

        shared.files = metrics_files.SharedFiles(Path(directory), os.getpid())
        alone_ms, alone_bytes = scrape_ms(alone, 20)
        shared_ms, shared_bytes = scrape_ms(shared, 20)
        shared.files.close()
    loop_us = statistics.median(timed(alone.reading) for _ in range(200)) * 1e6
    print(f"a scrape of {args.deployments} deployments x 4 copies ({alone_bytes:,} bytes): {alone_ms:.1f} ms from the "
          f"process alone, {shared_ms:.1f} ms through the workers' files, in the metrics thread; the event loop's "
          f"share (the figures copied): {loop_us:.0f} us")


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()

"""The gateway's ``GET /metrics``: what it forwarded, in Prometheus's text format.

A request costs a few integer additions on the event loop (``GatewayMetrics.record``, from what the request's
``answer.Answer`` kept: bench/gateway_metrics.py). The text is built only when Prometheus asks, in a thread of
its own, from a copy of those figures and of the route table's (requests in flight are the copies' own
counters) taken on the loop. The families, per deployment (its name: never the client's words) and copy (its
number):

- ``fadenstack_gateway_requests_total{deployment, code}``: forwarded requests by the class of the status the
  client got (``2xx`` ... ``5xx``; ``cancelled`` when the client left before an answer began);
- ``fadenstack_gateway_errors_total{deployment}``: the Gateway page's errors (answers of 500 and above, copies
  that could not be reached or broke off, no copy serving);
- ``fadenstack_gateway_request_duration_seconds{deployment}``: a histogram, the request's start to its
  answer's last byte;
- ``fadenstack_gateway_time_to_first_token_seconds{deployment}``: a histogram, the request's start to the
  first body chunk of a 2xx answer from the copy (a stream's first event; a whole answer's first bytes);
- ``fadenstack_gateway_requests_in_flight{deployment}``, ``fadenstack_gateway_copy_requests_in_flight{deployment,
  copy}``: gauges, requests sent to copies whose answer has not ended;
- ``fadenstack_gateway_prompt_tokens_total``, ``..._completion_tokens_total{deployment}``: from the ``usage``
  the copy puts at the end of a 2xx answer (every whole answer; a stream only when the client asked for
  ``stream_options: {"include_usage": true}``), read by ``Answer.tokens()`` from the answer's last bytes, the
  same reading the key's limits and usage take;
- ``fadenstack_gateway_refusals_total{code}``: requests the gateway refused itself, by OpenAI's error code
  (``invalid_api_key``, ``model_not_found``, ...);
- ``fadenstack_gateway_limit_refusals_total{limit}``: requests refused for a key's limit (``requests`` or
  ``tokens`` per minute): the limits call ``GatewayMetrics.limit_refused``.

Who may read them (``MetricsConfig``): a scrape that sends ``Authorization: Bearer <FADEN_METRICS_TOKEN>``, or
anyone when FADEN_GATEWAY_METRICS_OPEN is set (a gateway only a private network reaches); nobody otherwise.

Several worker processes behind one port (uvicorn's ``--workers``): a scrape reaches any one of them, so each
writes its figures every second to prometheus_client's multiprocess files (``metrics_files.py``) and the
one asked answers for all. docs/gateway.md, "Metrics", is the operator's view.
"""
from __future__ import annotations

import asyncio
import bisect
import hmac
import json
import logging
import multiprocessing
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.utils import floatToGoString

from deployments.gateway.answer import Answer
from deployments.gateway.routes import RouteTable

log = logging.getLogger("fadenstack.gateway")

PREFIX = "fadenstack_gateway"
# Prometheus's text format as every Prometheus reads it (the names are plain: version 1.0.0's escapes are not needed).
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
# Upper bounds of both histograms, in seconds: the gateway's own share (a millisecond) up to a long generation.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CODE_CLASSES = {1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}
LIMITS = ("requests", "tokens")  # the key limits a refusal is counted under
WRITE_EVERY = 1.0  # seconds between two writes of this process's figures when workers share a port


@dataclass(frozen=True)
class MetricsConfig:
    token: str = ""  # FADEN_METRICS_TOKEN: the bearer token a scrape sends
    open: bool = False  # FADEN_GATEWAY_METRICS_OPEN: answered without the token
    directory: str = ""  # where the workers of one gateway add up their figures; "" for a gateway of one process

    @classmethod
    def from_settings(cls) -> MetricsConfig:
        from django.conf import settings

        return cls(token=settings.FADEN_METRICS_TOKEN, open=settings.FADEN_GATEWAY_METRICS_OPEN,
                   directory=str(workers_directory(Path(settings.FADEN_GATEWAY_METRICS_DIR)) or ""))


def workers_directory(base: Path) -> Path | None:
    """This gateway's directory of figures when it is one of uvicorn's workers (a process uvicorn's
    supervisor started, the same parent for all of them), made empty of earlier gateways'; None when the
    process serves alone."""
    if multiprocessing.parent_process() is None:
        return None
    from deployments.gateway import metrics_files

    return metrics_files.run_directory(base, os.getppid())


class DeploymentFigures:
    """What one deployment's requests added up to since the process started (cumulative, as Prometheus counts)."""

    __slots__ = ("requests", "errors", "duration", "duration_sum", "first", "first_sum", "prompt_tokens",
                 "completion_tokens")

    def __init__(self):
        self.requests: dict[str, int] = {}  # by code class
        self.errors = 0
        self.duration = [0] * (len(BUCKETS) + 1)  # how many fell in each bucket (the last: over the last bound)
        self.duration_sum = 0.0
        self.first = [0] * (len(BUCKETS) + 1)
        self.first_sum = 0.0
        self.prompt_tokens = 0
        self.completion_tokens = 0


@dataclass(frozen=True)
class Reading:
    """One process's figures at one moment, as plain data: ``GatewayMetrics.reading()``."""

    deployments: dict[str, tuple]  # name -> (requests by code, errors, duration buckets, sum, first buckets, sum,
    #                                         prompt tokens, completion tokens)
    refusals: dict[str, int]
    limits: dict[str, int]
    copies_in_flight: dict[tuple[str, int], int]  # (deployment, copy number) -> requests
    routed: tuple[str, ...]  # the deployments in the routes (each has a requests-in-flight series, 0 or more)


def families(reading: Reading) -> list:
    """The metric families of one reading."""
    requests = CounterMetricFamily(f"{PREFIX}_requests", "Requests forwarded to a deployment, by the class of the "
                                   "status the client got (cancelled: the client left before an answer).",
                                   labels=["deployment", "code"])
    errors = CounterMetricFamily(f"{PREFIX}_errors", "Requests that failed: answers of 500 and above, copies that "
                                 "could not be reached or broke off, no copy serving.", labels=["deployment"])
    duration = HistogramMetricFamily(f"{PREFIX}_request_duration_seconds", "From a request's arrival to its answer's "
                                     "last byte.", labels=["deployment"])
    first = HistogramMetricFamily(f"{PREFIX}_time_to_first_token_seconds", "From a request's arrival to the first "
                                  "body chunk of a 2xx answer from the copy.", labels=["deployment"])
    prompt = CounterMetricFamily(f"{PREFIX}_prompt_tokens", "Prompt tokens, from the usage of 2xx answers (streams "
                                 "only with include_usage).", labels=["deployment"])
    completion = CounterMetricFamily(f"{PREFIX}_completion_tokens", "Completion tokens, from the usage of 2xx answers "
                                     "(streams only with include_usage).", labels=["deployment"])
    for name, (codes, failed, durations, duration_sum, firsts, first_sum, prompts, completions) in sorted(
            reading.deployments.items()):
        for code, count in sorted(codes.items()):
            requests.add_metric([name, code], count)
        errors.add_metric([name], failed)
        duration.add_metric([name], _buckets(durations), duration_sum)
        first.add_metric([name], _buckets(firsts), first_sum)
        prompt.add_metric([name], prompts)
        completion.add_metric([name], completions)
    in_flight = GaugeMetricFamily(f"{PREFIX}_requests_in_flight", "Requests sent to a copy of the deployment whose "
                                  "answer has not ended.", labels=["deployment"])
    copies = GaugeMetricFamily(f"{PREFIX}_copy_requests_in_flight", "Requests sent to the copy whose answer has not "
                               "ended.", labels=["deployment", "copy"])
    totals = dict.fromkeys(reading.routed, 0)
    for (name, number), count in sorted(reading.copies_in_flight.items()):
        copies.add_metric([name, str(number)], count)
        totals[name] = totals.get(name, 0) + count
    for name, count in sorted(totals.items()):
        in_flight.add_metric([name], count)
    refusals = CounterMetricFamily(f"{PREFIX}_refusals", "Requests the gateway refused itself, by OpenAI's error "
                                   "code.", labels=["code"])
    for code, count in sorted(reading.refusals.items()):
        refusals.add_metric([code], count)
    limits = CounterMetricFamily(f"{PREFIX}_limit_refusals", "Requests refused for their key's limit, by the limit "
                                 "(requests or tokens per minute).", labels=["limit"])
    for limit, count in sorted(reading.limits.items()):
        limits.add_metric([limit], count)
    return [requests, errors, duration, first, prompt, completion, in_flight, copies, refusals, limits]


class GatewayMetrics:
    """One gateway process's figures (used on its event loop only), and its ``/metrics`` answer."""

    def __init__(self, table: RouteTable, config: MetricsConfig | None = None):
        self.table = table
        self.config = config or MetricsConfig()
        self.deployments: dict[str, DeploymentFigures] = {}
        self.refusals: dict[str, int] = {}
        self.limits: dict[str, int] = dict.fromkeys(LIMITS, 0)
        self.files = None  # metrics_files.SharedFiles when workers share a port
        self.task: asyncio.Task | None = None
        # Where the text is built and the files written: one thread, so that no two write the files at once.
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="gateway-metrics")

    # -- on the request path ---------------------------------------------------------------------------

    def record(self, deployment: str, answer: Answer, started: float, error: bool) -> None:
        """One forwarded request has ended (``started``: its ``time.perf_counter()`` at arrival)."""
        seconds = time.perf_counter() - started
        figures = self.deployments.get(deployment)
        if figures is None:
            figures = self.deployments[deployment] = DeploymentFigures()
        status = answer.status
        code = CODE_CLASSES.get(status // 100, "5xx") if status else ("5xx" if error else "cancelled")
        figures.requests[code] = figures.requests.get(code, 0) + 1
        figures.errors += error
        figures.duration[bisect.bisect_left(BUCKETS, seconds)] += 1
        figures.duration_sum += seconds
        if code == "2xx" and answer.first_at is not None:
            first = answer.first_at - started
            figures.first[bisect.bisect_left(BUCKETS, first)] += 1
            figures.first_sum += first
            prompt, completion = answer.tokens()  # (0, 0) unless 2xx; read once for the key's usage too
            figures.prompt_tokens += prompt
            figures.completion_tokens += completion

    def refused(self, code: str) -> None:
        """The gateway refused a request itself: ``code`` is the OpenAI error code it answered."""
        self.refusals[code] = self.refusals.get(code, 0) + 1

    def limit_refused(self, limit: str) -> None:
        """A request refused for its key's limit: ``limit`` is ``requests`` or ``tokens`` (per minute)."""
        self.limits[limit] = self.limits.get(limit, 0) + 1

    # -- the families --------------------------------------------------------------------------------------

    def reading(self) -> Reading:
        """The figures as they stand, copied on the event loop (tens of microseconds) for a thread to render."""
        copies: dict[tuple[str, int], int] = {}
        for name, route in self.table.deployments.items():
            for copy in route.copies:
                copies[(name, copy.number)] = copy.in_flight
        for copy in self.table.leaving.values():  # out of the routes, its last answers still going
            copies[(copy.deployment, copy.number)] = copies.get((copy.deployment, copy.number), 0) + copy.in_flight
        deployments = {name: (dict(f.requests), f.errors, list(f.duration), f.duration_sum, list(f.first), f.first_sum,
                              f.prompt_tokens, f.completion_tokens) for name, f in self.deployments.items()}
        return Reading(deployments, dict(self.refusals), dict(self.limits), copies, tuple(self.table.deployments))

    def collect(self):
        """This process's metric families (prometheus_client's collector protocol)."""
        return families(self.reading())

    # -- the scrape ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """With workers sharing a port: this process's figures written every second for the others' scrapes."""
        if self.config.directory and self.task is None:
            from deployments.gateway import metrics_files

            self.files = metrics_files.SharedFiles(Path(self.config.directory), os.getpid())
            self.task = asyncio.create_task(self._write_every())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            self.task = None
        if self.files is not None:  # the last figures: the counts go on adding up in the others' scrapes
            await asyncio.get_running_loop().run_in_executor(self.thread, self._write, self.reading())
            self.files.close()
        self.thread.shutdown(wait=False)

    async def _write_every(self) -> None:
        while True:
            await asyncio.sleep(WRITE_EVERY)
            try:
                await asyncio.get_running_loop().run_in_executor(self.thread, self._write, self.reading())
            except Exception:  # a full disk must not stop the loop: said, and tried again
                log.exception("The gateway could not write its metrics for the other workers")

    def _write(self, reading: Reading) -> None:
        self.files.write(families(reading))

    def _exposition(self, reading: Reading) -> bytes:
        """The text a scrape gets (in the metrics thread: building it takes milliseconds, not the loop's)."""
        if self.files is None:
            return generate_latest(_Families(families(reading)))
        self.files.write(families(reading))  # this process's own as they are now, then every worker's
        return self.files.exposition()

    def refusal(self, headers) -> tuple[int, str] | None:
        """Why a scrape is refused (status, words), or None when it may read."""
        if self.config.open:
            return None
        if not self.config.token:
            return 403, ("The gateway's metrics are off: set FADEN_METRICS_TOKEN (Prometheus sends it as a bearer "
                         "token), or FADEN_GATEWAY_METRICS_OPEN on a gateway only a private network reaches.")
        for name, value in headers:
            if name == b"authorization":
                scheme, _, secret = value.decode("latin-1").strip().partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(secret.strip().encode(), self.config.token.encode()):
                    return None
                break
        return 401, "The gateway's metrics need the metrics token: send Authorization: Bearer <FADEN_METRICS_TOKEN>."

    async def scrape(self, scope, send) -> None:
        """Answer ``/metrics``: the families in Prometheus's text format, to a scrape allowed to read them."""
        if scope["method"] not in ("GET", "HEAD"):
            await _error_answer(send, 405, "method_not_allowed", "/metrics takes GET.")
            return
        refused = self.refusal(scope["headers"])
        if refused is not None:
            await _error_answer(send, refused[0], "invalid_metrics_token" if refused[0] == 401 else "metrics_off",
                               refused[1])
            return
        body = await asyncio.get_running_loop().run_in_executor(self.thread, self._exposition, self.reading())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})


def _buckets(counts: list[int]) -> list[tuple[str, int]]:
    """Prometheus's cumulative buckets from the count in each."""
    total, found = 0, []
    for bound, count in zip((*BUCKETS, float("inf")), counts):
        total += count
        found.append((floatToGoString(bound), total))
    return found


class _Families:
    """Families already built, as a collector for ``generate_latest`` (no registry: nothing global, so each
    gateway of a test has its own figures)."""

    def __init__(self, built: list):
        self.built = built

    def collect(self):
        return self.built


async def _error_answer(send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="metrics"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

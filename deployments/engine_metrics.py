"""What each copy's engine says of itself: its ``/metrics`` (Prometheus' text format, vLLM's names), read at
every health check and kept as ``EngineSample`` rows for the deployment's charts (deployments/charts.py).

- ``metrics_parse``: a small parser that reads only the figures the charts draw and skips every other line
  (a histogram's hundreds of buckets, a name it does not know, a line it cannot read): requests running and
  waiting, KV-cache use, prefix-cache hits and queries, generation tokens. Each figure may go by more than one
  name across vLLM's versions (``vllm:kv_cache_usage_perc``, before it ``vllm:gpu_cache_usage_perc``; both
  are shown by the versions between): the first name found is taken, so that one figure is never counted
  twice. A figure shown once per engine (``engine="0"``, ``"1"`` with data parallelism) is added up, except
  the KV-cache use, a share of each engine's cache, whose mean is taken.
- ``metrics_read``: one GET of a copy's ``/metrics``, as the gateway calls it (the console's client
  certificate for a copy behind TLS, the copy's own key), with a short timeout.
- ``samples_take``: what the health check calls for the copies one machine says are healthy: each is read
  in turn within ``FADEN_ENGINE_METRICS_TIMEOUT`` seconds in all (a copy whose read fails, or that comes
  after the time ran out, has no sample this time: the check itself never fails for it), the samples are
  written, samples older than ``KEEP_MINUTES`` of those deployments go, and the deployments' pages are told.
"""
from __future__ import annotations

import http.client
import logging
import math
import ssl
import time
from dataclasses import dataclass, fields
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from console import live
from deployments.copy_keys import copy_key_of
from deployments.copy_tls import client_context
from deployments.models import EngineSample

log = logging.getLogger(__name__)

KEEP_MINUTES = 75  # the charts draw an hour; the samples before it give the first minute's rates
MAX_BYTES = 4 * 1024 * 1024  # an engine's /metrics is some hundred kilobytes; more is not read

# Each figure's names, the newest first; vLLM 0.10 shows the old and the new name side by side.
NAMES = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_cache": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "generation_tokens": ("vllm:generation_tokens_total",),
}
SHARES = {"kv_cache"}  # a share of each engine's own cache: the mean of the engines, not their sum
_WANTED = {name for names in NAMES.values() for name in names}


@dataclass(frozen=True)
class EngineFigures:
    """One engine's figures at one moment; None: it does not show that one."""

    running: float | None = None  # requests in its running batch
    waiting: float | None = None  # requests queued for a place in it
    kv_cache: float | None = None  # its KV cache in use, 0 to 1
    prefix_hits: float | None = None  # prompt tokens found in its prefix cache, since it started
    prefix_queries: float | None = None  # prompt tokens looked up there, since it started
    generation_tokens: float | None = None  # tokens it generated, since it started

    @property
    def empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))


def metrics_parse(text: str) -> EngineFigures:
    """The figures of an engine's ``/metrics`` text; lines it does not need or cannot read are skipped."""
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue  # comments, other programs' metrics, blank lines
        name, labels, rest = _split(line)
        if name not in _WANTED or labels is None:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isfinite(value):
            found.setdefault(name, []).append(value)
    figures = {}
    for figure, names in NAMES.items():
        values = next((found[name] for name in names if name in found), None)
        if values:
            figures[figure] = sum(values) / len(values) if figure in SHARES else sum(values)
    return EngineFigures(**figures)


def _split(line: str) -> tuple[str, str | None, str]:
    """A sample line's name, labels ("" without; None when their brace is not closed) and what follows
    (the value, and maybe a timestamp). A label's value may hold spaces and braces; the value never does."""
    brace, space = line.find("{"), line.find(" ")
    if brace == -1 or (space != -1 and space < brace):
        return (line, "", "") if space == -1 else (line[:space], "", line[space:])
    close = line.rfind("}")
    if close < brace:
        return line[:brace], None, ""
    return line[:brace], line[brace + 1:close], line[close + 1:]


class MetricsUnread(Exception):
    """The copy's /metrics could not be read; the message says why, in words."""


def metrics_read(copy, *, timeout: float, context: ssl.SSLContext | None = None) -> EngineFigures:
    """GET the copy's ``/metrics``: over TLS with ``context`` for a copy behind TLS, with its own key (vLLM
    leaves /metrics open, but a copy's engine is asked as the gateway asks it)."""
    if not copy.address or not copy.port:
        raise MetricsUnread("it has no address")
    if copy.tls and context is None:
        raise MetricsUnread("it serves behind TLS and the console's client certificate could not be loaded")
    if copy.tls:
        connection = http.client.HTTPSConnection(copy.address, copy.port, timeout=timeout, context=context)
    else:
        connection = http.client.HTTPConnection(copy.address, copy.port, timeout=timeout)
    headers = {"Accept": "text/plain"}
    if key := copy_key_of(copy.pk, copy.api_key_sealed):
        headers["Authorization"] = f"Bearer {key}"
    try:
        connection.request("GET", "/metrics", headers=headers)
        answer = connection.getresponse()
        body = answer.read(MAX_BYTES)
    except (OSError, http.client.HTTPException) as exc:  # refused, timed out, TLS refused, broken answer
        raise MetricsUnread(str(exc) or type(exc).__name__) from None
    finally:
        connection.close()
    if answer.status != 200:
        raise MetricsUnread(f"it answered {answer.status} {answer.reason}")
    figures = metrics_parse(body.decode("utf-8", "replace"))
    if figures.empty:
        raise MetricsUnread("its /metrics shows none of vLLM's figures")
    return figures


def samples_take(copies: list, *, now=None) -> int:
    """Read each copy's engine and write what it said; the number of samples written. Never raises: a check
    is about the copies' health, and its figures are a bonus."""
    if not copies:
        return 0
    try:
        return _samples_take(copies, now=now)
    except Exception:  # noqa: BLE001 - the check goes on without its figures
        log.exception("The engines' figures could not be taken")
        return 0


def _samples_take(copies: list, *, now=None) -> int:
    budget = settings.FADEN_ENGINE_METRICS_TIMEOUT
    if budget <= 0:
        return 0  # reading the engines is turned off
    deadline = time.monotonic() + budget
    context = _client_context() if any(c.tls for c in copies) else None
    samples = []
    for index, copy in enumerate(copies):
        left = deadline - time.monotonic()
        if left <= 0.05:
            log.info("No time left to read the engines of %s: read at the next check", ", ".join(map(str, copies[index:])))
            break
        try:
            figures = metrics_read(copy, timeout=left, context=context)
        except MetricsUnread as exc:
            log.info("%s: its engine's figures could not be read: %s", copy, exc)
            continue
        samples.append(EngineSample(deployment_id=copy.deployment_id, copy_pk=copy.pk, copy_number=copy.number,
                                    taken_at=now or timezone.now(), **{f.name: getattr(figures, f.name) for f in fields(figures)}))
    if not samples:
        return 0
    EngineSample.objects.bulk_create(samples)
    deployment_ids = {s.deployment_id for s in samples}
    samples_prune(deployment_ids, now=now)
    for pk in sorted(deployment_ids):
        live.push(f"deployment:{pk}", part="engine")
    return len(samples)


def samples_prune(deployment_ids, *, now=None) -> int:
    """Delete these deployments' samples older than KEEP_MINUTES (a deleted deployment's go with it)."""
    cutoff = (now or timezone.now()) - timedelta(minutes=KEEP_MINUTES)
    deleted, _ = EngineSample.objects.filter(deployment_id__in=list(deployment_ids), taken_at__lt=cutoff).delete()
    return deleted


def _client_context() -> ssl.SSLContext | None:
    try:
        return client_context().context
    except Exception as exc:  # noqa: BLE001 - the authority's files: the copies behind TLS go unread, said why
        log.warning("The console's client certificate could not be loaded to read the engines' figures: %s", exc)
        return None

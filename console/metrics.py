"""The console's ``GET /metrics``: its records counted at each scrape, in Prometheus's text format.

Nothing is counted as it happens: each app registers a collector (``metrics_register``, from its
``AppConfig.ready``, as it registers its dashboard panels) whose ``collect()`` reads the database with a
few aggregate queries when Prometheus asks, so the figures are the records' own and cost nothing between
scrapes. The console's own is the jobs by kind and state (``fadenstack_jobs``); machines, clusters and
deployments register theirs (docs/gateway.md, "Metrics", lists every family).

Who may read them: a scrape that sends ``Authorization: Bearer <FADEN_METRICS_TOKEN>`` (Prometheus), or a
signed-in Administrator (a person looking). The gateway's /metrics takes the same token.
"""
from __future__ import annotations

import hmac

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.db.models import Count
from django.http import HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from console import roles

# Prometheus's text format as every Prometheus reads it (the names are plain: version 1.0.0's escapes are not needed).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
READ_METRICS = roles.Action("reading the console's metrics", roles.ADMINISTRATOR)

_collectors: dict[str, object] = {}


def metrics_register(name: str, collector) -> None:
    """Add ``collector`` (prometheus_client's protocol: ``collect()`` yields metric families) to the console's
    /metrics; call it from the app's ``AppConfig.ready``. Registering a name again replaces it."""
    _collectors[name] = collector


def counts_by(queryset, *fields: str) -> dict[tuple, int]:
    """Rows of ``queryset`` counted by ``fields``, in one GROUP BY query (the model's ordering left out of it)."""
    return {tuple(row[:-1]): row[-1] for row in queryset.order_by().values_list(*fields).annotate(count=Count("pk"))}


def gauge_by_state(name: str, documentation: str, counts: dict[tuple, int], states) -> GaugeMetricFamily:
    """A gauge labelled ``state``: every state of ``states`` (a TextChoices), none missing when nothing is in it."""
    family = GaugeMetricFamily(name, documentation, labels=["state"])
    for state in states:
        family.add_metric([state.value], counts.get((state.value,), 0))
    return family


class JobsCollector:
    """The jobs the console keeps (pruned after FADEN_KEEP_JOBS_DAYS), by kind and state: one query."""

    def collect(self):
        family = GaugeMetricFamily("fadenstack_jobs", "Jobs the console keeps, by kind and state (queued and running: "
                                   "at work now).", labels=["kind", "state"])
        from console.models import Job

        for (kind, state), count in sorted(counts_by(Job.objects.all(), "kind", "state").items()):
            family.add_metric([kind, state], count)
        yield family


def scrape_refusal(request) -> HttpResponse | None:
    """Why this request may not read the metrics (the answer that says so), or None when it may."""
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, secret = header.strip().partition(" ")
        token = settings.FADEN_METRICS_TOKEN
        if token and scheme.lower() == "bearer" and hmac.compare_digest(secret.strip().encode(), token.encode()):
            return None
        return _refused(401, "The console's metrics need the metrics token: send Authorization: Bearer "
                             "<FADEN_METRICS_TOKEN>." if token else
                             "The console's metrics take a token only once FADEN_METRICS_TOKEN is set on the console.")
    if request.user.is_authenticated:
        offer = READ_METRICS.offer(roles.role_of(request.user))
        return None if offer.ok else _refused(403, offer.why)
    return _refused(401, "The console's metrics need the metrics token (Authorization: Bearer <FADEN_METRICS_TOKEN>) "
                         "or an Administrator signed in.")


def _refused(status: int, words: str) -> HttpResponse:
    response = HttpResponse(words + "\n", status=status, content_type="text/plain; charset=utf-8")
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


@login_not_required  # Prometheus signs in with the token, not a session
@require_safe
def metrics(request):
    """Every registered collector's families, read now."""
    refused = scrape_refusal(request)
    if refused is not None:
        return refused
    registry = CollectorRegistry(auto_describe=False)
    for _, collector in sorted(_collectors.items()):
        registry.register(collector)
    response = HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE)
    response["Cache-Control"] = "no-store"
    return response

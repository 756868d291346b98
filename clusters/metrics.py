"""The clusters on the console's /metrics (console/metrics.py), counted at the scrape: the clusters in each
state, and the health checks of the last hour by outcome (``repair``: a check that repaired something)."""
from datetime import timedelta

from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from clusters.choices import CheckOutcome, ClusterState
from console.metrics import counts_by, gauge_by_state

CHECKS_WINDOW = timedelta(hours=1)


class ClustersCollector:
    """``fadenstack_clusters{state}`` and ``fadenstack_health_checks_last_hour{outcome}``: two queries."""

    def collect(self):
        from clusters.models import Cluster, HealthCheck

        yield gauge_by_state("fadenstack_clusters", "Clusters, by state.", counts_by(Cluster.objects.all(), "state"),
                             ClusterState)
        checks = counts_by(HealthCheck.objects.filter(started_at__gte=timezone.now() - CHECKS_WINDOW), "outcome")
        family = GaugeMetricFamily("fadenstack_health_checks_last_hour", "Health checks of running clusters started in "
                                   "the last hour, by outcome (repair: it repaired something).", labels=["outcome"])
        for outcome in CheckOutcome:
            family.add_metric([outcome.value], checks.get((outcome.value,), 0))
        yield family

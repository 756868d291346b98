"""Old health checks go (console.pruning runs it every hour, keeping FADEN_KEEP_CHECKS_DAYS)."""
from datetime import datetime

from clusters.models import HealthCheck
from console.pruning import delete_in_batches


def health_checks_prune(older_than: datetime) -> int:
    """Delete the health checks started before ``older_than``; a cluster's newer checks stay, and
    a second look whose first look went keeps its own record (first_look is set to null)."""
    return delete_in_batches(HealthCheck.objects.filter(started_at__lt=older_than))

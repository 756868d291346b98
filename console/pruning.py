"""Old records go: each app registers what it prunes, one beat task runs every pruner.

A pruner is ``fn(older_than) -> rows deleted``; it is registered with the setting
that says how many days its rows are kept (0 keeps them for ever). Apps register
theirs in ``AppConfig.ready``, so that the console imports nothing from the apps
built on it (clusters -> machines -> console).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

log = logging.getLogger(__name__)

Pruner = Callable[[datetime], int]
BATCH = 2000  # rows per DELETE: each is a short transaction, so pages and heartbeats are not held up


@dataclass(frozen=True)
class _Registered:
    fn: Pruner
    keep_days_setting: str


_pruners: dict[str, _Registered] = {}


def register_pruner(name: str, fn: Pruner, *, keep_days_setting: str) -> None:
    """Prune ``name`` with ``fn`` on every run, keeping the days the setting ``keep_days_setting`` says."""
    _pruners[name] = _Registered(fn, keep_days_setting)


def delete_in_batches(rows: QuerySet) -> int:
    """Delete ``rows`` a batch at a time; how many went."""
    deleted = 0
    while ids := list(rows.order_by().values_list("pk", flat=True)[:BATCH]):
        rows.model.objects.filter(pk__in=ids).delete()
        deleted += len(ids)
    return deleted


def old_records_prune(*, now: datetime | None = None) -> dict[str, int]:
    """Run every registered pruner with the age its setting gives; rows deleted per pruner.

    One pruner that fails does not stop the others (its error is logged)."""
    now = now or timezone.now()
    deleted = {}
    for name, registered in _pruners.items():
        days = getattr(settings, registered.keep_days_setting)
        if not days:
            continue
        try:
            deleted[name] = registered.fn(now - timedelta(days=days))
        except Exception:  # noqa: BLE001 - the next run tries again
            log.exception("could not prune %s", name)
    return deleted


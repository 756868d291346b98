"""Deployments on the console's /metrics (console/metrics.py), counted at the scrape: the copies of each
deployment by state, and the GPUs of every machine by kind and what holds them.

A GPU counts as ``held`` for the share copies hold of it (a copy holding a quarter: 0.25; a queued copy
with a place holds it too, as placement counts), ``other`` for the rest when a process the console did not
start uses it (placement takes such a GPU whole), and the rest as ``free`` on a healthy machine or
``unavailable`` on one that is not (offline, failed, being enrolled). The four add up to every GPU.
"""
from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

from prometheus_client.core import GaugeMetricFamily

from console.metrics import counts_by
from deployments.choices import CopyState
from deployments.placement_input import HOLDS, gpu_kind
from machines.choices import MachineState

GPU_STATUSES = ("held", "other", "free", "unavailable")


class CopiesCollector:
    """``fadenstack_copies{deployment, state}``: every state of every deployment, two queries."""

    def collect(self):
        from deployments.models import Copy, Deployment

        counts = counts_by(Copy.objects.all(), "deployment__name", "state")
        family = GaugeMetricFamily("fadenstack_copies", "Copies of each deployment, by state.",
                                   labels=["deployment", "state"])
        for name in Deployment.objects.order_by("name").values_list("name", flat=True):
            for state in CopyState:
                family.add_metric([name, state.value], counts.get((name, state.value), 0))
        yield family


class GpusCollector:
    """``fadenstack_gpus{kind, status}``: two queries (the GPUs with their machine's state, the copies holding room)."""

    def collect(self):
        from deployments.models import Copy
        from machines.models import Accelerator

        share: dict[tuple[int, int], Fraction] = defaultdict(Fraction)
        for slots in Copy.objects.filter(HOLDS).values_list("slots", flat=True):
            for slot in slots:
                for index in slot["gpus"]:
                    share[(slot["machine"], index)] += Fraction(slot.get("quarters", 4), 4)
        totals: dict[str, dict[str, Fraction]] = defaultdict(lambda: dict.fromkeys(GPU_STATUSES, Fraction(0)))
        for machine_id, index, vendor, model, memory_mib, foreign, state in Accelerator.objects.values_list(
                "machine_id", "index", "vendor", "model", "memory_mib", "foreign_pids", "machine__state"):
            kind = totals[gpu_kind(vendor, model, memory_mib).label]
            held = min(share.get((machine_id, index), Fraction(0)), Fraction(1))
            kind["held"] += held
            rest = "other" if foreign else "free" if state == MachineState.HEALTHY else "unavailable"
            kind[rest] += 1 - held
        family = GaugeMetricFamily("fadenstack_gpus", "GPUs by kind and what holds them: held by copies (a share as "
                                   "its part), other (a process the console did not start), free, unavailable (its "
                                   "machine is not healthy).", labels=["kind", "status"])
        for kind, statuses in sorted(totals.items()):
            for status in GPU_STATUSES:
                family.add_metric([kind, status], float(statuses[status]))
        yield family

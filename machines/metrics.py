"""The machines on the console's /metrics (console/metrics.py): how many are in each state, counted at the scrape."""
from console.metrics import counts_by, gauge_by_state
from machines.choices import MachineState


class MachinesCollector:
    """``fadenstack_machines{state}``: one query."""

    def collect(self):
        from machines.models import Machine

        yield gauge_by_state("fadenstack_machines", "Machines the console knows, by state.",
                             counts_by(Machine.objects.all(), "state"), MachineState)

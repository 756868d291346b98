"""Which actions a cluster, or a machine in it, allows now, and when not, the sentence that says why.

The services refuse with these sentences, the page greys its buttons out with
them, and the API answers with them: a refusal is written once.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.core.exceptions import ValidationError

from clusters.choices import CAN_RETRY, CAN_START, CAN_STOP, CHECKED, ClusterState, MemberState, Role
from clusters.models import Cluster, ClusterMember
from clusters.steps import CANCELLABLE_KINDS
from console.models import Job

DEPLOY_LATER = "Models are deployed from Deployments, which is not available yet."
DRAIN_LATER = "Draining comes with deployments."


@dataclass(frozen=True)
class Offer:
    """A button's state: allowed, or not with the reason."""

    ok: bool
    why: str = ""

    def check(self) -> None:
        """Refuse (a ValidationError with the reason) unless allowed."""
        if not self.ok:
            raise ValidationError(self.why)


def busy_refusal(cluster: Cluster, busy: Job, what: str) -> str:
    return f"{cluster.name} is busy: {busy.title} is {busy.get_state_display().lower()}. {what} once it has finished."


def _offer(cluster: Cluster, allowed: bool, why: str, *, busy: Job | None, what: str) -> Offer:
    if not allowed:
        return Offer(False, why)
    if busy is not None:
        return Offer(False, busy_refusal(cluster, busy, what))
    return Offer(True)


def cluster_actions(cluster: Cluster, busy: Job | None) -> dict[str, Offer]:
    """Every action of the cluster's page, allowed or refused, given the operation under way (``busy``)."""
    name, state, label = cluster.name, cluster.state, cluster.get_state_display()
    # Stop and Delete win over a start or a repair under way (it is asked to end); not over a stop.
    cancellable = busy is not None and busy.kind in CANCELLABLE_KINDS
    stop_busy = None if cancellable else busy
    settling = state in (ClusterState.STOPPING, ClusterState.DELETING)
    return {
        # A check only reads: it runs beside an operation (and says it skipped when one is under way).
        "check": _offer(cluster, state in CHECKED, f"{name} is {label}: checks look at a running cluster.", busy=None, what=""),
        "stop": _offer(cluster, state in CAN_STOP, f"{name} is {label}: there is nothing to stop.", busy=stop_busy, what="Stop it"),
        "start": _offer(cluster, state in CAN_START, f"{name} is {label}: Start is for a stopped cluster.", busy=busy, what="Start it"),
        "retry": _offer(cluster, state in CAN_RETRY, f"{name} is {label}: there is nothing to try again.", busy=busy, what="Start it"),
        "add": _offer(cluster, state == ClusterState.RUNNING, f"Machines join a running cluster; {name} is {label}.",
                      busy=busy, what="Add machines"),
        "delete": _offer(cluster, state != ClusterState.DELETING, f"{name} is already being deleted.", busy=stop_busy, what="Delete it"),
        "switch": _offer(cluster, not settling, f"{name} is {label}.", busy=busy, what="Switch the runtime"),
        "network": _offer(cluster, not settling, f"{name} is {label}.", busy=busy, what="Change the network"),
        "deploy": Offer(False, DEPLOY_LATER),
    }


def member_remove(cluster: Cluster, member: ClusterMember, *, count: int, busy: Job | None) -> Offer:
    """Remove from cluster: on a stopped cluster any machine leaves the record (the head too); on a
    running one only a machine that did not join, since it serves nothing. Others leave by a drain."""
    name = member.machine.name
    if cluster.state != ClusterState.STOPPED:
        if member.role == Role.HEAD:
            return Offer(False, f"{name} leads {cluster.name}: to take out the head, stop the cluster first.")
        if member.state != MemberState.FAILED:
            return Offer(False, f"{cluster.name} is {cluster.get_state_display()}: a machine leaves a running cluster by a drain, "
                                f"which comes with deployments. Stop the cluster to take {name} out of its record now.")
    if count == 1:
        return Offer(False, f"{name} is the only machine of {cluster.name}: delete the cluster instead.")
    return _offer(cluster, True, "", busy=busy, what="Remove it")


def page_flags(cluster: Cluster) -> dict[str, bool]:
    """Which of the page's alternating buttons show: Start or Stop, Try again, Check now."""
    return {
        "show_start": cluster.state in CAN_START,
        "show_retry": cluster.state in CAN_RETRY,
        "show_check": cluster.state in CHECKED,
        "stop_again": cluster.state == ClusterState.UNCONFIRMED,
    }

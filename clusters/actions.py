"""Which actions a cluster, or a machine in it, allows now, and when not, the sentence that says why.

Two things decide: the user's role (every action on a cluster needs an Operator) and the cluster's
state. The services refuse with these sentences, the page greys its buttons out with them, and
the API answers with them: a refusal is written once.
"""
from __future__ import annotations

from clusters import hooks
from clusters.choices import CAN_RETRY, CAN_START, CAN_STOP, CHECKED, ClusterState, MemberState, Role
from clusters.models import Cluster, ClusterMember
from clusters.steps import CANCELLABLE_KINDS
from console import roles
from console.models import Job
from console.offers import ALLOWED, Offer
from console.roles import ADMINISTRATOR, OPERATOR, Action

# Who may do each action, and how a refusal names it.
CREATE = Action("creating a cluster", OPERATOR)
TEST_NETWORKS = Action("testing networks between machines", OPERATOR)
CHECK = Action("checking a cluster now", OPERATOR)  # a check repairs what it finds
STOP = Action("stopping a cluster", OPERATOR)
START = Action("starting a cluster", OPERATOR)
RETRY = Action("trying a cluster's start again", OPERATOR)
ADD = Action("adding machines to a cluster", OPERATOR)
DELETE = Action("deleting a cluster", OPERATOR)
SWITCH = Action("switching a cluster's runtime", OPERATOR)
NETWORK = Action("changing a cluster's network", OPERATOR)
# Deploying is offered on the cluster's page and done by deployments (which import both from here): the
# action and its rule are written once.
DEPLOY = Action("deploying models", OPERATOR)
# Engine options that run code or read files on the machines (deployments/engine.py ADMINISTRATOR_OPTIONS).
DECIDE_ENGINE_OPTIONS = Action("giving engine options that run code or read files on the machines", ADMINISTRATOR)
DEPLOYS_ON = frozenset({ClusterState.RUNNING})  # the states of a cluster models are deployed on
REMOVE = Action("removing a machine from a cluster", OPERATOR)


def busy_refusal(cluster: Cluster, busy: Job, what: str) -> str:
    return f"{cluster.name} is busy: {busy.title} is {busy.get_state_display().lower()}. {what} once it has finished."


def _offer(cluster: Cluster, action: Action, role: roles.Role | None, allowed: bool, why: str, *, busy: Job | None,
           what: str) -> Offer:
    """The role first (a Viewer reads the same sentence whatever the cluster's state), then the state,
    then the operation under way."""
    permitted = action.offer(role)
    if not permitted.ok:
        return permitted
    if not allowed:
        return Offer(False, why)
    if busy is not None:
        return Offer(False, busy_refusal(cluster, busy, what))
    return ALLOWED


def _unless(refusal: str | None) -> Offer:
    """Allowed when nothing refuses; else refused with the sentence (the state's, not the role's: a 400)."""
    return ALLOWED if refusal is None else Offer(False, refusal)


def cluster_actions(cluster: Cluster, busy: Job | None, *, role: roles.Role | None) -> dict[str, Offer]:
    """Every action of the cluster's page for ``role``, allowed or refused, given the operation under way (``busy``)."""
    name, state, label = cluster.name, cluster.state, cluster.get_state_display()
    # Stop and Delete win over a start or a repair under way (it is asked to end); not over a stop.
    cancellable = busy is not None and busy.kind in CANCELLABLE_KINDS
    stop_busy = None if cancellable else busy
    settling = state in (ClusterState.STOPPING, ClusterState.DELETING)
    return {
        # A check only reads: it runs beside an operation (and says it skipped when one is under way).
        "check": _offer(cluster, CHECK, role, state in CHECKED, f"{name} is {label}: checks look at a running cluster.",
                        busy=None, what=""),
        "stop": _offer(cluster, STOP, role, state in CAN_STOP, f"{name} is {label}: there is nothing to stop.",
                       busy=stop_busy, what="Stop it"),
        "start": _offer(cluster, START, role, state in CAN_START, f"{name} is {label}: Start is for a stopped cluster.",
                        busy=busy, what="Start it"),
        "retry": _offer(cluster, RETRY, role, state in CAN_RETRY, f"{name} is {label}: there is nothing to try again.",
                        busy=busy, what="Start it"),
        "add": _offer(cluster, ADD, role, state == ClusterState.RUNNING, f"Machines join a running cluster; {name} is {label}.",
                      busy=busy, what="Add machines"),
        "delete": _offer(cluster, DELETE, role, state != ClusterState.DELETING, f"{name} is already being deleted.",
                         busy=stop_busy, what="Delete it").then(_unless(hooks.delete_refusal(cluster))),
        "switch": _offer(cluster, SWITCH, role, not settling, f"{name} is {label}.", busy=busy, what="Switch the runtime"),
        "network": _offer(cluster, NETWORK, role, not settling, f"{name} is {label}.", busy=busy, what="Change the network"),
        "deploy": DEPLOY.offer(role).then(_unless(deploy_refusal(cluster))),
    }


def deploy_refusal(cluster: Cluster) -> str | None:
    """Why models cannot be deployed on the cluster now (it is not running); None when they can."""
    if cluster.state in DEPLOYS_ON:
        return None
    return f"{cluster.name} is {cluster.get_state_display().lower()}: models are deployed on a running cluster."


def member_remove(cluster: Cluster, member: ClusterMember, *, count: int, busy: Job | None, role: roles.Role | None,
                  drained: bool = False) -> Offer:
    """Remove from cluster: on a stopped cluster any machine leaves the record (the head too); on a
    running one only a machine that did not join, since it serves nothing, or one a drain emptied
    (``drained``: the drain of Remove from cluster, in deployments). Others leave by that drain."""
    name = member.machine.name
    refusal = ""
    if cluster.state != ClusterState.STOPPED and member.role == Role.HEAD:
        refusal = f"{name} leads {cluster.name}: to take out the head, stop the cluster first."
    elif cluster.state != ClusterState.STOPPED and member.state != MemberState.FAILED and not drained:
        refusal = (f"{cluster.name} is {cluster.get_state_display()}: a machine that joined leaves a running cluster by "
                   f"a drain first. Remove from cluster shows {name}'s drain plan before anything moves.")
    elif count == 1:
        refusal = f"{name} is the only machine of {cluster.name}: delete the cluster instead."
    return _offer(cluster, REMOVE, role, not refusal, refusal, busy=busy, what="Remove it")


# The drain's refusals in the product's words, here and in deployments' drain (its plan card and its start).
HEAD_DRAIN = "{name} leads {cluster}: the cluster cannot run without it. Stop the cluster instead, or drain the other machines."
NOT_RUNNING_DRAIN = "{cluster} is {state}: nothing runs on its machines, so there is nothing to drain."


def member_drain(cluster: Cluster, member: ClusterMember) -> Offer:
    """Drain, and Remove from cluster on a running cluster: both open the drain plan (deployments), which checks
    the role, the agents and what runs; here, what the cluster's state already says."""
    name = member.machine.name
    if cluster.state != ClusterState.RUNNING:
        return Offer(False, NOT_RUNNING_DRAIN.format(cluster=cluster.name, state=cluster.get_state_display().lower()))
    if member.role == Role.HEAD:
        return Offer(False, HEAD_DRAIN.format(name=name, cluster=cluster.name))
    if member.state != MemberState.JOINED:
        return Offer(False, f"{name} is not up in {cluster.name} ({member.get_state_display().lower()}): "
                            "nothing runs on it to drain.")
    return ALLOWED


def page_flags(cluster: Cluster) -> dict[str, bool]:
    """Which of the page's alternating buttons show: Start or Stop, Try again, Check now."""
    return {
        "show_start": cluster.state in CAN_START,
        "show_retry": cluster.state in CAN_RETRY,
        "show_check": cluster.state in CHECKED,
        "stop_again": cluster.state == ClusterState.UNCONFIRMED,
    }

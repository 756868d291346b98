"""How a cluster and its members change state: the one guard for each, the row lock, and the
live topics a change is pushed to.

A cluster's state changes through ``cluster_transition``, a member's through
``member_transition``; both check the tables in choices.py. Workers of a start
hold member objects that may be older than the database, so the member guard
checks the state the database holds, in the same UPDATE that changes it.
"""
from __future__ import annotations

from collections.abc import Iterable

from django.db.models import QuerySet
from django.utils import timezone

from clusters import hooks
from clusters.choices import CLUSTER_TRANSITIONS, MEMBER_TRANSITIONS, MemberState
from clusters.models import Cluster, ClusterMember
from console import live
from console.lifecycle import InvalidTransition, sources_of, transition

__all__ = ["InvalidTransition", "cluster_changed", "cluster_locked", "cluster_transition", "member_transition",
           "members_transition"]


def cluster_changed(cluster: Cluster | int, part: str = "") -> None:
    """Push the cluster's page (or one part of it: members, job, checks) and its row of the list."""
    pk = cluster if isinstance(cluster, int) else cluster.pk
    live.push(f"cluster:{pk}", part=part)
    live.push("clusters", part=str(pk))


def cluster_locked(cluster: Cluster) -> Cluster:
    """The cluster's row, locked until the transaction ends, so that two requests cannot both act on it.
    FOR NO KEY UPDATE, as every lock of ours: it keeps out the other lockers but not a row that only refers
    to this one (a health check, a job) being written meanwhile, whose key check would otherwise wait for
    this transaction while it waits for that one (a deadlock PostgreSQL ends by failing one of them)."""
    return Cluster.objects.select_for_update(no_key=True).get(pk=cluster.pk)


def cluster_transition(*, cluster: Cluster, to: str, reason: str = "") -> bool:
    """The one way a cluster changes state: checked against the table, saved, pushed."""
    return transition(cluster, to=to, allowed=CLUSTER_TRANSITIONS, reason=reason, on_change=lambda: cluster_changed(cluster))


def members_transition(members: QuerySet[ClusterMember] | Iterable[int], *, to: str, reason: str = "",
                       only_from: Iterable[str] | None = None, push: bool = True, **fields) -> int:
    """Move members to ``to`` (with ``fields`` written alongside), each checked against the table in the
    same UPDATE. ``only_from`` narrows who moves (the others are left as they are, not refused). A member
    the table does not let go there raises InvalidTransition; nothing is written then."""
    rows = members if isinstance(members, QuerySet) else ClusterMember.objects.filter(pk__in=list(members))
    if only_from is not None:
        rows = rows.filter(state__in=list(only_from))
    refused = rows.exclude(state__in=sources_of(MEMBER_TRANSITIONS, to)).values_list("machine__name", "state").first()
    if refused:
        name, state = refused
        raise InvalidTransition(f"{name} cannot go from {MemberState(state).label} to {MemberState(to).label}.")
    # The state filter is in the UPDATE itself: a state the table forbids is never written.
    allowed = rows.filter(state__in=sources_of(MEMBER_TRANSITIONS, to))
    joining = list(allowed.exclude(state=to).values_list("cluster_id", "machine_id")) if to == MemberState.JOINED else []
    changed = allowed.exclude(state=to).update(state_changed_at=timezone.now())
    allowed.update(state=to, state_reason=reason, **fields)
    if push:  # a start's ProgressBoard pushes on its own tick instead
        for cluster_id in set(allowed.values_list("cluster_id", flat=True)):
            cluster_changed(cluster_id, part="members")
    for cluster_id in {cluster_id for cluster_id, _ in joining}:  # room for copies, say
        hooks.members_joined.send(sender=Cluster, cluster_id=cluster_id,
                                  machine_ids=[machine_id for c, machine_id in joining if c == cluster_id])
    return changed


def member_transition(member: ClusterMember, *, to: str, reason: str = "", **fields) -> None:
    """The one way a member changes state. The object is updated too, for the caller that holds it."""
    members_transition(ClusterMember.objects.filter(pk=member.pk), to=to, reason=reason, **fields)
    member.state, member.state_reason = to, reason
    for name, value in fields.items():
        setattr(member, name, value)

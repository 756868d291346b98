"""The certificates' steps: "Issue certificates" in a start, a join and a repair (before Ray starts, so that
it starts with them), and the Renew certificates job (the button, and the hourly beat before they expire).
What is issued and how: clusters/certificates.py."""
from __future__ import annotations

from django.utils import timezone

from clusters import certificates, steps
from clusters.choices import MemberState
from clusters.fanout import ProgressBoard, parallel
from clusters.lifecycle import cluster_changed
from clusters.models import Cluster, ClusterMember
from console import live
from console.jobs import JobContext, JobError
from machines.choices import MachineState


def certificates_issue(ctx: JobContext, cluster: Cluster, members: list[ClusterMember], head: ClusterMember,
                       board: ProgressBoard, *, tolerate_all: bool = False) -> list[ClusterMember]:
    """The step in START, ADD and REJOIN: each member's certificates, new, before Ray starts with them. A
    cluster without encryption needs none (the step says so). The members still in afterwards."""
    roles = certificates.roles_of(cluster)
    if not roles:
        steps.ISSUE_CERTIFICATES.begin(ctx, "none: this cluster is not encrypted")
        return members
    if not steps.ISSUE_CERTIFICATES.begin(ctx, f"{certificates.roles_words(roles)} for {len(members)} machine(s)"):
        return members
    kept = parallel(members, head, board,
                    lambda m, b: certificates.member_issue(m, roles=roles, ray_starts=True), tolerate_all=tolerate_all)
    live.push(f"cluster:{cluster.pk}", part="encryption")
    return kept


def cluster_renew_run(ctx: JobContext, *, cluster_id: int) -> None:
    """Renew certificates: a new key and certificate on every machine that is up, while everything runs.
    Ray's servers keep the certificate they started with until their next start (Ray reads its files at
    start); Ray processes started from now on, and machines that join, use the new one. A machine that
    cannot be reached keeps its certificate, and the job says which."""
    cluster = Cluster.objects.get(pk=cluster_id)
    roles = certificates.roles_of(cluster)
    members = list(cluster.members.select_related("machine", "cluster"))
    up = [m for m in members if m.machine.state == MachineState.HEALTHY and m.state != MemberState.PENDING]
    if not steps.RENEW_CERTIFICATES.begin(ctx, f"{certificates.roles_words(roles)} for {len(up)} machine(s)"):
        return
    if not roles:
        ctx.detail("none: this cluster is not encrypted")
        return
    failed: dict[int, str] = {}
    head = next((m for m in members if m.role == "head"), up[0] if up else None)
    if up:
        with ProgressBoard(cluster) as board:
            parallel(up, head, board, lambda m, b: certificates.member_issue(m, roles=roles, ray_starts=False),
                     tolerate_all=True, fail_state=None, failed=failed)
    cluster_changed(cluster)
    live.push(f"cluster:{cluster.pk}", part="encryption")
    left = [m.machine.name for m in members if m not in up or m.pk in failed]
    until = certificates.expiry(cluster)["not_after"]
    ctx.detail(f"{len(up) - len(failed)} of {len(members)} machine(s) renewed"
               + (f"; valid until {timezone.localtime(until):%Y-%m-%d %H:%M}" if until else ""))
    if left:
        reasons = " ".join(failed.values())
        raise JobError(f"Not renewed on {', '.join(left)}: {reasons or 'not up'}. They keep their certificates; "
                       f"renew again once they are back.")

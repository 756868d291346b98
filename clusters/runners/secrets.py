"""The cluster's secrets on its machines (agent ``cluster secrets write|remove``): Ray's token
(clusters/ray_token.py), delivered before Ray starts or joins, taken away when the cluster is deleted.
"""
from __future__ import annotations

from collections.abc import Sequence

from clusters import steps
from clusters.fanout import ProgressBoard, missed_by, on_member
from clusters.models import Cluster, ClusterMember
from clusters.ray_token import TOKEN_AGENT, ray_token, takes_token
from console.choices import ErrorKind
from console.jobs import JobContext, JobError
from machines.models import Machine


def check_token_agents(members: Sequence[ClusterMember]) -> None:
    """Every member must hold Ray's token before Ray starts there: an older agent cannot, and the
    cluster's Ray refuses a node without it. Names the machines to update."""
    old = sorted(f"{m.machine.name} ({m.machine.agent_version or 'unknown'})" for m in members
                 if not takes_token(m.machine))
    if old:
        one = len(old) == 1
        raise JobError(f"Ray's token needs agent {TOKEN_AGENT} or newer; {', '.join(old)} "
                       f"{'runs an older one' if one else 'run older ones'}: select Update agent on "
                       f"{'its page' if one else 'their pages'}, then Try again.", kind=ErrorKind.NOT_RETRYABLE)


def secrets_deliver(cluster: Cluster):
    """The work of the step DELIVER_SECRETS for ``fanout.parallel``: the token, read once here (the
    workers' threads only send it), written on one member."""
    token = ray_token(cluster)

    def deliver(member: ClusterMember, board: ProgressBoard) -> None:
        on_member(member, lambda agent: agent.cluster_secrets_write(cluster=cluster.name, ray_token=token))

    return deliver


def secrets_remove(ctx: JobContext, *, cluster: str, machines: Sequence[Machine]) -> list[str]:
    """The step REMOVE_SECRETS: the cluster's secrets go from its machines. It never fails: a machine that
    is offline or refuses keeps them, and the job's log says which and how to remove them by hand."""
    steps.REMOVE_SECRETS.always(ctx, ", ".join(m.name for m in machines))
    had = [m for m in machines if m.agent_path and takes_token(m)]
    left = [f"{machine.name} kept the secrets of {cluster} ({why}): to remove them, run "
            f"{machine.python_path or 'python3'} {machine.agent_path} cluster secrets remove --cluster {cluster} "
            "on it as root."
            for machine, why in missed_by(had, lambda agent: agent.cluster_secrets_remove(cluster=cluster))]
    for sentence in left:
        ctx.log(sentence)
    ctx.detail(f"Removed from {len(had) - len(left)} of {len(had)} machine(s)")
    return left

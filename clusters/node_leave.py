"""A machine that leaves a cluster keeps nothing of it (docs/connection.md, "A machine that leaves").

Remove from cluster takes the member out of the record at once (services.cluster_member_remove), records
what the machine still holds (``NodeSettingsOwed``) and starts the job LEAVE on the cluster:

1. *Clear the machine that left*: its /shared mount (or the head's export) goes first (sshfs logs in with the
   cluster's key), then its node settings (``node files remove``: the cluster's SSH key, the authorized key,
   root's principals, sshd's trust, the revocation list, the hostfile). A machine that is offline or does not
   answer keeps the record of what it owes, and its next contact (its heartbeat after being Offline) takes
   them away (``owed_settle``); a machine that joined another cluster meanwhile owes nothing (its settings
   are that cluster's).
2. *Rotate the node key*: a new one, written on every member left that answers (a stopped cluster's too),
   so the copy the machine may keep opens nothing; a member that does not answer gets it at the next start
   or join, as every write does.
3. *Share /shared* again on a running cluster: the NFS export names the members left only.
"""
from __future__ import annotations

from django.db import transaction

from clusters import steps
from clusters.choices import ClusterState
from clusters.firewall import FIREWALL_AGENT
from clusters.models import Cluster, NodeSettingsOwed
from clusters.node_files import node_key_rotate
from clusters.runners.nodes import NODE_FILES_AGENT, node_settings_write
from clusters.runners.shared import SHARED_AGENT, shared_files_share
from console.jobs import JobContext
from machines.agent_client import Agent, AgentError
from machines.choices import MachineState
from machines.models import Machine
from machines.versions import agent_outdated


def clear_machine(machine: Machine, *, cluster_name: str = "", shared: bool = True) -> str:
    """Take a cluster's /shared mount and node settings off ``machine``, and with agent 0.10.0 its firewall
    table and its secrets directory (Ray's token, its TLS keys and certificates): "" when done, else why
    not, in words."""
    if machine.state == MachineState.OFFLINE:
        return "it is offline"
    if not machine.agent_path or agent_outdated(machine.agent_version, NODE_FILES_AGENT):
        return ""  # an agent that never wrote node settings holds none
    try:
        with Agent.open(machine) as agent:
            if shared and not agent_outdated(machine.agent_version, SHARED_AGENT):
                agent.shared_unmount()
            agent.node_files_remove()
            if cluster_name and not agent_outdated(machine.agent_version, FIREWALL_AGENT):
                agent.firewall_remove(cluster=cluster_name)  # its table would refuse another cluster's members
                agent.cluster_secrets_remove(cluster=cluster_name)
    except AgentError as exc:
        return exc.message.rstrip(".")
    return ""


def _settle(machine: Machine, owed: NodeSettingsOwed) -> str:
    why = clear_machine(machine, cluster_name=owed.cluster_name, shared=owed.shared)
    if why:
        NodeSettingsOwed.objects.filter(pk=owed.pk).update(attempts=owed.attempts + 1, last_error=why[:2000])
    else:
        NodeSettingsOwed.objects.filter(pk=owed.pk).delete()
    return why


def cluster_leave_run(ctx: JobContext, *, cluster_id: int) -> None:
    cluster = Cluster.objects.get(pk=cluster_id)
    machine = Machine.objects.filter(pk=ctx.job.params.get("machine_id")).first()
    name = ctx.job.params.get("machine_name", "the machine")
    if steps.CLEAR_LEFT.begin(ctx, name):
        owed = NodeSettingsOwed.objects.filter(machine=machine).first() if machine else None
        if owed is None:
            ctx.detail(f"{name}: nothing left to take away")
        elif why := _settle(machine, owed):
            ctx.log(f"{name} still holds {cluster.name}'s node settings ({why}): they are taken away at its next "
                    "contact, and the node key changes now, so its copy opens nothing.")
            ctx.detail(f"{name}: at its next contact ({why})")
        else:
            ctx.detail(f"{name}: its node settings and /shared are gone")
    if not cluster.members.exists():
        return
    if steps.ROTATE_KEY.begin(ctx):
        node_key_rotate(cluster=cluster)
    node_settings_write(ctx, cluster, step=steps.ROTATE_KEY, stopped_too=cluster.state == ClusterState.STOPPED)
    if cluster.state == ClusterState.RUNNING:
        shared_files_share(ctx, cluster, keep_method=True)
    else:
        ctx.skip(steps.SHARE_FILES.name, f"{cluster.name} is {cluster.get_state_display().lower()}: shared at its next start")


def owed_settle(machine_id: int) -> str | None:
    """At a machine's next contact: what it owes goes (None: it owed nothing; "" done; else why not)."""
    with transaction.atomic():
        owed = NodeSettingsOwed.objects.select_for_update().filter(machine_id=machine_id).first()
        if owed is None:
            return None
        machine = Machine.objects.get(pk=machine_id)
        if hasattr(machine, "membership"):
            owed.delete()  # it belongs to another cluster now, whose settings replaced those
            return ""
    return _settle(machine, owed)

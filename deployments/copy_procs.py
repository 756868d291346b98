"""A copy's processes on its machines, started and stopped in one place.

A copy on one machine is its engine. A copy over several machines (its slots on more than one machine:
tensor parallel within each, pipeline parallel across them) also runs a Ray of its own, a node on each of
its machines with only the copy's GPUs of that machine visible; the engine on the first machine joins it.
The cluster's own Ray is never used for it: that one offers no GPU, and a copy must run on exactly the
GPUs the placement gave it. Order: the head node on the first machine (its GCS port is the agent's pick),
the other nodes joining it, then the engine (``RAY_ADDRESS``); stopping ends the engine first, then every
node at once (nothing uses that Ray any more: each node ends its own processes).
"""
from __future__ import annotations

from clusters.fanout import each
from clusters.models import ClusterMember
from deployments import engine
from deployments.models import Copy, Deployment
from machines.agent_client import Agent, AgentError
from machines.versions import agent_outdated

NODE_SUFFIX = "-ray"  # the agent's id of the copy's Ray node on each of its machines: "<copy>-ray"
SPANS_AGENT = "0.6.0"  # the first agent that runs a copy's own Ray


class CopyStartError(Exception):
    """The copy's processes could not all start; what did start was stopped again."""


def spans(copy: Copy) -> bool:
    return len({slot["machine"] for slot in copy.slots}) > 1


def node_key(copy: Copy) -> str:
    return f"{copy.key}{NODE_SUFFIX}"


def spans_refusal(copy: Copy, members: dict[int, ClusterMember]) -> str | None:
    """Why this copy cannot span its machines yet (an agent too old to run a copy's own Ray), or None."""
    old = [members[s["machine"]].machine for s in copy.slots
           if s["machine"] in members and agent_outdated(members[s["machine"]].machine.agent_version, SPANS_AGENT)]
    if not old:
        return None
    names = ", ".join(f"{m.name} ({m.agent_version or 'unknown'})" for m in old)
    return f"A copy over several machines needs agent {SPANS_AGENT} or newer on each; {names}: update the agent."


def start(deployment: Deployment, copy: Copy, command: engine.EngineCommand,
          members: dict[int, ClusterMember]) -> int | None:
    """Start the copy's processes; the engine's process id. CopyStartError with the machine's words."""
    cluster = deployment.cluster.name
    env = dict(command.env)
    if spans(copy):
        if refusal := spans_refusal(copy, members):
            raise CopyStartError(refusal)
        env["RAY_ADDRESS"] = _ray_start(deployment, copy, members)
    first = members[copy.slots[0]["machine"]]
    try:
        with Agent.open(first.machine) as agent:
            started = agent.copy_start(copy=copy.key, cluster=cluster, argv=command.argv, env=env, port=copy.port,
                                       address=copy.address)
    except AgentError as exc:
        if spans(copy):
            stop(copy, members)
        raise CopyStartError(f"{first.machine.name}: {exc.message}") from exc
    return started.pid


def _ray_start(deployment: Deployment, copy: Copy, members: dict[int, ClusterMember]) -> str:
    """The copy's Ray: its head on the first machine, then a node on each other machine; its address."""
    cluster, vendor = deployment.cluster.name, deployment.gpu_vendor
    head_slot, *other_slots = copy.slots
    head = members[head_slot["machine"]]
    try:
        with Agent.open(head.machine) as agent:
            started = agent.copy_start(copy=node_key(copy), cluster=cluster, address=head.address,
                                       env=engine.visible_devices(vendor, head_slot["gpus"]),
                                       ray={"head": None, "gpus": len(head_slot["gpus"])})
    except AgentError as exc:
        raise CopyStartError(f"{head.machine.name}: the copy's Ray did not start: {exc.message}") from exc
    address = f"{head.address}:{started.port}"

    def join(slot: dict) -> str | None:
        member = members[slot["machine"]]
        try:
            with Agent.open(member.machine) as agent:
                agent.copy_start(copy=node_key(copy), cluster=cluster, address=member.address,
                                 env=engine.visible_devices(vendor, slot["gpus"]),
                                 ray={"head": address, "gpus": len(slot["gpus"])})
        except AgentError as exc:
            return f"{member.machine.name}: the copy's Ray node did not start: {exc.message}"
        return None

    if failures := each(other_slots, join):
        stop(copy, members)
        raise CopyStartError("; ".join(failures))
    return address


def stop(copy: Copy, members: dict[int, ClusterMember]) -> list[str]:
    """Stop the copy's engine, then its Ray's nodes at once; what could not be stopped, in words.
    A machine no longer in the cluster is skipped (its runtime's stop ended what ran there)."""
    failures: list[str] = []

    def on(machine_id: int, key: str) -> str | None:
        member = members.get(machine_id)
        if member is None:
            return None
        try:
            with Agent.open(member.machine) as agent:
                agent.copy_stop(key)
        except AgentError as exc:
            return f"{member.machine.name}: {exc.message}"
        return None

    machines = list(dict.fromkeys(slot["machine"] for slot in copy.slots)) or (
        [copy.machine_id] if copy.machine_id else [])
    if not machines:
        return failures
    if failure := on(machines[0], copy.key):
        failures.append(failure)
    if len(machines) > 1:
        failures += each(machines, lambda machine_id: on(machine_id, node_key(copy)))
    return failures

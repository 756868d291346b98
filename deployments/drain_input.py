"""What the drain plan reads, and what the drain plan card shows: a cluster's machines, its copies and
which machines hold which model's files, as plain data for ``deployments/drain_plan.py``; the plan as
``Drain.plan`` keeps it; the reasons a drain cannot start; and the card's words.

One query per table (members, copies, drains, GPUs, model holdings), whatever the number of machines
or copies: the plan itself is pure and never touches the database.
"""
from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction

from clusters.actions import HEAD_DRAIN
from clusters.choices import ClusterState, Role
from clusters.models import Cluster
from deployments import placement_input
from deployments.asks import port_range, slot_json
from deployments.choices import CopyState
from deployments.drain_plan import CopyOnMachine, DrainPlan, button_label, move_words, plan_drain, stop_words
from deployments.models import Copy, Drain, ModelHolding
from deployments.placement_reasons import names_of
from machines.versions import agent_outdated

__all__ = ["DRAIN_AGENT", "drain_card", "drain_plan_for", "drain_refusals", "plan_json"]

DRAIN_AGENT = "0.11.0"  # the first agent with what the drain asks of the machine and of the head
MIB = 2**20

DRAINING_ALREADY = "{name} is draining already ({state})."
AGENT_OLD = "Draining needs agent {version} or later on the machine and on the head: update {names}."
NOT_MEMBER = "{names} {verb} not in {cluster}."


def drain_plan_for(cluster: Cluster, machine_ids: Iterable[int], *, remove: bool = False) -> DrainPlan:
    """The drain plan for the machines ``machine_ids`` of ``cluster`` (Remove from cluster too: the
    machines leave once drained, and the plan is the same). Raises ValueError for a machine not in it."""
    return _read(cluster, machine_ids)[0]


def _read(cluster: Cluster, machine_ids: Iterable[int]):
    """(the plan, the members by machine id, the copies on the drained machines by id)."""
    draining = set(machine_ids)
    members = {m.machine_id: m for m in cluster.members.select_related("machine")}
    _members_only(cluster, draining, members)
    # The copies holding room (as placement_input.HOLDS says), read once: for the rooms and for the plan.
    rows = list(Copy.objects.filter(placement_input.HOLDS, deployment__cluster=cluster).values_list(
        "id", "number", "state", "slots", "deployment_id", "deployment__name", "deployment__model_id",
        "deployment__gpu_quarters", "deployment__gpu_vendor", "deployment__gpu_model", "deployment__gpu_memory_mib",
        "deployment__arch", "deployment__memory_per_gpu_mib", "deployment__deleting_since"))
    rooms = placement_input.cluster_rooms(cluster, holding=[(r[3], r[4], r[12]) for r in rows])
    kinds, copies = {}, []
    for (copy_id, number, state, slots, deployment_id, name, model_id, quarters, vendor, gpu_model, memory_mib, arch,
         per_gpu_mib, deleting_since) in rows:
        on = tuple(slot["machine"] for slot in slots)
        # A copy stopping, or of a deployment being deleted, goes away by itself: it neither moves nor stops.
        if draining.isdisjoint(on) or state == CopyState.STOPPING or deleting_since is not None:
            continue
        kind = kinds.get((vendor, gpu_model, memory_mib))
        if kind is None:
            kind = kinds[(vendor, gpu_model, memory_mib)] = placement_input.gpu_kind(vendor, gpu_model, memory_mib)
        copies.append(CopyOnMachine(id=copy_id, deployment=deployment_id, name=name, model=model_id,
                                    gpus=Fraction(quarters, 4), memory_per_gpu_bytes=per_gpu_mib * MIB, kind=kind,
                                    arch=arch, machines=on, number=number))
    files: dict[int, set[int]] = {}
    for model_id, machine_id in ModelHolding.objects.filter(
            model_id__in={c.model for c in copies}, machine_id__in=list(members)).values_list("model_id", "machine_id"):
        files.setdefault(model_id, set()).add(machine_id)
    plan = plan_drain(rooms, copies, draining, files, port_range=port_range())
    return plan, members, {c.id: c for c in copies}


def _members_only(cluster: Cluster, machine_ids: set[int], members: dict) -> None:
    if not machine_ids:
        raise ValueError("Select the machines to drain.")
    strangers = sorted(machine_ids - set(members))
    if strangers:
        names, verb = names_of([f"Machine {machine_id}" for machine_id in strangers])
        raise ValueError(NOT_MEMBER.format(names=names, verb=verb, cluster=cluster.name))


def plan_json(plan: DrainPlan) -> dict:
    """The plan as ``Drain.plan`` keeps it (what the person agreed to, for the drain job): each move's
    slots as a copy's slots are written, each stop with its reason."""
    return {"moves": [{"copy": move.copy, "to": move.to, "slots": [slot_json(t) for t in move.slots]} for move in plan.moves],
            "stops": [{"copy": stop.copy, "reason": stop.reason} for stop in plan.stops]}


def drain_refusals(cluster: Cluster, machine_ids: Iterable[int], *, members: dict | None = None,
                   drains: dict | None = None) -> tuple[list[str], list]:
    """Why a drain of those machines cannot start, as the card says it before anything starts (empty when
    it can), and the machines whose agent must be updated first (the machines to drain, and the head)."""
    wanted = set(machine_ids)
    if members is None:
        members = {m.machine_id: m for m in cluster.members.select_related("machine")}
    _members_only(cluster, wanted, members)
    if drains is None:
        drains = {d.machine_id: d for d in Drain.objects.filter(machine_id__in=list(wanted))}
    chosen = sorted((members[m] for m in wanted), key=lambda m: m.machine.name)
    said = []
    if cluster.state != ClusterState.STOPPED:
        said += [HEAD_DRAIN.format(name=m.machine.name, cluster=cluster.name) for m in chosen if m.role == Role.HEAD]
    said += [DRAINING_ALREADY.format(name=m.machine.name, state=drains[m.machine_id].get_state_display())
             for m in chosen if m.machine_id in drains]
    head = next((m for m in members.values() if m.role == Role.HEAD), None)
    asked = chosen + ([head] if head is not None and head.machine_id not in wanted else [])
    outdated = [m.machine for m in asked if agent_outdated(m.machine.agent_version, DRAIN_AGENT)]
    if outdated:
        names = ", ".join(m.name for m in outdated[:-1]) + (" and " if len(outdated) > 1 else "") + outdated[-1].name
        said.append(AGENT_OLD.format(version=DRAIN_AGENT, names=names))
    return said, outdated


def drain_card(cluster: Cluster, machine_ids: Iterable[int], *, remove: bool = False, action_url: str = "") -> dict:
    """The drain plan card's context (``templates/deployments/_drain_plan.html``, as ``drain``): for each
    machine its copies, each "Moves to …" or "Stops: …"; the agree button's label ("Drain", "Drain and
    stop 2", "Remove" …); what keeps the drain from starting; the form's URL and the machines it posts."""
    machine_ids = set(machine_ids)
    plan, members, copies = _read(cluster, machine_ids)
    drains = {d.machine_id: d for d in Drain.objects.filter(machine_id__in=list(machine_ids))}
    refusals, outdated = drain_refusals(cluster, machine_ids, members=members, drains=drains)
    rows: dict[int, list] = {m: [] for m in machine_ids}
    said = [(move.copy, True, move_words(move), "") for move in plan.moves] + \
           [(stop.copy, False, stop_words(stop), stop.reason) for stop in plan.stops]
    for copy_id, moves, words, reason in said:
        copy = copies[copy_id]
        under = next(m for m in copy.machines if m in machine_ids)  # a copy spanning two of them: under the first
        rows[under].append({"copy": f"{copy.name} #{copy.number}", "moves": moves, "words": words, "reason": reason,
                            "key": (copy.name, copy.number)})
    machines = []
    for machine_id in sorted(machine_ids, key=lambda m: members[m].machine.name):
        machine = members[machine_id].machine
        machines.append({"id": machine_id, "name": machine.name, "head": members[machine_id].role == Role.HEAD,
                         "rows": sorted(rows[machine_id], key=lambda r: r["key"])})
    return {
        "cluster": cluster,
        "machines": machines,
        "remove": remove,
        "moves": len(plan.moves),
        "stops": len(plan.stops),
        "label": button_label(plan, remove=remove),
        "refusals": refusals,
        "update": [{"name": m.name, "url": m.get_absolute_url()} for m in outdated],
        "can_start": not refusals,
        "action_url": action_url,
        "machine_ids": sorted(machine_ids),
        "plan": plan,
    }

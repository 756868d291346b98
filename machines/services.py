"""Everything that changes a machine: enrolment, host keys, facts, heartbeats, state.

Views, the API, the admin and tasks all call these functions; nothing else
writes a machine's state. Those a person calls take ``user`` and check the
user's role first (machines/actions.py; None: the console itself acts).
"""
from __future__ import annotations

import hashlib
import ipaddress
import logging
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.timesince import timesince

from console import live, roles
from console.choices import JOB_ACTIVE
from console.jobs import job_start
from console.lifecycle import InvalidTransition, transition  # noqa: F401 - InvalidTransition is part of this API
from console.models import Job
from console.pruning import delete_in_batches
from machines import actions, beats, remote, runtimes, steps
from machines.choices import TRANSITIONS, EventKind, InterfaceKind, MachineState
from machines.models import Accelerator, Machine, MachineEvent, NetworkInterface
from machines.signals import machine_gpus_freed, machine_reconnected, machine_runtime_reported, machine_went_offline

log = logging.getLogger(__name__)

# The machines' counts alone, for pages that show them without the list (the dashboard).
SUMMARY_TOPIC = "machines:summary"


def machine_changed(machine: Machine) -> None:
    """Tell the pages that show this machine to render it again (after commit)."""
    live.push("machines", part=str(machine.pk))
    live.push(f"machine:{machine.pk}")


def machines_summary_changed() -> None:
    """Tell the pages that show the machines' counts alone (the dashboard) to render them again."""
    live.push(SUMMARY_TOPIC)


def machine_event(*, machine: Machine, kind: str, message: str) -> MachineEvent:
    return MachineEvent.objects.create(machine=machine, kind=kind, message=message)


def machine_events_prune(older_than: datetime) -> int:
    """Delete the machine events written before ``older_than`` (the beat's pruning, FADEN_KEEP_EVENTS_DAYS)."""
    return delete_in_batches(MachineEvent.objects.filter(created_at__lt=older_than))


def machine_transition(*, machine: Machine, to: str, reason: str = "") -> bool:
    """The one way a machine changes state: checked against TRANSITIONS, saved, recorded, pushed.

    Returns False when the machine is already in that state (only the reason is refreshed).
    """
    before = machine.get_state_display()
    changed = transition(machine, to=to, allowed=TRANSITIONS, reason=reason, on_change=lambda: machine_changed(machine))
    if changed:
        machines_summary_changed()
        message = f"{before} → {machine.get_state_display()}" + (f": {reason}" if reason else "")
        machine_event(machine=machine, kind=EventKind.STATE, message=message)
    return changed


def machine_target(machine: Machine) -> remote.Target:
    return remote.Target(
        address=machine.address, port=machine.ssh_port, user=machine.ssh_user, fingerprint=machine.host_key_fingerprint
    )


# -- adding a machine -------------------------------------------------------------------


def machine_validate(*, name: str, address: str, ssh_port: int, ssh_user: str) -> Machine:
    """An unsaved machine whose fields passed every check; raises ValidationError by field."""
    machine = Machine(name=name, address=address, ssh_port=ssh_port, ssh_user=ssh_user)
    machine.full_clean(exclude=["host_key_fingerprint", "offered_host_key_fingerprint", "state"])
    return machine


def machine_host_key_scan(*, address: str, ssh_port: int) -> str:
    """Fetch the fingerprint the machine offers, as a ValidationError when it cannot be reached."""
    try:
        return remote.scan_host_key(address, ssh_port)
    except remote.RemoteError as exc:
        raise ValidationError({"address": exc.message}) from exc


def machine_create(
    *, name: str, address: str, ssh_port: int = 22, ssh_user: str = "root", host_key_fingerprint: str = "", user=None
) -> Machine:
    """Add a machine.

    With a fingerprint (confirmed on the page, or given in the API call) the
    machine must offer exactly that key, and enrolment starts. Without one the
    machine waits in "Host key to confirm" with the key it offered.
    """
    actions.ADD.offer(roles.acting(user)).check()
    machine = machine_validate(name=name, address=address, ssh_port=ssh_port, ssh_user=ssh_user)
    if host_key_fingerprint:
        machine.host_key_fingerprint = host_key_fingerprint
        machine.full_clean(validate_unique=False, exclude=["offered_host_key_fingerprint", "state"])
    offered = machine_host_key_scan(address=address, ssh_port=ssh_port)
    if host_key_fingerprint and offered != host_key_fingerprint:
        raise ValidationError(
            {
                "host_key_fingerprint": f"The machine offered the host key {offered}, not {host_key_fingerprint}. "
                "Check the address, or the fingerprint you were given."
            }
        )
    try:
        with transaction.atomic():
            _machine_add(machine, offered=offered, confirmed=bool(host_key_fingerprint), user=user)
    except IntegrityError:
        # Another request added a machine of this name since the check above: the same refusal as the check.
        machine.validate_unique()
        raise
    return machine


def _machine_add(machine: Machine, *, offered: str, confirmed: bool, user=None) -> None:
    """Write the new machine and its first event; enrol it at once when its host key was confirmed."""
    machine.offered_host_key_fingerprint = "" if confirmed else offered
    machine.state = MachineState.ENROLLING if confirmed else MachineState.HOST_KEY
    machine.save()
    machine_event(
        machine=machine,
        kind=EventKind.HOST_KEY,
        message=f"Host key {offered} " + ("confirmed when the machine was added." if confirmed else "offered on first contact."),
    )
    if confirmed:
        machine_enrol_start(machine=machine, user=user)
    live.push("machines", part=f"new-{machine.pk}")
    machines_summary_changed()


def machine_trust_host_key(*, machine: Machine, fingerprint: str, user=None) -> Job:
    """Trust the key the machine offered (first contact or after a change) and enrol it again."""
    actions.TRUST.offer(roles.acting(user)).check()
    remote_fp = machine.offered_host_key_fingerprint
    if not remote_fp:
        raise ValidationError({"fingerprint": "This machine has no new host key waiting to be trusted."})
    if fingerprint != remote_fp:
        raise ValidationError(
            {"fingerprint": f"The machine offered {remote_fp}; confirm that fingerprint, not {fingerprint or 'nothing'}."}
        )
    with transaction.atomic():
        machine = Machine.objects.select_for_update(no_key=True).get(pk=machine.pk)
        previous = machine.host_key_fingerprint
        machine.host_key_fingerprint = fingerprint
        machine.offered_host_key_fingerprint = ""
        machine.save(update_fields=["host_key_fingerprint", "offered_host_key_fingerprint"])
        message = f"Host key {fingerprint} trusted" + (f" in place of {previous}." if previous else ".")
        machine_event(machine=machine, kind=EventKind.HOST_KEY, message=message)
        return machine_enrol_start(machine=machine, user=user)


def machine_enrol_start(*, machine: Machine, user=None, title: str = "") -> Job:
    """Write the enrolment job and enqueue it after commit; the machine reads Enrolling meanwhile."""
    if machine.state != MachineState.ENROLLING:
        machine_transition(machine=machine, to=MachineState.ENROLLING)
    return job_start(
        kind=steps.ENROL.kind,
        title=title or f"Enrol {machine.name}",
        target_type="machine",
        target_id=machine.pk,
        steps=steps.ENROL.step_names,
        user=user,
    )


def machine_refresh(*, machine: Machine, user=None) -> Job:
    """Read the facts again (and bring the agent up to date): the enrolment job, run again."""
    busy = Job.objects.filter(target_type="machine", target_id=machine.pk, state__in=JOB_ACTIVE).exists()
    actions.refresh_offer(machine, busy=busy, role=roles.acting(user)).check()
    with transaction.atomic():
        if machine.state == MachineState.FAILED:
            return machine_enrol_start(machine=machine, user=user, title=f"Refresh facts of {machine.name}")
        job = job_start(
            kind=steps.REFRESH.kind,
            title=f"Refresh facts of {machine.name}",
            target_type="machine",
            target_id=machine.pk,
            steps=steps.REFRESH.step_names,
            user=user,
        )
        machine_changed(machine)
    return job


# -- updating the agent -----------------------------------------------------------------


@dataclass
class AgentUpdates:
    """What Update agent did for a selection: the machines it started a job on (and those jobs), the
    machines that run the console's agent already, and the others with the sentence that says why not."""

    started: list[Machine] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    up_to_date: list[Machine] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def _machines_busy(machine_ids) -> set[int]:
    """The machines among ``machine_ids`` that a queued or running job of their own holds."""
    jobs = Job.objects.filter(target_type="machine", target_id__in=list(machine_ids), state__in=JOB_ACTIVE)
    return set(jobs.values_list("target_id", flat=True))


def _update_agent_start(machine: Machine, *, user=None) -> Job:
    """Write the update job (the machine's row is locked and its offer checked) and send it on commit."""
    job = job_start(
        kind=steps.UPDATE_AGENT.kind,
        title=f"Update agent on {machine.name}",
        target_type="machine",
        target_id=machine.pk,
        steps=steps.UPDATE_AGENT.step_names,
        user=user,
    )
    machine_changed(machine)  # its page greys Update agent out while the job runs
    return job


def machine_update_agent(*, machine: Machine, user=None) -> Job:
    """Install the console's agent on a Healthy machine and restart its heartbeat on it.

    Ray, the runtime's container and the blob server keep running: the agent restarts its heartbeat
    daemon alone. A machine already up to date gets the job too; it checks, and says so.
    """
    actions.UPDATE_AGENT.offer(roles.acting(user)).check()
    with transaction.atomic():
        machine = Machine.objects.select_for_update(no_key=True).get(pk=machine.pk)  # one job at a time, even when two ask at once
        busy = bool(_machines_busy([machine.pk]))
        actions.update_agent_offer(machine, busy=busy, role=roles.acting(user)).check()
        return _update_agent_start(machine, user=user)


def machines_update_agent(*, machine_ids: list[int], user=None) -> AgentUpdates:
    """Update agent on each of a selection whose agent is out of date; the others are skipped, each
    with its reason. The role is checked once, for the whole selection."""
    actions.UPDATE_AGENT.offer(roles.acting(user)).check()
    if not machine_ids:
        raise ValidationError({"machines": "Select the machines whose agent to update."})
    updates = AgentUpdates()
    with transaction.atomic():
        machines = list(Machine.objects.select_for_update(no_key=True).defer("facts").filter(pk__in=machine_ids).order_by("pk"))
        busy = _machines_busy(m.pk for m in machines)
        missing = sorted(set(machine_ids) - {m.pk for m in machines})
        if missing:
            updates.refused.append(f"No machine has the id {', '.join(map(str, missing))}.")
        for machine in sorted(machines, key=lambda m: m.name):
            offer = actions.update_agent_offer(machine, busy=machine.pk in busy, role=roles.acting(user))
            if not machine.agent_outdated:
                updates.up_to_date.append(machine)
            elif not offer.ok:
                updates.refused.append(offer.why)
            else:
                updates.jobs.append(_update_agent_start(machine, user=user))
                updates.started.append(machine)
    return updates


def machine_delete(*, machine: Machine, user=None) -> None:
    """Forget the machine. Its heartbeats are refused from now on; the agent stays on it until re-used."""
    actions.delete_offer(machine, role=roles.acting(user)).check()
    with transaction.atomic():
        Job.objects.filter(target_type="machine", target_id=machine.pk, state__in=JOB_ACTIVE).update(
            cancel_requested=True
        )
        pk = machine.pk
        machine.delete()
        live.push("machines", part=f"deleted-{pk}")
        machines_summary_changed()


# -- facts and heartbeats ---------------------------------------------------------------


def heartbeat_token_new() -> tuple[str, str]:
    """A fresh per-machine token and the hash the console keeps of it."""
    token = secrets.token_urlsafe(32)
    return token, hashlib.sha256(token.encode()).hexdigest()


def machine_facts_apply(*, machine: Machine, facts: dict) -> None:
    """Store what the agent reported: the row's summary fields, its accelerators and interfaces."""
    store = facts.get("store") or {}
    machine.facts = facts
    machine.facts_at = timezone.now()
    machine.arch = str(facts.get("arch", ""))[:32]
    machine.hostname = str(facts.get("hostname", ""))[:255]
    machine.cpu_count = facts.get("cpu_count")
    machine.memory_mib = facts.get("memory_mib")
    machine.store_path = str(store.get("path", ""))[:255]
    machine.store_free_bytes = store.get("free_bytes")
    machine.store_total_bytes = store.get("total_bytes")
    machine.container_runtimes = [r.as_dict() for r in runtimes.found_in(facts)]
    configured = runtimes.configured_in(facts)
    machine.configured_runtime = configured.name if configured else ""
    _runtime_settle(machine, configured=configured)
    machine.agent_version = str(facts.get("agent_version", ""))[:32]
    machine.save()
    machine.accelerators.all().delete()
    Accelerator.objects.bulk_create(
        Accelerator(
            machine=machine,
            index=int(a.get("index", i)),
            vendor=str(a.get("vendor", ""))[:16],
            model=str(a.get("model", ""))[:128],
            memory_mib=a.get("memory_mib"),
            uuid=str(a.get("uuid") or "")[:128],
            pci_bus_id=str(a.get("pci_bus_id") or "")[:64],
        )
        for i, a in enumerate(facts.get("accelerators") or [])
    )
    accelerators_foreign_apply(machine=machine, use=beats.foreign_gpu_use(facts.get("gpu_processes")))
    machine.interfaces.all().delete()
    NetworkInterface.objects.bulk_create(
        _interface_row(machine, iface) for iface in facts.get("interfaces") or [] if iface.get("name")
    )
    machines_summary_changed()  # the accelerators' count


def accelerators_foreign_apply(*, machine: Machine, use: dict | None) -> bool:
    """Write on the machine's GPUs which processes the console did not start use them (``beats.foreign_gpu_use``:
    pids and memory by GPU uuid; None leaves them as they are). Only the rows that change are written; whether
    any did, in which case the machine's page is pushed."""
    if use is None:
        return False
    changed, freed = [], False
    for row in machine.accelerators.only("pk", "uuid", "foreign_pids", "foreign_memory_mib"):
        pids, memory = use.get(row.uuid, ([], None)) if row.uuid else ([], None)
        if (row.foreign_pids, row.foreign_memory_mib) != (pids, memory):
            freed = freed or (bool(row.foreign_pids) and not pids)
            row.foreign_pids, row.foreign_memory_mib = pids, memory
            changed.append(row)
    if changed:
        Accelerator.objects.bulk_update(changed, ["foreign_pids", "foreign_memory_mib"])
        machine_changed(machine)
    if freed:
        machine_gpus_freed.send(sender=Machine, machine_id=machine.pk)
    return bool(changed)


def _runtime_settle(machine: Machine, *, configured: runtimes.Runtime | None) -> None:
    """Work out the runtime in use from what the agent found and the choice (not saved here)."""
    runtime = runtimes.in_use(configured=configured, found=machine.runtimes_found(), choice=machine.runtime_choice)
    machine.container_runtime = runtime.name if runtime else ""
    machine.container_runtime_version = runtime.version if runtime else ""


def machine_runtime_choose(*, machine: Machine, choice: str, user=None) -> Machine:
    """Choose the container runtime the machine's clusters start with: "" (automatic) or an engine its
    agent found. A cluster running on it keeps its containers; its next start uses the choice."""
    actions.CHOOSE_RUNTIME.offer(roles.acting(user)).check()
    with transaction.atomic():
        machine = Machine.objects.select_for_update(no_key=True).get(pk=machine.pk)
        refusal = runtimes.choice_refusal(machine_name=machine.name, choice=choice, found=machine.runtimes_found())
        if refusal:
            raise ValidationError({"runtime_choice": refusal})
        if choice == machine.runtime_choice:
            return machine
        before = machine.get_runtime_choice_display()
        machine.runtime_choice = choice
        configured = runtimes.Runtime(machine.configured_runtime, machine.container_runtime_version) if (
            machine.configured_runtime) else None
        _runtime_settle(machine, configured=configured)
        machine.save(update_fields=["runtime_choice", "container_runtime", "container_runtime_version"])
        in_use = machine.runtime.label if machine.runtime else "none"
        machine_event(machine=machine, kind=EventKind.RUNTIME,
                      message=f"Container runtime: {machine.get_runtime_choice_display()} in place of {before}; in use: {in_use}.")
        machine_changed(machine)
    return machine


def _interface_row(machine: Machine, iface: dict) -> NetworkInterface:
    addresses = [str(a) for a in iface.get("addresses") or []]
    kind = iface.get("kind") if iface.get("kind") in InterfaceKind.values else InterfaceKind.PHYSICAL
    reaches_console = any(_same_address(a.split("/")[0], machine.address) for a in addresses)
    return NetworkInterface(
        machine=machine,
        name=str(iface["name"])[:32],
        kind=kind,
        mac=str(iface.get("mac") or "")[:32],
        mtu=iface.get("mtu"),
        state=str(iface.get("state") or "")[:16],
        addresses=addresses,
        speed_mbps=iface.get("speed_mbps") if (iface.get("speed_mbps") or 0) > 0 else None,
        default_route=bool(iface.get("default_route")),
        management=bool(iface.get("default_route")) or reaches_console,
    )


def _same_address(a: str, b: str) -> bool:
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return a == b


def machine_by_heartbeat_token(token: str) -> Machine | None:
    """The machine that holds ``token`` (its hash), or None. Read before anything else of a heartbeat,
    so that nobody without a token gets the console to parse what they sent."""
    if not token or len(token) > 200:
        return None
    digest = hashlib.sha256(token.encode()).hexdigest()
    return Machine.objects.only("pk").filter(heartbeat_token_hash=digest).first()


def machine_heartbeat(*, machine: Machine, payload: dict) -> Machine | None:
    """A heartbeat from a machine's agent (``machine_by_heartbeat_token`` found it): it is alive. An
    Offline machine comes back Healthy. What it says of its runtime is kept, and told to the apps
    above (``machine_runtime_reported``) when it changed or reports a failure; the processes the console did
    not start on its GPUs go on its accelerators. None when the machine was deleted meanwhile."""
    now = timezone.now()
    with transaction.atomic():
        machine = Machine.objects.select_for_update(no_key=True).filter(pk=machine.pk).first()
        if machine is None:
            return None
        was_seen = machine.last_seen
        machine.last_seen = now
        fields = ["last_seen"]
        version = str(payload.get("agent_version", ""))[:32]
        if version and version != machine.agent_version:
            machine.agent_version = version
            fields.append("agent_version")
        report = beats.runtime_report(payload.get("runtime"))
        runtime_changed = report is not None and report != machine.runtime_beat
        if runtime_changed:
            fields += _runtime_beat_record(machine, report, now)
        machine.save(update_fields=fields)
        # A person's job on a GPU reaches placement within a beat of the agent's read (every 10 s at most).
        accelerators_foreign_apply(machine=machine, use=beats.foreign_gpu_use(payload.get("gpu_processes")))
        if machine.state in (MachineState.OFFLINE,):
            away = f" after {timesince(was_seen, now)} without a heartbeat" if was_seen else ""
            machine_transition(machine=machine, to=MachineState.HEALTHY)
            machine_event(machine=machine, kind=EventKind.RECONNECTED, message=f"Reconnected{away}.")
            machine_reconnected.send(sender=Machine, machine_id=machine.pk, name=machine.name)
            return machine  # its cluster is checked for the reconnection: that look covers the runtime too
        if was_seen is None or int(was_seen.timestamp()) // 30 != int(now.timestamp()) // 30:
            # Pages tick "last seen" by themselves; a fresh timestamp every 30 s keeps them honest
            # without a push per heartbeat.
            machine_changed(machine)
        failure = beats.runtime_failure(report)
        if runtime_changed or failure:
            machine_runtime_reported.send(sender=Machine, machine_id=machine.pk, name=machine.name, failure=failure,
                                          failing_since=machine.runtime_failing_since)
    return machine


def _runtime_beat_record(machine: Machine, report: dict, now: datetime) -> list[str]:
    """Keep a beat's runtime section that differs from the last; a failure it begins to report is
    dated (the checks tell a failure they have not seen yet by it). The fields to save."""
    was_failing = bool(beats.runtime_failure(machine.runtime_beat))
    machine.runtime_beat = report
    failing = bool(beats.runtime_failure(report))
    if failing and not was_failing:
        machine.runtime_failing_since = now
    elif not failing:
        machine.runtime_failing_since = None
    return ["runtime_beat", "runtime_failing_since"]


def machines_mark_offline(*, now=None) -> list[int]:
    """Mark Healthy machines without a heartbeat for FADEN_OFFLINE_AFTER seconds Offline."""
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.FADEN_OFFLINE_AFTER)
    stale = Machine.objects.filter(state=MachineState.HEALTHY, last_seen__lt=cutoff).values_list("pk", flat=True)
    marked = []
    for pk in stale:
        with transaction.atomic():
            machine = Machine.objects.select_for_update(no_key=True).get(pk=pk)
            if machine.state == MachineState.HEALTHY and machine.last_seen and machine.last_seen < cutoff:
                seconds = int((now - machine.last_seen).total_seconds())
                machine_transition(machine=machine, to=MachineState.OFFLINE, reason=f"No heartbeat for {seconds} s.")
                machine_went_offline.send(sender=Machine, machine_id=machine.pk, name=machine.name)
                marked.append(pk)
    return marked

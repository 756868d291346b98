"""The enrolment job: connect, check Python, install the agent, read facts, start the heartbeat.

Every step is idempotent, so the same job serves the first enrolment, a
refresh of the facts and an agent update.
"""
from __future__ import annotations


from django.conf import settings
from django.db import transaction
from django.utils import timezone

from console.jobs import JobContext, JobError
from machines import remote, services
from machines.agent import agent_build, agent_install, machine_preflight
from machines.agent_client import Agent
from machines.choices import MachineState
from machines.models import Machine

HEARTBEAT_PATH = "/agent/heartbeat/"


def machine_enrol_run(ctx: JobContext, *, machine_id: int) -> None:
    machine = Machine.objects.get(pk=machine_id)
    build = agent_build()
    try:
        ctx.step("Connect", f"{machine.ssh_user}@{machine.address} port {machine.ssh_port}")
        with remote.connect(services.machine_target(machine)) as conn:
            ctx.log(f"Connected to {machine.address}; host key {machine.host_key_fingerprint} matches.")
            ctx.step("Check Python")
            preflight = machine_preflight(conn, build)
            ctx.detail(f"Python {preflight.version} ({preflight.python})")
            ctx.step("Install the agent")
            uploaded = agent_install(conn, build, preflight)
            path = preflight.path
            ctx.detail(f"{build.version} at {path}" + ("" if uploaded else " (already there)"))
            ctx.log(f"Agent {build.version} {'uploaded, sha256 checked' if uploaded else 'already installed'}: {path}")
            ctx.step("Read facts")
            agent = Agent(machine, conn, argv=[preflight.python, path])
            facts = agent.facts()
            with transaction.atomic():
                machine.refresh_from_db()
                machine.agent_path = path
                machine.python_path = preflight.python
                services.machine_facts_apply(machine=machine, facts=facts)
            ctx.detail(machine.accelerator_summary() or "no accelerators")
            ctx.step("Start the heartbeat")
            url = remote.console_url(conn, preflight.ssh_client_address) + HEARTBEAT_PATH
            token, token_hash = services.heartbeat_token_new()
            with transaction.atomic():
                # Store the hash first: the first beat may arrive before the command returns.
                Machine.objects.filter(pk=machine.pk).update(heartbeat_token_hash=token_hash)
            agent.heartbeat_start(url=url, interval=settings.FADEN_HEARTBEAT_INTERVAL, token=token)
            ctx.detail(f"every {settings.FADEN_HEARTBEAT_INTERVAL} s to {url}")
    except remote.HostKeyMismatch as exc:
        with transaction.atomic():
            machine = Machine.objects.select_for_update().get(pk=machine_id)
            machine.offered_host_key_fingerprint = exc.offered
            machine.save(update_fields=["offered_host_key_fingerprint"])
            services.machine_transition(machine=machine, to=MachineState.FAILED, reason=exc.message)
        raise JobError(exc.message, kind=exc.kind) from exc
    except remote.RemoteError as exc:
        with transaction.atomic():
            machine = Machine.objects.select_for_update().get(pk=machine_id)
            if machine.state in (MachineState.ENROLLING, MachineState.FAILED):
                services.machine_transition(machine=machine, to=MachineState.FAILED, reason=exc.message)
        raise JobError(exc.message, kind=exc.kind) from exc
    with transaction.atomic():
        machine = Machine.objects.select_for_update().get(pk=machine_id)
        machine.last_seen = timezone.now()
        machine.save(update_fields=["last_seen"])
        services.machine_transition(machine=machine, to=MachineState.HEALTHY)

"""The enrolment job: connect, check Python, install the agent, read facts, start the heartbeat.

Every step is idempotent, so the same job serves the first enrolment, a
refresh of the facts and an agent update. Installing the agent and starting
its heartbeat are functions of their own: Update agent (``agent_update.py``)
runs the same ones.
"""
from __future__ import annotations


from django.conf import settings
from django.db import transaction
from django.utils import timezone
from fabric import Connection

from console import agent_tls
from console.jobs import JobContext, JobError
from machines import remote, services, steps
from machines.agent import AgentBuild, Preflight, agent_build, agent_install, machine_preflight
from machines.agent_client import Agent
from machines.agent_results import HeartbeatStarted
from machines.choices import MachineState
from machines.models import Machine

HEARTBEAT_PATH = "/agent/heartbeat/"


def machine_enrol_run(ctx: JobContext, *, machine_id: int) -> None:
    machine = Machine.objects.get(pk=machine_id)
    build = agent_build()
    try:
        steps.CONNECT.always(ctx, f"{machine.ssh_user}@{machine.address} port {machine.ssh_port}")
        with remote.connect(services.machine_target(machine)) as conn:
            ctx.log(f"Connected to {machine.address}; host key {machine.host_key_fingerprint} matches.")
            preflight = agent_put(ctx, conn, build)
            steps.READ_FACTS.always(ctx)
            agent = Agent(machine, conn, argv=[preflight.python, preflight.path])
            facts = agent.facts()
            with transaction.atomic():
                machine.refresh_from_db()
                machine.agent_path = preflight.path
                machine.python_path = preflight.python
                services.machine_facts_apply(machine=machine, facts=facts)
            ctx.detail(machine.accelerator_summary() or "no accelerators")
            steps.START_HEARTBEAT.always(ctx)
            heartbeat_start(ctx, machine=machine, agent=agent, preflight=preflight)
    except remote.HostKeyMismatch as exc:
        raise host_key_refused(machine_id, exc) from exc
    except remote.RemoteError as exc:
        with transaction.atomic():
            machine = Machine.objects.select_for_update(no_key=True).get(pk=machine_id)
            if machine.state in (MachineState.ENROLLING, MachineState.FAILED):
                services.machine_transition(machine=machine, to=MachineState.FAILED, reason=exc.message)
        raise JobError(exc.message, kind=exc.kind) from exc
    with transaction.atomic():
        machine = Machine.objects.select_for_update(no_key=True).get(pk=machine_id)
        machine.last_seen = timezone.now()
        machine.save(update_fields=["last_seen"])
        services.machine_transition(machine=machine, to=MachineState.HEALTHY)


def machine_enrol_abandoned(job) -> None:
    """The reaper failed the enrolment (its worker died): the machine reads Failed with the job's sentence
    instead of Enrolling for ever, and Refresh facts enrols it again."""
    with transaction.atomic():
        machine = Machine.objects.select_for_update(no_key=True).filter(pk=job.target_id).first()
        if machine is not None and machine.state == MachineState.ENROLLING:
            services.machine_transition(machine=machine, to=MachineState.FAILED, reason=job.error)


def agent_put(ctx: JobContext, conn: Connection, build: AgentBuild) -> Preflight:
    """The steps ``CHECK_PYTHON`` and ``INSTALL_AGENT``: this build on the machine, digest checked.

    A machine that holds this build already keeps it (nothing is copied). Only the file is put in
    place: what runs from an older one (the heartbeat, the blob server) runs on until restarted.
    """
    steps.CHECK_PYTHON.always(ctx)
    preflight = machine_preflight(conn, build)
    ctx.detail(f"Python {preflight.version} ({preflight.python})")
    steps.INSTALL_AGENT.always(ctx)
    uploaded = agent_install(conn, build, preflight)
    ctx.detail(f"{build.version} at {preflight.path}" + ("" if uploaded else " (already there)"))
    ctx.log(f"Agent {build.version} {'uploaded, sha256 checked' if uploaded else 'already installed'}: {preflight.path}")
    return preflight


def heartbeat_start(ctx: JobContext, *, machine: Machine, agent: Agent, preflight: Preflight) -> HeartbeatStarted:
    """Give the machine a fresh heartbeat token and start its heartbeat daemon on ``agent``.

    The agent restarts a daemon that runs another agent version or configuration, and that daemon
    only: it stops it by its own pid, so Ray and the containers (processes of their own) run on.
    """
    # Over TLS to the console's agents' certificate, pinned (the agent is the console's own build by now).
    url = remote.agent_console_url(agent.conn, preflight.ssh_client_address) + HEARTBEAT_PATH
    pin = agent_tls.pin()
    token, token_hash = services.heartbeat_token_new()
    with transaction.atomic():
        # Store the hash first: the first beat may arrive before the command returns.
        Machine.objects.filter(pk=machine.pk).update(heartbeat_token_hash=token_hash)
    started = agent.heartbeat_start(url=url, interval=settings.FADEN_HEARTBEAT_INTERVAL, token=token, pin=pin)
    ctx.detail(f"every {settings.FADEN_HEARTBEAT_INTERVAL} s to {url} (certificate sha256 {pin[:16]}…)")
    return started


def host_key_refused(machine_id: int, exc: remote.HostKeyMismatch) -> JobError:
    """Keep the key the machine offered for an Administrator to trust, mark it Failed, and say why."""
    with transaction.atomic():
        machine = Machine.objects.select_for_update(no_key=True).get(pk=machine_id)
        machine.offered_host_key_fingerprint = exc.offered
        machine.save(update_fields=["offered_host_key_fingerprint"])
        services.machine_transition(machine=machine, to=MachineState.FAILED, reason=exc.message)
    return JobError(exc.message, kind=exc.kind)

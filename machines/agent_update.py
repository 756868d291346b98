"""The Update agent job: install the console's agent on a machine, restart its heartbeat on it, check.

The same install as the enrolment (``enrolment.agent_put``: Python checked, the build copied over
SFTP and its digest checked, or kept when the machine holds it already) and the same heartbeat start
(``enrolment.heartbeat_start``). What it never does is stop anything else: the agent's
``heartbeat start`` replaces the heartbeat daemon alone (it signals that one pid), so Ray and the
runtime's container, processes of their own, run on; the old build's file stays where it is for
whatever still runs from it (the blob server, until its next start). The machine stays Healthy
throughout: a cluster sees nothing of it.
"""
from __future__ import annotations

import posixpath

from django.db import transaction

from console.choices import ErrorKind
from console.jobs import JobContext, JobError
from machines import enrolment, remote, services, steps
from machines.agent import agent_build
from machines.agent_client import Agent
from machines.choices import EventKind
from machines.models import Machine


def machine_update_agent_run(ctx: JobContext, *, machine_id: int) -> None:
    machine = Machine.objects.get(pk=machine_id)
    build = agent_build()
    before = machine.agent_version or "unknown"
    try:
        steps.CONNECT.always(ctx, f"{machine.ssh_user}@{machine.address} port {machine.ssh_port}")
        with remote.connect(services.machine_target(machine)) as conn:
            ctx.log(f"Connected to {machine.address}; host key {machine.host_key_fingerprint} matches.")
            preflight = enrolment.agent_put(ctx, conn, build)
            agent = Agent(machine, conn, argv=[preflight.python, preflight.path])
            steps.RESTART_HEARTBEAT.always(ctx)
            running = agent.heartbeat_status()
            if running.running and running.version == build.version:
                # Already the daemon wanted: a new token would only restart it for nothing.
                ctx.detail(f"already runs agent {build.version} (pid {running.pid})")
                restarted = False
            else:
                ctx.log(f"The heartbeat runs agent {running.version or 'unknown'}" if running.running
                        else "The heartbeat is not running")
                started = enrolment.heartbeat_start(ctx, machine=machine, agent=agent, preflight=preflight)
                restarted = True
                ctx.detail(f"agent {build.version}, pid {started.pid}" + (" (restarted)" if started.restarted else ""))
            steps.CHECK_VERSION.always(ctx)
            reported = agent.version()
            heartbeat = agent.heartbeat_status()
    except remote.HostKeyMismatch as exc:
        raise enrolment.host_key_refused(machine_id, exc) from exc
    except remote.RemoteError as exc:
        raise JobError(exc.message, kind=exc.kind) from exc
    if reported != build.version:
        raise JobError(f"The agent at {preflight.path} reports version {reported or 'nothing'}, not {build.version}.",
                       kind=ErrorKind.NOT_RETRYABLE)
    if not heartbeat.running or heartbeat.version != build.version:
        now = f"runs agent {heartbeat.version or 'unknown'}" if heartbeat.running else "is not running"
        raise JobError(f"The heartbeat {now} after its restart, not agent {build.version}; "
                       f"its log on the machine is {posixpath.join(_agent_home(preflight.path), 'heartbeat.log')}.")
    ctx.detail(f"agent {reported}, heartbeat {heartbeat.version} (pid {heartbeat.pid})")
    _agent_recorded(machine_id, version=reported, path=preflight.path, python=preflight.python, before=before)
    if restarted or before != build.version:
        ctx.log(f"Agent {before} → {build.version}; only the heartbeat was restarted, Ray and the runtime run on.")
    else:
        ctx.log(f"Agent {build.version} was installed and running already: nothing to change.")


def _agent_recorded(machine_id: int, *, version: str, path: str, python: str, before: str) -> None:
    """Write the agent the machine now runs (its commands go to the new file from now on) and push its pages."""
    with transaction.atomic():
        machine = Machine.objects.select_for_update(no_key=True).get(pk=machine_id)
        machine.agent_version, machine.agent_path, machine.python_path = version, path, python
        machine.save(update_fields=["agent_version", "agent_path", "python_path"])
        if before != version:
            services.machine_event(machine=machine, kind=EventKind.FACTS, message=f"Agent {before} → {version} (Update agent).")
        services.machine_changed(machine)


def _agent_home(agent_path: str) -> str:
    """``/opt/fadenstack`` for ``/opt/fadenstack/agent/fadenstack-agent-0.3.0.pyz``: where its daemons keep their files."""
    return posixpath.dirname(posixpath.dirname(agent_path))

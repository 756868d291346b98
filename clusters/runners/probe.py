"""The network test: real bytes between the head and every other machine, on every shared network."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.db import connections

from clusters import planning
from clusters.models import NetworkMeasurement
from clusters.selectors import candidates
from console import live
from console.choices import ErrorKind
from console.jobs import JobContext
from machines.agent_client import Agent, AgentError
from machines.models import Machine

PROBE_PORT = 7471


def network_probe_run(ctx: JobContext) -> None:
    machine_ids, head_id = ctx.job.params["machines"], ctx.job.params["head"]
    picked = candidates(machine_ids)
    machines = {m.pk: m for m in Machine.objects.filter(pk__in=machine_ids)}
    head = machines[head_id]
    for network in planning.shared_networks(picked):
        subnet = str(network.subnet)
        ctx.step(subnet, "measuring")
        addresses = {member.machine_id: member.address for member in network.members}
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(
                pool.map(
                    lambda target_id: _measure(subnet, head, machines[target_id], addresses[head_id], addresses[target_id], ctx),
                    [pk for pk in machine_ids if pk != head_id],
                )
            )
        measured = [r for r in results if r is not None]
        ctx.detail(f"{min(measured):.0f} Mbit/s" if len(measured) == len(results) else "not reachable from the head")
        live.push(f"probe:{ctx.job.pk}")


def _measure(subnet: str, head: Machine, target: Machine, head_address: str, target_address: str, ctx) -> float | None:
    """Serve on the target, send from the head for a few seconds; the result goes to the database either way."""
    try:
        server_error: list[str] = []

        def serve() -> None:
            try:
                with Agent.open(target) as agent:
                    agent.probe_serve(bind=target_address, port=PROBE_PORT, seconds=settings.FADEN_PROBE_SECONDS)
            except AgentError as exc:
                server_error.append(exc.message)
            finally:
                connections.close_all()

        server = threading.Thread(target=serve)
        server.start()
        try:
            with Agent.open(head) as agent:
                mbps = _send_when_listening(agent, target_address)
        finally:
            server.join()
        error = ""
    except AgentError as exc:
        mbps, error = None, exc.message
    NetworkMeasurement.objects.update_or_create(
        subnet=subnet, source=head, target=target, defaults={"mbps": mbps, "error": error}
    )
    if error:
        ctx.log(f"{subnet}: {head.name} → {target.name}: {error}")
    else:
        ctx.log(f"{subnet}: {head.name} → {target.name}: {mbps:.0f} Mbit/s")
    live.push(f"probe:{ctx.job.pk}")
    connections.close_all()
    return mbps


def _send_when_listening(agent: Agent, target_address: str) -> float:
    """The target's probe server starts over its own SSH session: try a few times while it comes up."""
    last: AgentError | None = None
    for _ in range(20):
        try:
            return agent.probe_send(to=target_address, port=PROBE_PORT, seconds=settings.FADEN_PROBE_SECONDS)
        except AgentError as exc:
            if exc.kind != ErrorKind.UNREACHABLE:
                raise
            last = exc
            threading.Event().wait(0.25)  # the server's SSH session is still starting
    raise last

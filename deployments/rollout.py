"""The apply job's whole run, and changes that replace copies one at a time.

``apply_run`` goes round ``serving.apply_once`` (stops, claims, files, engines, Serving) until nothing more
was asked of it, and after each round replaces the copies of an older generation (a deployment whose GPUs,
memory, context, options, name or model changed): one new copy is placed and brought to Serving *before* an
old one stops, so the deployment never serves with fewer copies than it had. A replacement that cannot be
placed, or does not serve, ends the rollout there: the old copies keep serving, and the job says why.
"""
from __future__ import annotations

from console.choices import ErrorKind
from console.jobs import JobContext, JobError
from deployments import placement, placement_input, serving
from deployments.asks import ask_of, port_range, slot_json
from deployments.choices import CopyState
from deployments.models import Copy, Deployment


def apply_run(ctx: JobContext, *, deployment_id: int) -> None:
    failures: list[str] = []
    while True:
        failures += serving.apply_once(ctx, deployment_id)
        failures += roll(ctx, deployment_id)
        if not serving.another_round(ctx.job):
            break
    if failures:
        raise JobError("; ".join(failures), kind=ErrorKind.NOT_RETRYABLE)


def copies_record(deployment: Deployment, plan: placement.Plan, *, first: int) -> list[Copy]:
    """A Copy row per copy the plan names: placed ones with their slots, the others Queued with the reason."""
    rows = []
    for number, placed in enumerate(plan.placed, start=first):
        head = placed.slots[0]
        rows.append(Copy(deployment=deployment, number=number, generation=deployment.generation,
                         state=CopyState.QUEUED, state_reason="Waiting for its turn to start.",
                         machine_id=head.machine_id, slots=[slot_json(s) for s in placed.slots], port=head.port))
    for number, unplaced in enumerate(plan.unplaced, start=first + len(plan.placed)):
        rows.append(Copy(deployment=deployment, number=number, generation=deployment.generation,
                         state=CopyState.QUEUED, state_reason=f"Waiting for room: {unplaced.reason}."))
    Copy.objects.bulk_create(rows)
    serving.addresses_fill(deployment)
    return rows


def roll(ctx: JobContext, deployment_id: int) -> list[str]:
    """Replace the older generation's copies, one at a time, each replacement Serving before its old copy stops."""
    deployment = Deployment.objects.select_related("cluster", "model").filter(pk=deployment_id).first()
    if deployment is None or deployment.deleting_since:
        return []
    old = list(deployment.copy_rows.filter(generation__lt=deployment.generation)
               .exclude(state=CopyState.STOPPING).order_by("number"))
    for copy in old:
        if copy.state != CopyState.SERVING:  # it serves nobody: it goes first, its replacement after
            serving.copy_stop_begin(copy)
            serving.stops(deployment)
        last = deployment.copy_rows.order_by("-number").values_list("number", flat=True).first() or 0
        ask = ask_of(deployment, copies=1)
        plan = placement.plan(placement_input.cluster_rooms(deployment.cluster),
                              ask.wanted(1, deployment_id=deployment.pk, first=last + 1), port_range=port_range())
        if plan.unplaced and copy.state == CopyState.SERVING:
            return [f"{copy} keeps serving: its replacement cannot be placed yet ({plan.unplaced[0].reason})"]
        [new] = copies_record(deployment, plan, first=last + 1)
        ctx.log(f"Replacing {copy} with #{new.number}")
        failures = serving.apply_once(ctx, deployment_id)
        new.refresh_from_db()
        if new.state != CopyState.SERVING:
            return failures + [f"#{new.number} did not serve, so {copy} keeps serving"]
        if copy.state == CopyState.SERVING:
            serving.copy_transition(copy, to=CopyState.STOPPING, reason=f"Replaced by #{new.number}.")
            serving.stops(deployment)
    return []

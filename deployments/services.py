"""Every write on deployments: plan, deploy, scale, change, route, delete. Models are written in
``store/services.py``, the gateway's keys in ``gateway_keys.py``."""
from __future__ import annotations

import re
from fractions import Fraction

from django.core.exceptions import ValidationError
from django.db import transaction

from clusters.lifecycle import cluster_locked
from clusters.models import Cluster
from console import roles
from clusters.actions import DECIDE_ENGINE_OPTIONS, DEPLOY, deploy_refusal
from console.audit import audit_record
from console.choices import AuditOutcome
from deployments import actions, engine, placement, placement_input, rollout, serving
from deployments.asks import DeployAsk, ask_of, port_range, slot_json
from deployments.choices import CopyState, ModelState, routing_refusal
from deployments.models import Copy, Deployment, StoredModel
from deployments.store import disk

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,62}$")
COPIES_MAX = 256
GPU_QUARTERS = (1, 2, 4, 8, 16, 32, 64, 128)
WHOLE_GPU_SHARE = 0.9  # of a whole GPU's memory, suggested for a copy that has the GPU to itself


def deployment_ask_problems(ask: DeployAsk, *, deployment: Deployment | None = None, user=None) -> dict[str, str]:
    """Each field of the ask that is refused, with why in words (empty when it may go ahead).

    The engine options pass the allowlist for ``user``'s role (an Administrator may add the options that run
    code or read files); a deployment's options that an Administrator gave are kept through an Operator's edit."""
    problems: dict[str, str] = {}
    if not NAME_RE.match(ask.name or ""):
        problems["name"] = ("A name clients use: 1 to 63 letters, digits and . _ : / -, starting with a letter or "
                            "a digit (llama-3-8b, team/chat).")
    elif orphan := Deployment.objects.filter(name=ask.name, orphaned_at__isnull=False).exclude(
            pk=getattr(deployment, "pk", None)).select_related("cluster").first():
        problems["name"] = (f"A model running on {orphan.cluster.name} without a deployment answers under {ask.name}: "
                            "take it over (keep it, or delete it properly) on the cluster's page first.")
    elif Deployment.objects.filter(name=ask.name).exclude(pk=getattr(deployment, "pk", None)).exists():
        problems["name"] = f"A deployment is named {ask.name} already: the gateway routes each name to one deployment."
    if ask.model.state != ModelState.READY and ask.model.state != ModelState.DOWNLOADING:
        problems["model"] = f"{ask.model} is {ask.model.get_state_display().lower()}: try its download again first."
    if not 0 <= ask.copies <= COPIES_MAX:
        problems["copies"] = f"From 0 to {COPIES_MAX} copies."
    if ask.gpu_quarters not in GPU_QUARTERS:
        problems["gpu_quarters"] = "A copy takes a quarter of a GPU, half a GPU, or 1, 2, 4, 8, 16 or 32 GPUs."
    if not 0 < ask.memory_per_gpu_mib <= (ask.gpu_memory_mib or 0):
        problems["memory_per_gpu_mib"] = (f"The GPU memory per GPU must be more than 0 and at most the GPU's "
                                          f"{disk.gb(ask.gpu_memory_mib * placement_input.MIB)}.")
    elif ask.gpu_quarters < 4 and ask.memory_per_gpu_mib > ask.gpu_memory_mib * ask.gpu_quarters / 4:
        problems["memory_per_gpu_mib"] = ("A share of a GPU may use at most that share of its memory "
                                          f"({disk.gb(ask.gpu_memory_mib * placement_input.MIB * ask.gpu_quarters // 4)}).")
    longest = int(ask.model.facts.get("context_length") or 0)
    if ask.context_length < 16 or (longest and ask.context_length > longest):
        problems["context_length"] = (f"The context length must be from 16 to the model's {longest:,} tokens." if longest
                                      else "The context length must be at least 16 tokens.")
    if problem := engine.options_problem(
            list(ask.engine_options), administrator=DECIDE_ENGINE_OPTIONS.offer(roles.acting(user)).ok,
            kept=deployment.engine_options if deployment is not None else ()):
        problems["engine_options"] = problem
    if refusal := routing_refusal(ask.routing):
        problems["routing"] = refusal
    return problems


def deployment_suggestion(*, cluster: Cluster, model: StoredModel) -> dict:
    """What the form fills in: the GPU kind with the most free GPUs on the cluster, the fewest of them that
    hold the model's weights plus the KV cache's share, the memory per GPU, and the model's context."""
    kinds = placement.kinds(placement_input.cluster_rooms(cluster))
    need = int(model.facts.get("gpu_memory_bytes") or 0)
    suggestion = {"kinds": kinds, "need_bytes": need, "context_length": int(model.facts.get("context_length") or 4096)}
    if not kinds:
        return suggestion
    kind = kinds[0]
    gpus = placement.suggest_gpus(need, kind.kind) if need else Fraction(1)
    quarters = int((gpus or Fraction(1)) * 4)
    gpu_mib = kind.kind.memory_bytes // placement_input.MIB
    # A share of a GPU is given what the model needs; whole GPUs are the copy's alone, so most of their memory.
    memory = -(-need // placement_input.MIB) if quarters < 4 else int(gpu_mib * WHOLE_GPU_SHARE)
    return suggestion | {"kind": kind, "gpu_quarters": quarters, "memory_per_gpu_mib": memory, "fits": gpus is not None}


def deployment_plan(ask: DeployAsk) -> placement.Plan:
    """Where each copy would go, and why those that cannot go cannot (nothing is written)."""
    return placement.plan(placement_input.cluster_rooms(ask.cluster), ask.wanted(ask.copies), port_range=port_range())


def deployment_create(*, ask: DeployAsk, queue_rest: bool = False, user=None) -> Deployment:
    """Record the deployment and its copies where the plan puts them, and start them.

    Copies that do not fit are refused, unless ``queue_rest``: then they wait, Queued with the plan's
    reason, and start once room appears."""
    DEPLOY.offer(roles.acting(user)).check()
    if problems := deployment_ask_problems(ask, user=user):
        raise ValidationError(problems)
    with transaction.atomic():
        cluster = cluster_locked(ask.cluster)
        if refusal := deploy_refusal(cluster):
            raise ValidationError(refusal)
        if refusal := actions.copies_agents_refusal(cluster):
            raise ValidationError(refusal)
        plan = deployment_plan(ask)
        if plan.unplaced and not queue_rest:
            raise ValidationError(plan_refusal(plan, ask.copies))
        deployment = Deployment.objects.create(
            name=ask.name, cluster=cluster, model=ask.model, copies=ask.copies, gpu_quarters=ask.gpu_quarters,
            gpu_vendor=ask.vendor, gpu_model=ask.gpu_model, gpu_memory_mib=ask.gpu_memory_mib, arch=ask.arch,
            memory_per_gpu_mib=ask.memory_per_gpu_mib, context_length=ask.context_length, routing=ask.routing,
            engine_options=list(ask.engine_options), created_by=user if user is not None and user.is_authenticated else None)
        rollout.copies_record(deployment, plan, first=1)
        serving.apply_start(deployment, user=user)
        _audit_decided(deployment, ask.engine_options, kept=(), user=user)
    serving.deployment_changed(deployment)
    return deployment


def _audit_decided(deployment: Deployment, options, *, kept, user) -> None:
    """An entry ``deployment.engine_options`` naming the Administrator's flags the ask adds, if any."""
    if added := [flag for flag in engine.options_decided(options) if flag not in engine.options_decided(kept)]:
        audit_record(action="deployment.engine_options", outcome=AuditOutcome.DONE, user=user,
                     target=f"deployment {deployment.name}",
                     message=f"Engine options given by an Administrator: {', '.join(added)}.")


def plan_refusal(plan: placement.Plan, copies: int) -> str:
    fit = copies - len(plan.unplaced)
    reasons = "; ".join(dict.fromkeys(u.reason for u in plan.unplaced))
    return (f"{fit} of {copies} copies fit: {reasons}. Deploy the copies that fit and queue the rest, or ask for "
            "fewer or smaller copies.")


def deployment_scale(*, deployment: Deployment, copies: int, user=None) -> Deployment:
    """Start or stop only the difference: the copies already running are not touched. More copies than
    fit are queued with the reason (a person asked for them; they start when room appears)."""
    DEPLOY.offer(roles.acting(user)).check()
    if not 0 <= copies <= COPIES_MAX:
        raise ValidationError({"copies": f"From 0 to {COPIES_MAX} copies."})
    with transaction.atomic():
        cluster_locked(deployment.cluster)
        deployment = Deployment.objects.select_for_update(no_key=True).get(pk=deployment.pk)
        have = list(deployment.copy_rows.exclude(state__in=(CopyState.STOPPING,)).order_by("number"))
        if copies > len(have):
            ask = ask_of(deployment, copies=copies - len(have))
            last = deployment.copy_rows.order_by("-number").values_list("number", flat=True).first() or 0
            plan = placement.plan(placement_input.cluster_rooms(deployment.cluster),
                                  ask.wanted(ask.copies, deployment_id=deployment.pk, first=last + 1), port_range=port_range())
            rollout.copies_record(deployment, plan, first=last + 1)
        elif copies < len(have):
            # The newest go first, those not yet serving before serving ones.
            order = sorted(have, key=lambda c: (c.state == CopyState.SERVING, -c.number))
            for copy in order[:len(have) - copies]:
                serving.copy_stop_begin(copy)
        Deployment.objects.filter(pk=deployment.pk).update(copies=copies)
        deployment.copies = copies
        serving.apply_start(deployment, user=user)
    serving.deployment_changed(deployment)
    return deployment


CHANGED_FIELDS = {"model": "model", "name": "name", "gpu_quarters": "gpu_quarters", "vendor": "gpu_vendor",
                  "gpu_model": "gpu_model", "gpu_memory_mib": "gpu_memory_mib", "arch": "arch",
                  "memory_per_gpu_mib": "memory_per_gpu_mib", "context_length": "context_length",
                  "engine_options": "engine_options"}


def deployment_changes(deployment: Deployment, ask: DeployAsk) -> dict:
    """The deployment's columns the ask changes, with their new values (the copies aside: a new number of
    copies only scales); empty when nothing would be replaced."""
    return {column: value for field, column in CHANGED_FIELDS.items()
            if (value := list(getattr(ask, field)) if field == "engine_options" else getattr(ask, field))
            != getattr(deployment, column)}


def deployment_change_plan(*, deployment: Deployment, ask: DeployAsk) -> list[tuple[Copy, placement.Placement | placement.Unplaced]]:
    """Each copy with where its replacement would go, as the rollout places them (``rollout.roll``): one at a
    time, beside the old copies still serving, an old copy's room given back once its replacement serves (a
    copy that serves nobody gives it back first). The rollout stops at a replacement that cannot be placed:
    the copies after it are not replaced. Nothing is written."""
    old = list(deployment.copy_rows.exclude(state=CopyState.STOPPING).order_by("number"))
    last = max((c.number for c in old), default=0)
    given_back: list[int] = []  # old copies whose room is free by then
    added: list[tuple[list[dict], int, int]] = []  # the replacements placed so far
    plan: list[tuple[Copy, placement.Placement | placement.Unplaced]] = []
    stopped_at = None
    for n, copy in enumerate(old, start=1):
        if stopped_at is not None:
            plan.append((copy, placement.Unplaced(key=f"c{last + n}", reason=f"Not replaced: the change stops at "
                                                  f"#{stopped_at.number}, whose replacement cannot be placed.")))
            continue
        if copy.state != CopyState.SERVING:
            given_back.append(copy.pk)
        room = placement_input.cluster_rooms(deployment.cluster, leaving_out=given_back, adding=added)
        step = placement.plan(room, ask.wanted(1, deployment_id=deployment.pk, first=last + n), port_range=port_range())
        if step.placed:
            added.append(([slot_json(s) for s in step.placed[0].slots], deployment.pk, ask.memory_per_gpu_mib))
            given_back.append(copy.pk)
        else:
            stopped_at = copy
        plan.append((copy, (step.placed or step.unplaced)[0]))
    return plan


def deployment_change(*, deployment: Deployment, ask: DeployAsk, user=None) -> Deployment:
    """Change a deployment: a new number of copies starts or stops only the difference, a new routing is the
    gateway's alone (no copy restarts); any other change (model, name, GPUs, memory, context, options) replaces
    its copies one at a time, each new copy Serving before an old one stops (``rollout.roll``)."""
    DEPLOY.offer(roles.acting(user)).check()
    if ask.cluster.pk != deployment.cluster_id:
        raise ValidationError({"cluster": "A deployment stays on its cluster: deploy the model on the other one."})
    if problems := deployment_ask_problems(ask, deployment=deployment, user=user):
        raise ValidationError(problems)
    with transaction.atomic():
        cluster_locked(deployment.cluster)
        current = Deployment.objects.select_for_update(no_key=True).get(pk=deployment.pk)
        if current.deleting_since:
            raise ValidationError(f"{current.name} is being deleted.")
        if changes := deployment_changes(current, ask):
            Deployment.objects.filter(pk=current.pk).update(generation=current.generation + 1, **changes)
            serving.apply_start(current, user=user)
            _audit_decided(current, ask.engine_options, kept=current.engine_options, user=user)
        if ask.routing != current.routing:
            Deployment.objects.filter(pk=current.pk).update(routing=ask.routing)
    if ask.copies != current.copies:
        deployment_scale(deployment=Deployment.objects.get(pk=current.pk), copies=ask.copies, user=user)
    current = Deployment.objects.get(pk=current.pk)
    serving.deployment_changed(current)
    return current


def deployment_route(*, deployment: Deployment, routing: str, user=None) -> Deployment:
    """How the gateway picks the deployment's copy for a request (``choices.Routing``): its processes read it
    within FADEN_GATEWAY_REFRESH seconds; no copy restarts."""
    DEPLOY.offer(roles.acting(user)).check()
    if refusal := routing_refusal(routing):
        raise ValidationError({"routing": refusal})
    with transaction.atomic():
        current = Deployment.objects.select_for_update(no_key=True).get(pk=deployment.pk)
        if current.deleting_since:
            raise ValidationError(f"{current.name} is being deleted.")
        if current.routing != routing:
            Deployment.objects.filter(pk=current.pk).update(routing=routing)
            current.routing = routing
    serving.deployment_changed(current)
    return current


def deployment_delete(*, deployment: Deployment, user=None) -> serving.Deleted:
    """Stop its copies and free their GPUs, then the record goes. When the cluster cannot be reached the
    record goes at once, and the page says its copies may still run on the machines."""
    DEPLOY.offer(roles.acting(user)).check()
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update(no_key=True).get(pk=deployment.pk)
        return serving.delete_start(deployment, user=user)

"""Every write on models (add one, try a failed download again, delete one, copy its files to machines), on
deployments (plan, deploy, scale, delete) and on the gateway's keys (create one, revoke one)."""
from __future__ import annotations

import re
import shutil
from fractions import Fraction

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from clusters.choices import ClusterState
from clusters.lifecycle import cluster_locked
from clusters.models import Cluster
from clusters.selectors import cluster_busy
from console import roles
from console.jobs import job_start
from console.models import Job
from deployments import actions, copies, downloads, engine, hub, placement, rollout, rooms, selectors, serving, store
from deployments.asks import DeployAsk, ask_of, port_range, slot_json
from deployments.choices import CopyState, ModelState
from deployments.gateway import keys as gateway_keys
from deployments.models import Copy, Deployment, GatewayKey, ModelFile, StoredModel

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,62}$")
COPIES_MAX = 256
GPU_QUARTERS = (1, 2, 4, 8, 16, 32, 64, 128)
WHOLE_GPU_SHARE = 0.9  # of a whole GPU's memory, suggested for a copy that has the GPU to itself


def model_add(*, repo: str, revision: str = "main", user=None) -> StoredModel:
    """Record the model and start its download; the same repository and revision twice is refused."""
    actions.ADD.offer(roles.acting(user)).check()
    repo, revision = (repo or "").strip(), (revision or "").strip() or "main"
    if problem := hub.repo_problem(repo):
        raise ValidationError({"repo": problem})
    if problem := hub.revision_problem(revision):
        raise ValidationError({"revision": problem})
    with transaction.atomic():
        existing = StoredModel.objects.filter(repo=repo, revision=revision).first()
        if existing is not None:
            raise ValidationError({"repo": f"The store has {existing} already ({existing.get_state_display()})."})
        model = StoredModel.objects.create(repo=repo, revision=revision, created_by=_user(user))
        _download_start(model, user)
    return model


def model_retry(model: StoredModel, *, user=None) -> Job:
    """Download a failed model again: files already in the store and partial files are kept."""
    actions.RETRY.offer(roles.acting(user)).check()
    with transaction.atomic():
        model = StoredModel.objects.select_for_update(no_key=True).get(pk=model.pk)
        if model.state != ModelState.FAILED:
            raise ValidationError(f"{model} is {model.get_state_display().lower()}: only a failed download is tried again.")
        downloads.model_transition(model, to=ModelState.DOWNLOADING)
        job = _download_start(model, user)
    downloads.model_changed(model)
    return job


def model_delete(model: StoredModel, *, user=None) -> None:
    """Delete the model's record, its tree, and the store's files no other model uses."""
    actions.DELETE.offer(roles.acting(user)).check()
    with transaction.atomic():
        model = StoredModel.objects.select_for_update(no_key=True).get(pk=model.pk)
        if refusal := actions.model_delete_refusal(model):
            raise ValidationError(refusal)
        repo, commit, pk = model.repo, model.commit, model.pk
        model.delete()
    if commit:
        store.tree_remove(repo, commit)
    store.unused_blobs_remove(set(ModelFile.objects.exclude(sha256="").values_list("sha256", flat=True)))
    shutil.rmtree(store.downloads_dir(pk), ignore_errors=True)
    downloads.model_changed(pk)


def _download_start(model: StoredModel, user) -> Job:
    return job_start(kind=downloads.KIND, title=f"Download {model}", target_type="model", target_id=model.pk,
                     steps=downloads.STEPS, user=user)


def _user(user):
    return user if user is not None and user.is_authenticated else None


# -- copies on a cluster's machines ------------------------------------------------------------------


def model_copy(model: StoredModel, cluster, *, user=None) -> Job:
    """Put the model's files on the cluster's machines (ahead of a deployment, or for one)."""
    actions.COPY.offer(roles.acting(user)).check()
    with transaction.atomic():
        model = StoredModel.objects.select_for_update(no_key=True).get(pk=model.pk)
        if model.state != ModelState.READY:
            raise ValidationError(f"{model} is {model.get_state_display().lower()}: its files are not all in the store yet.")
        if cluster.state not in (ClusterState.RUNNING, ClusterState.STOPPED):
            raise ValidationError(f"{cluster.name} is {cluster.get_state_display().lower()}: models are copied to the "
                                  "machines of a running or stopped cluster.")
        if busy := cluster_busy(cluster):
            raise ValidationError(f"{cluster.name} is busy ({busy.title}): wait for it to end.")
        if refusal := actions.agents_refusal(cluster):
            raise ValidationError(refusal)
        return job_start(kind=copies.KIND, title=f"Copy {model} to {cluster.name}'s machines", target_type="cluster",
                         target_id=cluster.pk, steps=copies.copy_steps(cluster), user=user, params={"model": model.pk})


def model_remove_from_machines(model: StoredModel, machine_ids: list[int] | None = None, *, user=None) -> Job:
    """Remove the model's files from the machines that hold them (all, or those named)."""
    actions.REMOVE.offer(roles.acting(user)).check()
    with transaction.atomic():
        held = model.holdings.all() if machine_ids is None else model.holdings.filter(machine_id__in=machine_ids)
        ids = list(held.values_list("machine_id", flat=True))
        if not ids:
            raise ValidationError(f"No machine{' of those' if machine_ids else ''} holds {model}'s files.")
        if busy := selectors.model_active_job(model):
            raise ValidationError(f"{model} has a job running ({busy.title}): wait for it to end.")
        return job_start(kind=copies.REMOVE_KIND, title=f"Remove {model} from {len(ids)} machine{'s' if len(ids) > 1 else ''}",
                         target_type="model", target_id=model.pk, steps=(copies.REMOVE,), user=user,
                         params={"machines": ids})


# -- deployments -------------------------------------------------------------------------------------


def deployment_ask_problems(ask: DeployAsk, *, deployment: Deployment | None = None) -> dict[str, str]:
    """Each field of the ask that is refused, with why in words (empty when it may go ahead)."""
    problems: dict[str, str] = {}
    if not NAME_RE.match(ask.name or ""):
        problems["name"] = ("A name clients use: 1 to 63 letters, digits and . _ : / -, starting with a letter or "
                            "a digit (llama-3-8b, team/chat).")
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
                                          f"{store.gb(ask.gpu_memory_mib * rooms.MIB)}.")
    elif ask.gpu_quarters < 4 and ask.memory_per_gpu_mib > ask.gpu_memory_mib * ask.gpu_quarters / 4:
        problems["memory_per_gpu_mib"] = ("A share of a GPU may use at most that share of its memory "
                                          f"({store.gb(ask.gpu_memory_mib * rooms.MIB * ask.gpu_quarters // 4)}).")
    longest = int(ask.model.facts.get("context_length") or 0)
    if ask.context_length < 16 or (longest and ask.context_length > longest):
        problems["context_length"] = (f"The context length must be from 16 to the model's {longest:,} tokens." if longest
                                      else "The context length must be at least 16 tokens.")
    if problem := engine.options_problem(list(ask.engine_options)):
        problems["engine_options"] = problem
    return problems


def deployment_suggestion(*, cluster: Cluster, model: StoredModel) -> dict:
    """What the form fills in: the GPU kind with the most free GPUs on the cluster, the fewest of them that
    hold the model's weights plus the KV cache's share, the memory per GPU, and the model's context."""
    kinds = placement.kinds(rooms.cluster_rooms(cluster))
    need = int(model.facts.get("gpu_memory_bytes") or 0)
    suggestion = {"kinds": kinds, "need_bytes": need, "context_length": int(model.facts.get("context_length") or 4096)}
    if not kinds:
        return suggestion
    kind = kinds[0]
    gpus = placement.suggest_gpus(need, kind.kind) if need else Fraction(1)
    quarters = int((gpus or Fraction(1)) * 4)
    gpu_mib = kind.kind.memory_bytes // rooms.MIB
    # A share of a GPU is given what the model needs; whole GPUs are the copy's alone, so most of their memory.
    memory = -(-need // rooms.MIB) if quarters < 4 else int(gpu_mib * WHOLE_GPU_SHARE)
    return suggestion | {"kind": kind, "gpu_quarters": quarters, "memory_per_gpu_mib": memory, "fits": gpus is not None}


def deployment_plan(ask: DeployAsk) -> placement.Plan:
    """Where each copy would go, and why those that cannot go cannot (nothing is written)."""
    return placement.plan(rooms.cluster_rooms(ask.cluster), ask.wanted(ask.copies), port_range=port_range())


def deployment_create(*, ask: DeployAsk, queue_rest: bool = False, user=None) -> Deployment:
    """Record the deployment and its copies where the plan puts them, and start them.

    Copies that do not fit are refused, unless ``queue_rest``: then they wait, Queued with the plan's
    reason, and start once room appears."""
    actions.DEPLOY.offer(roles.acting(user)).check()
    if problems := deployment_ask_problems(ask):
        raise ValidationError(problems)
    with transaction.atomic():
        cluster = cluster_locked(ask.cluster)
        if cluster.state != ClusterState.RUNNING:
            raise ValidationError(f"{cluster.name} is {cluster.get_state_display().lower()}: models are deployed on a "
                                  "running cluster.")
        if refusal := actions.copies_agents_refusal(cluster):
            raise ValidationError(refusal)
        plan = deployment_plan(ask)
        if plan.unplaced and not queue_rest:
            raise ValidationError(plan_refusal(plan, ask.copies))
        deployment = Deployment.objects.create(
            name=ask.name, cluster=cluster, model=ask.model, copies=ask.copies, gpu_quarters=ask.gpu_quarters,
            gpu_vendor=ask.vendor, gpu_model=ask.gpu_model, gpu_memory_mib=ask.gpu_memory_mib, arch=ask.arch,
            memory_per_gpu_mib=ask.memory_per_gpu_mib, context_length=ask.context_length,
            engine_options=list(ask.engine_options), created_by=_user(user))
        rollout.copies_record(deployment, plan, first=1)
        serving.apply_start(deployment, user=user)
    serving.deployment_changed(deployment)
    return deployment


def plan_refusal(plan: placement.Plan, copies: int) -> str:
    fit = copies - len(plan.unplaced)
    reasons = "; ".join(dict.fromkeys(u.reason for u in plan.unplaced))
    return (f"{fit} of {copies} copies fit: {reasons}. Deploy the copies that fit and queue the rest, or ask for "
            "fewer or smaller copies.")


def deployment_scale(*, deployment: Deployment, copies: int, user=None) -> Deployment:
    """Start or stop only the difference: the copies already running are not touched. More copies than
    fit are queued with the reason (a person asked for them; they start when room appears)."""
    actions.DEPLOY.offer(roles.acting(user)).check()
    if not 0 <= copies <= COPIES_MAX:
        raise ValidationError({"copies": f"From 0 to {COPIES_MAX} copies."})
    with transaction.atomic():
        cluster_locked(deployment.cluster)
        deployment = Deployment.objects.select_for_update(no_key=True).get(pk=deployment.pk)
        have = list(deployment.copy_rows.exclude(state__in=(CopyState.STOPPING,)).order_by("number"))
        if copies > len(have):
            ask = ask_of(deployment, copies=copies - len(have))
            last = deployment.copy_rows.order_by("-number").values_list("number", flat=True).first() or 0
            plan = placement.plan(rooms.cluster_rooms(deployment.cluster),
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
        room = rooms.cluster_rooms(deployment.cluster, leaving_out=given_back, adding=added)
        step = placement.plan(room, ask.wanted(1, deployment_id=deployment.pk, first=last + n), port_range=port_range())
        if step.placed:
            added.append(([slot_json(s) for s in step.placed[0].slots], deployment.pk, ask.memory_per_gpu_mib))
            given_back.append(copy.pk)
        else:
            stopped_at = copy
        plan.append((copy, (step.placed or step.unplaced)[0]))
    return plan


def deployment_change(*, deployment: Deployment, ask: DeployAsk, user=None) -> Deployment:
    """Change a deployment: a new number of copies starts or stops only the difference; any other change
    (model, name, GPUs, memory, context, options) replaces its copies one at a time, each new copy Serving
    before an old one stops (``rollout.roll``)."""
    actions.DEPLOY.offer(roles.acting(user)).check()
    if ask.cluster.pk != deployment.cluster_id:
        raise ValidationError({"cluster": "A deployment stays on its cluster: deploy the model on the other one."})
    if problems := deployment_ask_problems(ask, deployment=deployment):
        raise ValidationError(problems)
    with transaction.atomic():
        cluster_locked(deployment.cluster)
        current = Deployment.objects.select_for_update(no_key=True).get(pk=deployment.pk)
        if current.deleting_since:
            raise ValidationError(f"{current.name} is being deleted.")
        if changes := deployment_changes(current, ask):
            Deployment.objects.filter(pk=current.pk).update(generation=current.generation + 1, **changes)
            serving.apply_start(current, user=user)
    if ask.copies != current.copies:
        deployment_scale(deployment=Deployment.objects.get(pk=current.pk), copies=ask.copies, user=user)
    current = Deployment.objects.get(pk=current.pk)
    serving.deployment_changed(current)
    return current


def deployment_delete(*, deployment: Deployment, user=None) -> serving.Deleted:
    """Stop its copies and free their GPUs, then the record goes. When the cluster cannot be reached the
    record goes at once, and the page says its copies may still run on the machines."""
    actions.DEPLOY.offer(roles.acting(user)).check()
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update(no_key=True).get(pk=deployment.pk)
        return serving.delete_start(deployment, user=user)
# -- the gateway's keys ------------------------------------------------------------------------------

KEY_NAME_MAX = 100


def gateway_key_create(*, name: str, deployments: list[str] | None = None, user=None) -> tuple[GatewayKey, str]:
    """A new key for the gateway, and its secret: returned here once, stored only as its sha256.

    ``deployments`` limits it to those names (each must be a deployment's); None or empty: every one.
    The caller shows the secret to the person who asked and forgets it: never log it or put it in a
    message (messages are the audit trail's words)."""
    actions.KEY_CREATE.offer(roles.acting(user)).check()
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "Name the key: what or who it is for, such as a team or an application."})
    if len(name) > KEY_NAME_MAX or not name.isprintable():
        raise ValidationError({"name": f"A key's name is at most {KEY_NAME_MAX} printable characters."})
    names = gateway_key_deployments_check(deployments)
    secret = gateway_keys.key_new()
    key = GatewayKey.objects.create(name=name, prefix=gateway_keys.key_prefix(secret),
                                    key_hash=gateway_keys.key_hash(secret), deployments=names, created_by=_user(user))
    return key, secret


def gateway_key_deployments_check(deployments) -> list[str]:
    """The deployment names a key is limited to, each once, in order; ValidationError naming any that
    is not a deployment's."""
    if not deployments:
        return []
    if not isinstance(deployments, (list, tuple)) or not all(isinstance(n, str) for n in deployments):
        raise ValidationError({"deployments": "Give the names of deployments, as clients use them."})
    names = list(dict.fromkeys(n.strip() for n in deployments if n.strip()))
    known = set(Deployment.objects.filter(name__in=names).values_list("name", flat=True))
    if unknown := [n for n in names if n not in known]:
        raise ValidationError({"deployments": f"No deployment is named {', '.join(repr(n) for n in unknown[:5])}"
                                              f"{' and more' if len(unknown) > 5 else ''}."})
    return names


def gateway_key_revoke(*, key: GatewayKey, user=None) -> GatewayKey:
    """Revoke the key: the gateway refuses it within a second. The row stays, for the record; revoking
    a revoked key changes nothing."""
    actions.KEY_REVOKE.offer(roles.acting(user)).check()
    GatewayKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now(), revoked_by=_user(user))
    key.refresh_from_db(fields=["revoked_at", "revoked_by"])
    return key

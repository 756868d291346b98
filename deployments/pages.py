"""What the deployments' pages show, for a request or a websocket push, for the viewer's role."""
from __future__ import annotations

from django.core.paginator import Paginator
from django.template.loader import render_to_string

from clusters.models import ClusterMember, Transfer
from clusters.pages import transfer_bars
from console import roles
from console.offers import Offer
from clusters.actions import DEPLOY
from deployments import charts, placement, placement_input, selectors, serving
from deployments.choices import ROUTING_HELP, CopyState, Routing
from deployments.gateway import traffic
from deployments.models import Deployment


# -- deployments ---------------------------------------------------------------------------------------

# The routings the Deploy form and a deployment's Routing card offer: (value, label, what it does).
ROUTINGS = [(routing.value, routing.label, ROUTING_HELP[routing]) for routing in Routing]


def deployments_page(role: roles.Role | None, page_number: int | None = None) -> dict:
    """The Deployments list, 50 a page, each with its copies by state and its traffic at the gateway."""
    page = Paginator(selectors.deployments_counted(), 50).get_page(page_number)
    figures = traffic.traffic([d.pk for d in page])
    return {"page": page, "rows": [{"deployment": d, "figures": figures.get(d.pk)} for d in page],
            "deploy": DEPLOY.offer(role), "role": role}


def deploy_form_page(*, cluster, model, role: roles.Role | None, values: dict | None = None) -> dict:
    """The Deploy a model form: the running clusters, the models in the store, and what is suggested for
    the chosen pair (the values a person typed win over the suggestion)."""
    from deployments.forms import GPU_CHOICES, kind_value
    from deployments.services import deployment_suggestion

    suggestion = deployment_suggestion(cluster=cluster, model=model) if cluster and model else {}
    kinds = [(kind_value(k.kind.vendor, k.kind.model, k.kind.memory_bytes // placement_input.MIB, k.arch), k)
             for k in suggestion.get("kinds", [])]
    initial = {}
    if suggestion.get("kind"):
        initial = {"kind": kinds[0][0], "gpu_quarters": suggestion["gpu_quarters"],
                   "memory_per_gpu_gib": round(suggestion["memory_per_gpu_mib"] / 1024, 1),
                   "context_length": suggestion["context_length"], "name": _free_name(model.repo.rsplit("/", 1)[-1].lower()[:60]),
                   "copies": 1}
    return {
        "clusters": selectors.deploy_clusters(), "models": selectors.deploy_models(), "cluster": cluster, "model": model,
        "suggestion": suggestion, "kinds": kinds, "gpu_choices": GPU_CHOICES, "routings": ROUTINGS,
        "values": initial | {k: v for k, v in (values or {}).items() if v not in (None, "")},
        "deploy": DEPLOY.offer(role), "role": role,
    }


def _free_name(base: str) -> str:
    """The model's name, or with -2, -3 … when a deployment has it already (names are unique at the gateway)."""
    taken = set(Deployment.objects.filter(name__startswith=base).values_list("name", flat=True))
    return next(name for name in (base, *(f"{base}-{n}" for n in range(2, 1000))) if name not in taken)


def plan_rows(plan, names: dict[int, str]) -> list[dict]:
    """The plan as the page shows it: each copy, where it goes or why it cannot."""
    rows = [{"number": n, "machine": names.get(p.slots[0].machine_id, "?"), "slots": _slot_rows(p, names)}
            for n, p in enumerate(plan.placed, start=1)]
    rows += [{"number": n, "reason": u.reason} for n, u in enumerate(plan.unplaced, start=len(plan.placed) + 1)]
    return rows


def _slot_rows(placed, names: dict[int, str]) -> list[dict]:
    return [{"machine": names.get(s.machine_id, "?"), "gpus": list(s.gpu_indices), "share": s.share, "port": s.port}
            for s in placed.slots]


def deployment_page(deployment, role: roles.Role | None) -> dict:
    copies = list(deployment.copy_rows.select_related("machine"))
    copies_bars(deployment, copies)
    return {
        "deployment": deployment, "copies": copies, "serving": sum(1 for c in copies if c.state == CopyState.SERVING),
        "job": serving.active_job(deployment), "jobs": selectors.deployment_jobs(deployment),
        "gpus_per_copy": deployment.gpus_label, "deploy": DEPLOY.offer(role), "role": role, "routings": ROUTINGS,
    }


def copies_bars(deployment, copies) -> None:
    """Give each copy getting the model's files (Copying the model) ``machine_bars``: for each machine of its
    slots, its name and the bar of the model's files on their way there, as the cluster's page draws it (the
    model's Transfer rows on that machine; none yet while the machine waits for its turn)."""
    copying = [c for c in copies if c.state == CopyState.COPYING]
    machine_ids = {slot["machine"] for c in copying for slot in c.slots}
    if not machine_ids:
        return
    members = {m.machine_id: m for m in ClusterMember.objects.filter(cluster_id=deployment.cluster_id, machine_id__in=machine_ids)
               .select_related("machine")}
    transfers: dict[int, list] = {}
    for t in Transfer.objects.filter(member__in=members.values(), what=str(deployment.model)).order_by("digest"):
        transfers.setdefault(t.member_id, []).append(t)
    for copy in copying:
        copy.machine_bars = [{"machine": m.machine.name, "bars": transfer_bars(transfers.get(m.pk, []))}
                             for slot in copy.slots if (m := members.get(slot["machine"])) is not None]


def deployment_traffic(deployment) -> dict:
    """The Traffic card: the deployment's figures at the gateway (None when Redis gave none). Not part of the
    pushed render: the figures change in Redis, with nothing in the database to push on; the page polls them."""
    return {"deployment": deployment, "figures": traffic.traffic([deployment.pk]).get(deployment.pk)}


def deployment_gateway_charts(deployment) -> dict:
    """The charts' gateway side: the deployment's traffic minute by minute over the last hour. Polled like the
    Traffic card (its figures are in Redis, with nothing to push)."""
    return {"deployment": deployment, "gateway": charts.gateway_charts(deployment.pk)}


def deployment_engine_charts(deployment) -> dict:
    """The charts' engines side: what the copies' engines said at each health check, over the last hour.
    Pushed (part ``engine``) when a check has written new samples."""
    return {"deployment": deployment, "engine": charts.engine_charts(deployment)}


def deployment_change_page(deployment, *, role: roles.Role | None, values: dict | None = None) -> dict:
    """A deployment's Change form, filled with what it has now (the values a person sent win). Its own GPU kind
    is offered with the values the deployment holds, so that a form sent back as it came changes nothing."""
    from deployments.forms import GPU_CHOICES, gib_shown, kind_value

    own = kind_value(deployment.gpu_vendor, deployment.gpu_model, deployment.gpu_memory_mib, deployment.arch)
    own_kind = placement_input.deployment_kind(deployment)
    found = placement.kinds(placement_input.cluster_rooms(deployment.cluster))
    kinds = [(own if (k.kind, k.arch) == (own_kind, deployment.arch) else
              kind_value(k.kind.vendor, k.kind.model, k.kind.memory_bytes // placement_input.MIB, k.arch), k) for k in found]
    if not any(value == own for value, _ in kinds):  # no machine of its kind is up: it is still its kind
        kinds.insert(0, (own, placement.KindFree(kind=own_kind, arch=deployment.arch, machines=0, gpus=0, free=0)))
    now = {"kind": own, "gpu_quarters": deployment.gpu_quarters, "memory_per_gpu_gib": gib_shown(deployment.memory_per_gpu_mib),
           "context_length": deployment.context_length, "engine_options": " ".join(deployment.engine_options)}
    return {
        "deployment": deployment, "cluster": deployment.cluster, "model": deployment.model, "kinds": kinds,
        "gpu_choices": GPU_CHOICES, "suggestion": {}, "values": now | {k: v for k, v in (values or {}).items() if v is not None},
        "deploy": DEPLOY.offer(role).then(Offer(not deployment.deleting_since, f"{deployment.name} is being deleted.")),
        "role": role,
    }


def change_plan_rows(plan, names: dict[int, str]) -> list[dict]:
    """The change's plan as the page shows it: each copy, where its replacement goes or why it cannot."""
    return [{"number": f"#{copy.number}", "reason": p.reason} if isinstance(p, placement.Unplaced) else
            {"number": f"#{copy.number}", "slots": _slot_rows(p, names)} for copy, p in plan]


def render_deployments_topic(arg: str, part: str, role: roles.Role) -> list[str]:
    return [render_to_string("deployments/deployment_list.html#rows", deployments_page(role) | {"oob": True})]


def render_deployment_topic(arg: str, part: str, role: roles.Role) -> list[str]:
    deployment = Deployment.objects.shown().select_related("cluster", "model").filter(pk=int(arg)).first()
    if deployment is None:  # deleted, or its copies run without a deployment now
        return [render_to_string("deployments/deployment_detail.html#deleted", {"oob": True})]
    if part == "engine":  # a check read its copies' engines: only their charts
        return [render_to_string("deployments/deployment_detail.html#charts-engine", deployment_engine_charts(deployment) | {"oob": True})]
    context = deployment_page(deployment, role) | {"oob": True}
    return [render_to_string("deployments/deployment_detail.html#header", context),
            render_to_string("deployments/deployment_detail.html#main", context)]

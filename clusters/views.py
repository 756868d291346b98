"""Cluster pages: the list, the Create a cluster wizard, a cluster's page."""
import json

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import Count, Prefetch, Q, Sum
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.utils.cache import patch_vary_headers
from django.views.decorators.http import require_POST
from django_htmx.http import HttpResponseClientRedirect

from clusters import planning, services
from clusters.choices import CAN_RETRY, CAN_START, CAN_STOP, CHECKED, ClusterState, MemberState, Role
from clusters.models import Cluster, ClusterMember, HealthCheck, head_first, NetworkMeasurement
from console.models import Job
from machines.models import short_model

STEPS = ["name", "machines", "network"]


def _ids(raw) -> list[int]:
    ids = []
    for value in raw:
        for part in str(value).split(","):
            if part.strip().isdigit():
                ids.append(int(part))
    return list(dict.fromkeys(ids))


def _head(raw: str | None) -> int | None:
    return int(raw) if raw and raw.isdigit() else None


# -- the wizard ------------------------------------------------------------------------------------


def wizard_state(params) -> dict:
    """Everything the wizard knows, from the query string: so a reload or the back button loses nothing."""
    name = params.get("name", "").strip()
    picked = _ids(params.getlist("machines"))
    return {"name": name, "picked": picked, "head": _head(params.get("head")), "network": params.get("network", ""),
            "probe": _head(params.get("probe"))}


def cluster_new(request):
    state = wizard_state(request.GET)
    step = request.GET.get("step", "name")
    context = {"wizard": state, "step": step if step in STEPS else "name"}
    if context["step"] != "name":
        try:
            services.cluster_name_check(state["name"])
        except ValidationError as exc:
            context.update(step="name", name_error=exc.message_dict["name"][0])
    if context["step"] == "machines":
        context.update(_machines_step(state))
    elif context["step"] == "network":
        context.update(_machines_step(state))
        if context["can_continue"]:
            context.update(_network_step(state))
        else:
            context["step"] = "machines"
    template = "clusters/wizard.html#wizard" if request.htmx and not request.htmx.history_restore_request else "clusters/wizard.html"
    response = render(request, template, context)
    patch_vary_headers(response, ["HX-Request"])
    return response


def _machines_step(state) -> dict:
    everyone = services.candidates()
    picked = [c for c in everyone if c.id in state["picked"]]
    head = state["head"] if state["head"] in state["picked"] else planning.suggest_head(picked)
    verdicts = planning.pick_check(everyone, services.image_builds(), head_id=head)
    # A picked machine that cannot serve blocks Next until it is taken out of the selection.
    blocking = [verdicts[c.id].refusal for c in picked if not verdicts[c.id].selectable]
    suggested = planning.suggest_head(picked)
    rows = [{"candidate": c, "verdict": verdicts[c.id], "picked": c.id in state["picked"], "suggested_head": c.id == suggested,
             "accelerators": f"{c.accelerator_count} x {short_model(c.accelerator_model)}" if c.accelerator_count else ""}
            for c in everyone]
    state["head"] = head
    return {"rows": rows, "picked_candidates": picked, "blocking": blocking,
            "can_continue": bool(picked) and not blocking, "suggested_head": suggested}


def network_view(state, probe_job: Job | None = None) -> dict:
    """The shared networks with their marks, the measured figures and the suggestion."""
    picked = services.candidates(state["picked"])
    networks = planning.shared_networks(picked)
    others = [c.id for c in picked if c.id != state["head"]]
    measured = services.measurements([n.subnet for n in networks], state["head"], others) if others else {}
    suggested = planning.suggest_network(networks, measured)
    names = {c.id: c.name for c in picked}
    failures = {}
    if others:
        for row in NetworkMeasurement.objects.filter(subnet__in=[n.subnet for n in networks], source_id=state["head"],
                                                     target_id__in=others).exclude(error=""):
            failures.setdefault(row.subnet, []).append(f"{names.get(row.target_id, '?')}: {row.error}")
    return {
        "networks": [{"net": n, "measured": measured.get(n.subnet), "failures": failures.get(n.subnet, []),
                      "members": [{"name": names[m.machine_id], "member": m} for m in n.members]} for n in networks],
        "suggested": suggested,
        "chosen": state["network"] if any(n.subnet == state["network"] for n in networks) else suggested,
        "probe_job": probe_job,
        "no_network": not networks,
        "no_network_message": planning.NO_SHARED_NETWORK,
        "needs_test": len(picked) > 1,
    }


def _network_step(state) -> dict:
    probe_job = Job.objects.filter(pk=state["probe"], kind="cluster.probe").first() if state["probe"] else None
    context = network_view(state, probe_job)
    if probe_job:
        context["live_topics"] = f"topic=probe:{probe_job.pk}"
    return context


@require_POST
def cluster_new_probe(request):
    """Start the bandwidth test of the wizard's network step, then show the step with its live results."""
    state = wizard_state(request.POST)
    try:
        job = services.network_probe_start(machine_ids=state["picked"], head_id=state["head"], user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect(_wizard_url(state, "network"))
    url = _wizard_url({**state, "probe": job.pk}, "network")
    return HttpResponseClientRedirect(url) if request.htmx else redirect(url)


@require_POST
def cluster_new_create(request):
    state = wizard_state(request.POST)
    try:
        cluster = services.cluster_create(
            name=state["name"], machine_ids=state["picked"], head_id=state["head"], network=state["network"], user=request.user
        )
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect(_wizard_url(state, "network"))
    url = cluster.get_absolute_url()
    return HttpResponseClientRedirect(url) if request.htmx else redirect(url)


def _wizard_url(state, step: str) -> str:
    from urllib.parse import urlencode

    query = {"step": step, "name": state["name"], "machines": ",".join(map(str, state["picked"]))}
    for key in ("head", "network", "probe"):
        if state.get(key):
            query[key] = state[key]
    return "/clusters/new/?" + urlencode(query)


def render_probe_topic(arg: str, part: str) -> list[str]:
    job = Job.objects.filter(pk=int(arg), kind="cluster.probe").first()
    if job is None:
        return []
    state = {"picked": job.params["machines"], "head": job.params["head"], "network": "", "probe": job.pk}
    context = network_view(state, job) | {"oob": True, "wizard": state}
    messages_out = [render_to_string("clusters/wizard.html#networks", context)]
    # The same test runs from a cluster's Change the network page: that page's table gets the results too
    # (a page without the element ignores it).
    led = ClusterMember.objects.select_related("cluster").filter(machine_id=job.params["head"], role=Role.HEAD).first()
    if led is not None:
        messages_out.append(render_to_string("clusters/cluster_network.html#networks",
                                             cluster_network_view(led.cluster, job) | {"oob": True}))
    return messages_out



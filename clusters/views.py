"""Cluster pages: the list, the Create a cluster wizard, a cluster's page."""
import json
from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.db.models import Count, Prefetch, Q, Sum
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
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
        cluster = led.cluster
        messages_out.append(render_to_string("clusters/cluster_network.html#networks",
                                             cluster_cards(cluster) | cluster_network_view(cluster, job) | {"oob": True}))
    return messages_out


# -- the list ----------------------------------------------------------------------------------------


def _clusters():
    return Cluster.objects.annotate(
        machine_count=Count("members"),
        machines_up=Count("members", filter=Q(members__state=MemberState.JOINED)),
        accelerators=Sum("members__accelerators_in_ray"),
    ).prefetch_related(Prefetch("members", queryset=ClusterMember.objects.filter(role=Role.HEAD).select_related("machine")))


def cluster_list(request):
    return render(request, "clusters/cluster_list.html", {"clusters": _clusters(), "live_topics": "topic=clusters"})


def render_clusters_topic(arg: str, part: str) -> list[str]:
    # The whole body, whatever changed: it is a handful of rows, and so a new cluster appears and a
    # deleted one goes without the page knowing which rows it holds.
    return [render_to_string("clusters/cluster_list.html#rows", {"clusters": _clusters(), "oob": True})]


# -- a cluster's page --------------------------------------------------------------------------------

DEPLOY_LATER = "Models are deployed from Deployments, which is not available yet."
DRAIN_LATER = "Draining comes with deployments."


def _offer(allowed: bool, reason: str, busy: Job | None = None) -> dict:
    """A button's state: enabled, or disabled with the reason the page shows beside it."""
    if allowed and busy:
        return {"ok": False, "why": f"{busy.title} is {busy.get_state_display().lower()}: one operation at a time."}
    return {"ok": allowed, "why": "" if allowed else reason}


def _actions(cluster: Cluster, busy: Job | None) -> dict:
    state = cluster.state
    label = cluster.get_state_display()
    # Stop and Delete win over a start or a repair under way (it is asked to end); not over a stop.
    cancellable = busy is not None and busy.kind in (services.START_KIND, services.ADD_KIND, services.REJOIN_KIND)
    stoppable_busy = None if cancellable else busy
    return {
        "check": _offer(state in CHECKED, f"{cluster.name} is {label}: checks look at a running cluster."),
        "stop": _offer(state in CAN_STOP, f"{cluster.name} is {label}.", stoppable_busy),
        "start": _offer(state in CAN_START, "Start is for a stopped cluster.", busy),
        "retry": _offer(state in CAN_RETRY, "There is nothing to try again.", busy),
        "add": _offer(state == ClusterState.RUNNING, f"Machines join a running cluster; {cluster.name} is {label}.", busy),
        "delete": _offer(state != ClusterState.DELETING, f"{cluster.name} is already being deleted.", stoppable_busy),
        "deploy": _offer(False, DEPLOY_LATER),
        "switch": _offer(state not in (ClusterState.STOPPING, ClusterState.DELETING), f"{cluster.name} is {label}.", busy),
        "network": _offer(state not in (ClusterState.STOPPING, ClusterState.DELETING), f"{cluster.name} is {label}.", busy),
        "show_start": state in CAN_START,
        "show_retry": state in CAN_RETRY,
        "show_check": state in CHECKED,
    }


def _members(cluster: Cluster) -> list[ClusterMember]:
    members = cluster.members.select_related("machine", "runtime_image").prefetch_related("machine__accelerators")
    return sorted(members.order_by("machine__name"), key=head_first)


def cluster_cards(cluster: Cluster, members: list[ClusterMember] | None = None) -> dict:
    """The header, the summary, the member table and the operation card."""
    members = _members(cluster) if members is None else members
    jobs = list(Job.objects.filter(target_type="cluster", target_id=cluster.pk)[:1])
    busy = services.cluster_busy(cluster)
    joined = [m for m in members if m.state == MemberState.JOINED]
    return {
        "cluster": cluster,
        "members": members,
        "job": jobs[0] if jobs else None,
        "busy": busy,
        "actions": _actions(cluster, busy),
        "head": next((m for m in members if m.role == Role.HEAD), None),
        "summary": {
            "machines_up": len(joined),
            "machines": len(members),
            "accelerators": sum(m.accelerators_in_ray for m in joined),
            "free_accelerators": sum(m.accelerators_in_ray for m in joined),  # nothing is deployed yet
            "deployments": cluster.deployments.count(),
        },
    }


def _short_digest(digest: str | None) -> str:
    return (digest or "").removeprefix("sha256:")[:12]


def _measured_links(cluster: Cluster, head: ClusterMember | None) -> dict[int, NetworkMeasurement]:
    """The last bandwidth test from the head to each machine on the cluster's own network."""
    if head is None or not cluster.network:
        return {}
    rows = NetworkMeasurement.objects.filter(subnet=cluster.network, source_id=head.machine_id)
    return {row.target_id: row for row in rows}


def _remove_offer(cluster: Cluster, member: ClusterMember, count: int, busy: Job | None) -> dict:
    if cluster.state != ClusterState.STOPPED:
        if member.role == Role.HEAD:
            return _offer(False, "To take out the head, stop the cluster first.")
        return _offer(False, "A machine leaves a running cluster by a drain, which comes with deployments. "
                             "Stop the cluster to take it out of its record now.")
    if count == 1:
        return _offer(False, "It is the only machine of the cluster: delete the cluster instead.")
    return _offer(True, "", busy)


def _member_view(cluster: Cluster, m: ClusterMember, link: NetworkMeasurement | None, count: int, busy: Job | None) -> dict:
    status = m.last_status or {}
    runtime = status.get("runtime") or {}
    ray_node = status.get("ray_node") or {}
    return {
        "m": m,
        "accelerators": m.machine.accelerator_summary,
        "accelerator_count": len(m.machine.accelerators.all()),
        "runtime": runtime,
        "ray": runtime.get("ray") or {},
        "ray_node": ray_node,
        "error": status.get("error", ""),
        "running_digest": _short_digest(runtime.get("digest")),
        "image_digest": _short_digest(m.runtime_image.digest) if m.runtime_image else "",
        "node_id": ray_node.get("node_id") or m.ray_node_id,
        "link": link,
        "remove": _remove_offer(cluster, m, count, busy),
    }


# The diagram's geometry, in SVG user units: the head on the left, the others stacked on the right,
# a curve from the head to each ending in a straight run that carries the measured figure.
WIRE_WIDTH = 860
HEAD_X, HEAD_W, HEAD_H = 16, 236, 104
WORKER_X, WORKER_W = 544, 300
LABEL_RUN = 150  # the straight end of each link, where its label sits
TOP = 48


def _node(view: dict, x: float, y: float, w: float, h: float, lines: list[float]) -> dict:
    """A box of the diagram with where its texts go (the template does no arithmetic)."""
    return {"view": view, "x": round(x), "y": round(y), "w": w, "h": h, "dot_x": round(x) + 18, "text_x": round(x) + 30,
            "sub_x": round(x) + 16, "right_x": round(x + w) - 12, "lines": [round(y + dy) for dy in lines]}


def wiring_diagram(views: list[dict]) -> dict:
    head = next((v for v in views if v["m"].role == Role.HEAD), None)
    workers = [v for v in views if v is not head]
    compact = len(workers) > 8  # up to ~20 machines stay on one screen
    box_h, gap, lines = (46, 10, [19, 36]) if compact else (58, 16, [24, 44])
    column = len(workers) * box_h + max(len(workers) - 1, 0) * gap
    body = max(column, HEAD_H)
    head_y = TOP + (body - HEAD_H) / 2
    x1, y1 = HEAD_X + HEAD_W, head_y + HEAD_H / 2
    nodes, links = [], []
    for i, view in enumerate(workers):
        y = TOP + (body - column) / 2 + i * (box_h + gap)
        nodes.append(_node(view, WORKER_X, y, WORKER_W, box_h, lines))
        x2, y2 = WORKER_X, round(y + box_h / 2)
        bend = x2 - LABEL_RUN
        middle = round((x1 + bend) / 2)
        link = view["link"]
        links.append({
            "d": f"M{x1},{round(y1)} C{middle},{round(y1)} {middle},{y2} {bend},{y2} L{x2},{y2}",
            "label_x": x2 - LABEL_RUN // 2 - 4, "label_y": y2,
            "mbps": link.mbps if link and link.mbps else None,
            "error": link.error if link and not link.mbps else "",
            "view": view,
        })
    return {
        "width": WIRE_WIDTH, "height": TOP + body + 12, "compact": compact,
        "head": _node(head, HEAD_X, head_y, HEAD_W, HEAD_H, [28, 50, 72, 92]) if head else None,
        "nodes": nodes, "links": links,
        "network_x": round((x1 + WORKER_X - LABEL_RUN) / 2), "alone_x": WORKER_X + WORKER_W // 2, "alone_y": round(y1),
    }


def wiring_card(cluster: Cluster, cards: dict, selected: int | None = None) -> dict:
    """How this cluster is wired: the diagram and, for each machine, the panel that opens when it is selected."""
    members = cards["members"]
    links = _measured_links(cluster, cards["head"])
    views = [_member_view(cluster, m, links.get(m.machine_id) if m.role != Role.HEAD else None, len(members), cards["busy"])
             for m in members]
    if selected not in {m.machine_id for m in members}:
        selected = None
    return {"member_views": views, "diagram": wiring_diagram(views), "selected": selected, "drain_later": DRAIN_LATER}


def checks_card(cluster: Cluster) -> dict:
    """The health checks the server ran, and the raw status they last read."""
    return {
        "checks": list(HealthCheck.objects.filter(cluster=cluster)[:20]),
        "raw_status": json.dumps(cluster.last_status, indent=2, sort_keys=True) if cluster.last_status else "",
    }


def runtime_card(cluster: Cluster) -> dict:
    offer = [{**entry, "digest": _short_digest(entry["image"].digest),
              "machines_text": ", ".join(entry["machines"][:6]) + (f" and {len(entry['machines']) - 6} more" if len(entry["machines"]) > 6 else "")}
             for entry in services.runtime_offer(cluster)]
    return {"runtime_offer": offer, "runtime_newer": [e for e in offer if e["newer"]]}


def cluster_page(cluster: Cluster, selected: int | None = None) -> dict:
    cards = cluster_cards(cluster)
    return (cards | wiring_card(cluster, cards, selected) | checks_card(cluster) | runtime_card(cluster)
            | {"deployments": list(cluster.deployments.all()[:20])})


def cluster_detail(request, pk: int):
    cluster = get_object_or_404(Cluster, pk=pk)
    selected = _head(request.GET.get("machine"))
    context = cluster_page(cluster, selected) | {"live_topics": f"topic=cluster:{pk}"}
    return render(request, "clusters/cluster_detail.html", context)


def render_cluster_topic(arg: str, part: str) -> list[str]:
    cluster = Cluster.objects.filter(pk=int(arg)).first()
    if cluster is None:
        return [render_to_string("clusters/cluster_detail.html#deleted", {"oob": True})]
    if part == "members":
        cards = cluster_cards(cluster)
        return [render_to_string("clusters/cluster_detail.html#members-live", cards | wiring_card(cluster, cards) | {"oob": True})]
    if part == "job":
        return [render_to_string("clusters/cluster_detail.html#job-live", cluster_cards(cluster) | runtime_card(cluster) | {"oob": True})]
    if part == "checks":
        return [render_to_string("clusters/cluster_detail.html#checks-live", cluster_cards(cluster) | checks_card(cluster) | {"oob": True})]
    return [render_to_string("clusters/cluster_detail.html#live", cluster_page(cluster) | {"oob": True})]


# -- what the buttons do -----------------------------------------------------------------------------


def _refused(request, exc: ValidationError) -> None:
    messages.error(request, " ".join(exc.messages))


def _button(service: str, done: str = ""):
    """A POST button of the cluster's page: call the service (looked up when called), say what
    happens now or why not, and go back to the page, which shows the rest live."""

    @require_POST
    def view(request, pk: int):
        cluster = get_object_or_404(Cluster, pk=pk)
        try:
            getattr(services, service)(cluster=cluster, user=request.user)
        except ValidationError as exc:
            _refused(request, exc)
        else:
            if done:
                messages.success(request, done.format(name=cluster.name))
        return redirect(cluster)

    return view


cluster_retry = _button("cluster_retry")
cluster_stop = _button("cluster_stop", "Stopping {name}: Ray and the runtime stop on every machine.")
cluster_start = _button("cluster_start", "Starting {name} on its machines.")
cluster_check = _button("cluster_check_now", "Looking at {name} now: the result appears under Advanced → Health checks.")


def cluster_delete(request, pk: int):
    """GET: what deleting does; POST: delete (at once, or stopped first by a job)."""
    cluster = get_object_or_404(Cluster, pk=pk)
    if request.method == "POST":
        name = cluster.name
        try:
            job = services.cluster_delete(cluster=cluster, user=request.user)
        except ValidationError as exc:
            _refused(request, exc)
            return redirect(cluster)
        if job is None:
            messages.success(request, f"{name} was deleted. Its machines stay enrolled and can join another cluster.")
        else:
            messages.success(request, f"Deleting {name}: it is stopped on its machines first, then its record goes.")
        return redirect("clusters:list")
    cards = cluster_cards(cluster)
    return render(request, "clusters/cluster_confirm.html", cards | {
        "confirm": "delete",
        "deployment_count": cards["summary"]["deployments"],
        "stopped": cluster.state == ClusterState.STOPPED,
    })


def cluster_add(request, pk: int):
    """Add machines to a running cluster: every machine outside it, with the reason when it cannot join."""
    cluster = get_object_or_404(Cluster, pk=pk)
    picked, errors = [], []
    if request.method == "POST":
        picked = _ids(request.POST.getlist("machines"))
        try:
            job = services.cluster_add_machines(cluster=cluster, machine_ids=picked, user=request.user)
        except ValidationError as exc:
            errors = exc.messages
        else:
            messages.success(request, f"{job.title}: each machine gets the runtime image, then joins Ray.")
            return redirect(cluster)
    rows = [{"candidate": c, "verdict": v, "picked": c.id in picked,
             "accelerators": f"{c.accelerator_count} x {short_model(c.accelerator_model)}" if c.accelerator_count else ""}
            for c, v in services.cluster_join_verdicts(cluster)]
    # The machines that can join first; machines of other clusters, the longest list, last.
    rows.sort(key=lambda r: (not r["verdict"].selectable, r["candidate"].cluster_name is not None, r["candidate"].name))
    cards = cluster_cards(cluster)
    context = cards | {"rows": rows, "errors": errors, "selectable": sum(1 for r in rows if r["verdict"].selectable)}
    return render(request, "clusters/cluster_add.html", context, status=400 if errors else 200)


@require_POST
def cluster_member_remove(request, pk: int, machine_id: int):
    cluster = get_object_or_404(Cluster, pk=pk)
    member = cluster.members.select_related("machine").filter(machine_id=machine_id).first()
    try:
        services.cluster_member_remove(cluster=cluster, machine_id=machine_id, user=request.user)
    except ValidationError as exc:
        _refused(request, exc)
        return redirect(f"{cluster.get_absolute_url()}?machine={machine_id}")
    messages.success(request, f"{member.machine.name} left {cluster.name}. It stays enrolled and can join another cluster.")
    return redirect(cluster)


def cluster_runtime_switch(request, pk: int):
    """GET: what switching does; POST: switch to the newest certified build (a restart)."""
    cluster = get_object_or_404(Cluster, pk=pk)
    if request.method == "POST":
        try:
            job = services.cluster_switch_runtime(cluster=cluster, user=request.user)
        except ValidationError as exc:
            _refused(request, exc)
            return redirect(cluster)
        if job is None:
            messages.success(request, f"{cluster.name} runs the new build when it starts.")
        else:
            messages.success(request, f"Restarting {cluster.name} on the new build.")
        return redirect(cluster)
    return render(request, "clusters/cluster_confirm.html", cluster_cards(cluster) | runtime_card(cluster) | {"confirm": "switch"})


def cluster_network_view(cluster: Cluster, probe_job: Job | None = None, chosen: str = "") -> dict:
    """The networks the cluster's machines share, measured from its head: the wizard's step, for a running cluster."""
    members = list(cluster.members.all())
    head = next((m.machine_id for m in members if m.role == Role.HEAD), None)
    state = {"picked": [m.machine_id for m in members], "head": head, "network": chosen or cluster.network}
    context = network_view(state, probe_job)
    return context | {"cluster": cluster, "current": cluster.network, "can_test": len(members) > 1 and head is not None}


def cluster_network(request, pk: int):
    """GET: the shared networks, tested and marked; POST: move the cluster to the one picked (a restart)."""
    cluster = get_object_or_404(Cluster, pk=pk)
    if request.method == "POST":
        network = request.POST.get("network", "")
        try:
            job = services.cluster_change_network(cluster=cluster, network=network, user=request.user)
        except ValidationError as exc:
            _refused(request, exc)
            return redirect(f"{reverse('clusters:network', args=[pk])}?{urlencode({'network': network})}")
        if job is None:
            messages.success(request, f"{cluster.name} uses {network} when it starts.")
        else:
            messages.success(request, f"Moving {cluster.name} to {network}: it restarts on it.")
        return redirect(cluster)
    probe = _head(request.GET.get("probe"))
    probe_job = Job.objects.filter(pk=probe, kind="cluster.probe").first() if probe else None
    context = cluster_cards(cluster) | cluster_network_view(cluster, probe_job, request.GET.get("network", ""))
    if probe_job:
        context["live_topics"] = f"topic=probe:{probe_job.pk}"
    return render(request, "clusters/cluster_network.html", context)


@require_POST
def cluster_network_test(request, pk: int):
    cluster = get_object_or_404(Cluster, pk=pk)
    members = list(cluster.members.all())
    head = next((m.machine_id for m in members if m.role == Role.HEAD), None)
    try:
        job = services.network_probe_start(machine_ids=[m.machine_id for m in members], head_id=head, user=request.user)
    except ValidationError as exc:
        _refused(request, exc)
        return redirect("clusters:network", pk=pk)
    return redirect(f"{reverse('clusters:network', args=[pk])}?probe={job.pk}")

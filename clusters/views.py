"""Cluster pages: the list, the Create a cluster wizard, a cluster's page and its buttons.

Views read the request, call a service, and render what pages.py gives them for the user's role.
A service that refuses for the role raises PermissionDenied: the page answers 403 with the sentence
(a greyed-out button is only pressed by hand-made requests).
"""
from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils.cache import patch_vary_headers
from django.views.decorators.http import require_POST
from django_htmx.http import HttpResponseClientRedirect

from clusters import actions, choosing, pages, planning, selectors, services
from clusters.choices import ClusterState, Role
from clusters.models import Cluster
from console import params
from console.roles import role_of
from machines.choices import MachineState
from machines.models import short_model

STEPS = ["name", "machines", "network"]


# -- the wizard ------------------------------------------------------------------------------------


def wizard_state(query) -> dict:
    """Everything the wizard knows, from the query string: so a reload or the back button loses nothing.
    Ids are parsed strictly (console.params): a malformed one is a 400 that names it."""
    return {"name": query.get("name", "").strip(), "picked": params.id_list(query.getlist("machines"), name="machines"),
            "head": params.int_param(query, "head"), "network": query.get("network", ""),
            "probe": params.int_param(query, "probe")}


def cluster_new(request):
    state = wizard_state(request.GET)
    step = request.GET.get("step", "name")
    context = {"wizard": state, "step": step if step in STEPS else "name"} | pages.network_offers(role_of(request.user))
    if context["step"] != "name":
        try:
            choosing.cluster_name_check(state["name"])
        except ValidationError as exc:
            context.update(step="name", name_error=exc.message_dict["name"][0])
    found = selectors.MachineFilter.from_params(request.GET)
    if context["step"] == "machines":
        context.update(_machines_step(state, found))
    elif context["step"] == "network":
        # Only the ticked machines: the step shows none of the others.
        picked, _, blocking = _selection(state)
        if picked and not blocking:
            context.update(_network_step(state, picked), picked_candidates=picked)
        else:
            context.update(_machines_step(state, found), step="machines")
    template = "clusters/wizard.html#wizard" if request.htmx and not request.htmx.history_restore_request else "clusters/wizard.html"
    response = render(request, template, context)
    patch_vary_headers(response, ["HX-Request"])
    return response


def _machine_rows(candidates, verdicts, *, picked=(), suggested=None) -> list[dict]:
    return [{"candidate": c, "verdict": verdicts[c.id], "picked": c.id in picked, "suggested_head": c.id == suggested,
             "accelerators": f"{c.accelerator_count} x {short_model(c.accelerator_model)}" if c.accelerator_count else ""}
            for c in candidates]


def _finder(found: selectors.MachineFilter, listed: selectors.MachinePage) -> dict:
    """What the filter bar and the pager need."""
    return {"found": found, "listed": listed, "kinds": selectors.machine_kinds(), "machine_states": MachineState.choices}


def _selection(state, shown=()) -> tuple[list[planning.Candidate], dict, list[str]]:
    """The ticked machines, the verdicts on them and on ``shown``, and the messages that block Next;
    settles the head (the one chosen, else the suggested one) in ``state``."""
    picked = selectors.candidates(state["picked"])
    head = state["head"] if state["head"] in state["picked"] else planning.suggest_head(picked)
    verdicts = planning.pick_check([*picked, *shown], selectors.image_builds(), head_id=head)
    # A picked machine that cannot serve blocks Next until it is taken out of the selection.
    blocking = [verdicts[c.id].refusal for c in picked if not verdicts[c.id].selectable]
    state["head"] = head
    return picked, verdicts, blocking


def _machines_step(state, found: selectors.MachineFilter) -> dict:
    """The picked machines first, then one page of the others the filter finds: never all of them."""
    listed = selectors.machines_page(found, exclude=state["picked"])
    shown = selectors.candidates(listed.ids)
    picked, verdicts, blocking = _selection(state, shown)
    suggested = planning.suggest_head(picked)
    return {"picked_rows": _machine_rows(picked, verdicts, picked=state["picked"], suggested=suggested),
            "rows": _machine_rows(shown, verdicts), "picked_candidates": picked, "blocking": blocking,
            "can_continue": bool(picked) and not blocking, "suggested_head": suggested, **_finder(found, listed)}


def _network_step(state, picked: list[planning.Candidate]) -> dict:
    probe_job = selectors.probe_job(state["probe"])
    context = pages.network_view(state, probe_job, picked)
    if probe_job:
        context["live_topics"] = f"topic=probe:{probe_job.pk}"
    return context


@require_POST
def cluster_new_probe(request):
    """Start the bandwidth test of the wizard's network step, then show the step with its live results."""
    state = wizard_state(request.POST)
    try:
        job = choosing.network_probe_start(machine_ids=state["picked"], head_id=state["head"], user=request.user)
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


# -- the list ----------------------------------------------------------------------------------------


def cluster_list(request):
    return render(request, "clusters/cluster_list.html", {"clusters": selectors.clusters_with_totals(), "live_topics": "topic=clusters",
                                                          "create": actions.CREATE.offer(role_of(request.user))})


# -- a cluster's page --------------------------------------------------------------------------------

def cluster_detail(request, pk: int):
    cluster = get_object_or_404(Cluster, pk=pk)
    selected = params.int_param(request.GET, "machine")
    context = pages.cluster_page(cluster, selected, role=role_of(request.user)) | {"live_topics": f"topic=cluster:{pk}"}
    return render(request, "clusters/cluster_detail.html", context)


def _cluster_or_404(pk: int) -> Cluster:
    """The cluster, for the pages that do not show its raw status: that stays in the database."""
    return get_object_or_404(Cluster.objects.defer("last_status"), pk=pk)


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
    """GET: what deleting does; POST: delete (a job on the machines that answer, else at once)."""
    cluster = _cluster_or_404(pk)
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
            messages.success(request, f"Deleting {name}: it is stopped on its machines and their node settings go first, then its record.")
        return redirect("clusters:list")
    return render(request, "clusters/cluster_confirm.html", pages.cluster_cards(cluster, role=role_of(request.user), status=False) | {
        "confirm": "delete",
        "stopped": cluster.state == ClusterState.STOPPED,
    })


def cluster_add(request, pk: int):
    """Add machines to a running cluster: every machine outside it, with the reason when it cannot join."""
    cluster = _cluster_or_404(pk)
    picked, errors = params.id_list(request.GET.getlist("machines"), name="machines"), []
    if request.method == "POST":
        picked = params.id_list(request.POST.getlist("machines"), name="machines")
        try:
            job = services.cluster_add_machines(cluster=cluster, machine_ids=picked, user=request.user)
        except ValidationError as exc:
            errors = exc.messages
        else:
            messages.success(request, f"{job.title}: each machine gets the runtime image, then joins Ray.")
            return redirect(cluster)
    found = selectors.MachineFilter.from_params(request.POST if request.method == "POST" else request.GET)
    listed = selectors.machines_page(found, exclude=selectors.cluster_machine_ids(cluster))
    verdicts = selectors.cluster_join_verdicts(cluster, [*picked, *listed.ids])
    candidates, by_id = [c for c, _ in verdicts], {c.id: v for c, v in verdicts}
    rows = _machine_rows(candidates, by_id, picked=picked)
    # The ticked ones first, then the page the filter found.
    rows.sort(key=lambda r: (not r["picked"], r["candidate"].name))
    cards = pages.cluster_cards(cluster, role=role_of(request.user), status=False)
    context = cards | {"rows": rows, "errors": errors, "selectable": sum(1 for r in rows if r["verdict"].selectable),
                       **_finder(found, listed)}
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
    messages.success(request, f"{member.machine.name} left {cluster.name}. It stays enrolled and can join another cluster; "
                              "the cluster's settings leave it now (or at its next contact), and the others get a new node key.")
    return redirect(cluster)


def cluster_runtime_switch(request, pk: int):
    """GET: what switching does; POST: switch to the newest certified build (a restart)."""
    cluster = _cluster_or_404(pk)
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
    cards = pages.cluster_cards(cluster, role=role_of(request.user), status=False)
    return render(request, "clusters/cluster_confirm.html", cards | pages.runtime_card(cluster, cards["members"]) | {"confirm": "switch"})


def cluster_network(request, pk: int):
    """GET: the shared networks, tested and marked; POST: move the cluster to the one picked (a restart)."""
    cluster = _cluster_or_404(pk)
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
    probe = params.int_param(request.GET, "probe")
    probe_job = selectors.probe_job(probe)
    role = role_of(request.user)
    context = (pages.cluster_cards(cluster, role=role, status=False) | pages.network_offers(role)
               | pages.cluster_network_view(cluster, probe_job, request.GET.get("network", "")))
    if probe_job:
        context["live_topics"] = f"topic=probe:{probe_job.pk}"
    return render(request, "clusters/cluster_network.html", context)


@require_POST
def cluster_network_test(request, pk: int):
    cluster = get_object_or_404(Cluster, pk=pk)
    members = list(cluster.members.all())
    head = next((m.machine_id for m in members if m.role == Role.HEAD), None)
    try:
        job = choosing.network_probe_start(machine_ids=[m.machine_id for m in members], head_id=head, user=request.user)
    except ValidationError as exc:
        _refused(request, exc)
        return redirect("clusters:network", pk=pk)
    return redirect(f"{reverse('clusters:network', args=[pk])}?probe={job.pk}")

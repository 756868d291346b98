"""Drain and Remove from cluster in the pages: the drain plan for the machines chosen (the cluster page's
selected machine, the machine's page, or a selection in the Machines list: Enable drain), the agree button
that starts one drain per machine, and Stop drain / Cancel removal. The work is deployments/drain.py's; the
plan deployments/drain_input.py's."""
from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from clusters.actions import NOT_RUNNING_DRAIN
from clusters.choices import ClusterState
from clusters.models import Cluster, ClusterMember
from deployments import drain
from deployments.drain_input import drain_card, drain_plan_for, plan_json
from machines.models import Machine


def _chosen(data) -> tuple[Cluster | None, list[int], str]:
    """The cluster and machines named by ``machines`` (ids, one or several), or why they cannot be drained together."""
    try:
        ids = sorted({int(value) for value in data.getlist("machines")})
    except ValueError:
        return None, [], "Choose machines by their ids."
    if not ids:
        return None, [], "Tick the machines to drain first."
    members = list(ClusterMember.objects.filter(machine_id__in=ids).select_related("cluster", "machine"))
    if len(members) < len(ids):
        outside = sorted(set(Machine.objects.filter(pk__in=ids).values_list("name", flat=True))
                         - {m.machine.name for m in members})
        return None, [], (f"{', '.join(outside) or 'That machine'} {'is' if len(outside) < 2 else 'are'} in no cluster: "
                          "only a cluster's machines are drained.")
    clusters = {m.cluster for m in members}
    if len(clusters) > 1:
        return None, [], (f"The machines are in {len(clusters)} clusters ({', '.join(sorted(c.name for c in clusters))}): "
                          "drain the machines of one cluster at a time.")
    return clusters.pop(), ids, ""


def drain_plan_page(request):
    """The drain plan (GET from a link, or POST from the Machines list's selection: it only shows the plan)."""
    data = request.POST if request.method == "POST" else request.GET
    cluster, ids, why = _chosen(data)
    if cluster is None:
        messages.error(request, why)
        return redirect(data.get("next") or reverse("machines:list"))
    remove = data.get("remove") == "1"
    card = drain_card(cluster, ids, remove=remove, action_url=reverse("deployments:drain-start"))
    if cluster.state != ClusterState.RUNNING and not remove:
        card["refusals"].append(NOT_RUNNING_DRAIN.format(cluster=cluster.name, state=cluster.get_state_display().lower()))
        card["can_start"] = False
    drains = drain.Drain.objects.filter(machine_id__in=ids).select_related("machine", "job")
    return render(request, "deployments/drain_plan_page.html", {"drain": card, "cluster": cluster, "drains": drains})


@require_POST
def drain_start(request):
    """Drain (or Remove) as agreed: the plan is made again, and if it stops more copies than the one the person
    read, nothing starts and the page shows the new plan."""
    cluster, ids, why = _chosen(request.POST)
    if cluster is None:
        messages.error(request, why)
        return redirect(reverse("machines:list"))
    remove = request.POST.get("remove") == "1"
    plan = drain_plan_for(cluster, ids, remove=remove)
    agreed = request.POST.get("stops", "")
    if agreed.isdigit() and len(plan.stops) > int(agreed):
        messages.error(request, f"The plan changed since you read it: {len(plan.stops)} copies would stop now, not "
                                f"{agreed}. Read it again before you agree.")
        return redirect(f"{reverse('deployments:drain-plan')}?" + "&".join(f"machines={i}" for i in ids)
                        + ("&remove=1" if remove else ""))
    whole = plan_json(plan)
    started, refused = [], []
    for machine in Machine.objects.filter(pk__in=ids).order_by("name"):
        mine = set(drain.copies_on(machine, cluster.pk).values_list("pk", flat=True))
        part = {"moves": [m for m in whole["moves"] if m["copy"] in mine],
                "stops": [s for s in whole["stops"] if s["copy"] in mine]}
        try:
            if remove:
                drain.machine_remove(cluster, machine, part, user=request.user)
            else:
                drain.drain_start(cluster, machine, part, user=request.user)
        except PermissionDenied as exc:
            refused.append(str(exc))
        except ValidationError as exc:
            refused.append(" ".join(exc.messages))
        else:
            started.append(machine.name)
    if started:
        messages.success(request, f"{'Removing' if remove else 'Draining'} {', '.join(started)}: its copies move first, "
                                  "each serving until its replacement is up.")
    for sentence in refused:
        messages.error(request, sentence)
    return redirect(cluster)


def _on_machine(request, pk: int, act, done: str):
    machine = get_object_or_404(Machine, pk=pk)
    try:
        act(machine, user=request.user)
    except PermissionDenied as exc:
        messages.error(request, str(exc))
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, done.format(name=machine.name))
    membership = ClusterMember.objects.filter(machine=machine).select_related("cluster").first()
    return redirect(request.POST.get("next") or (membership.cluster if membership else machine))


@require_POST
def drain_stop(request, pk: int):
    return _on_machine(request, pk, drain.drain_stop, "Stopping the drain of {name}: it leaves Ray and joins again.")


@require_POST
def removal_cancel(request, pk: int):
    return _on_machine(request, pk, drain.removal_cancel, "The removal of {name} is cancelled: it stays in the cluster.")

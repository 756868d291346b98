"""Look for them and Take over a model, from the cluster page's "Models running here without a deployment"
card (deployments/orphans.py does both)."""
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from clusters.models import Cluster
from deployments import orphans


@require_POST
def cluster_orphans_look(request, pk: int):
    cluster = get_object_or_404(Cluster, pk=pk)
    try:
        orphans.orphans_look_start(cluster=cluster, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"Asking every machine of {cluster.name} which engines it runs.")
    return redirect(cluster)


def _take(request, pk: int, *, keep: bool):
    cluster = get_object_or_404(Cluster, pk=pk)
    name = request.POST.get("name", "")
    try:
        orphans.orphan_take_over(cluster=cluster, name=name, keep=keep, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"Keeping {name} as a deployment, its copies as they run." if keep else
                         f"Stopping {name}'s engines: its GPUs are free once they have stopped.")
    return redirect(cluster)


@require_POST
def cluster_orphan_keep(request, pk: int):
    return _take(request, pk, keep=True)


@require_POST
def cluster_orphan_delete(request, pk: int):
    return _take(request, pk, keep=False)

"""The Models pages (the list with Add a model, a model's page and its buttons), and the switch of the
model-source card on a cluster's page.

Views read the request, call a service (which checks the role: PermissionDenied is a 403) and render what
pages.py gives them. Copy checks the role before it reads which cluster, so a Viewer is refused, not asked.
"""
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from clusters.models import Cluster
from console import params
from console.roles import role_of
from deployments.models import StoredModel
from deployments.store import actions, pages, services, sources


def model_list(request):
    return render(request, "deployments/model_list.html", pages.models_page(role_of(request.user)) | {"live_topics": "topic=models"})


def model_detail(request, pk: int):
    model = get_object_or_404(StoredModel, pk=pk)
    return render(request, "deployments/model_detail.html",
                  pages.model_page(model, role_of(request.user)) | {"live_topics": f"topic=model:{pk}"})


def _say(request, exc: ValidationError) -> None:
    messages.error(request, " ".join(exc.messages))


@require_POST
def model_add(request):
    repo, revision = request.POST.get("repo", ""), request.POST.get("revision", "")
    try:
        model = services.model_add(repo=repo, revision=revision, user=request.user)
    except ValidationError as exc:
        _say(request, exc)
        return render(request, "deployments/model_list.html",
                      pages.models_page(role_of(request.user)) | {"live_topics": "topic=models", "form": {"repo": repo, "revision": revision}},
                      status=400)
    messages.success(request, f"Downloading {model} into the server's store.")
    return redirect(model)


@require_POST
def model_retry(request, pk: int):
    model = get_object_or_404(StoredModel, pk=pk)
    try:
        services.model_retry(model, user=request.user)
    except ValidationError as exc:
        _say(request, exc)
    else:
        messages.success(request, f"Downloading {model} again, from where it stopped.")
    return redirect(model)


@require_POST
def model_delete(request, pk: int):
    model = get_object_or_404(StoredModel, pk=pk)
    name = str(model)
    try:
        services.model_delete(model, user=request.user)
    except ValidationError as exc:
        _say(request, exc)
        return redirect(model)
    messages.success(request, f"Deleted {name} and its files from the server's store.")
    return redirect("models:list")


@require_POST
def model_copy(request, pk: int):
    model = get_object_or_404(StoredModel, pk=pk)
    actions.COPY.offer(role_of(request.user)).check()
    cluster_id = params.int_param(request.POST, "cluster")
    cluster = Cluster.objects.filter(pk=cluster_id).first() if cluster_id else None
    if cluster is None:
        messages.error(request, "Choose the cluster whose machines get the model.")
        return redirect(model)
    try:
        services.model_copy(model, cluster, user=request.user)
    except ValidationError as exc:
        _say(request, exc)
        return redirect(model)
    messages.success(request, f"Copying {model} to {cluster.name}'s machines: a bar per machine on its page.")
    return redirect(cluster)


@require_POST
def model_remove(request, pk: int):
    model = get_object_or_404(StoredModel, pk=pk)
    machine = params.int_param(request.POST, "machine")
    try:
        services.model_remove_from_machines(model, [machine] if machine else None, user=request.user)
    except ValidationError as exc:
        _say(request, exc)
    else:
        messages.success(request, f"Removing {model}'s files from the machine{'' if machine else 's'}.")
    return redirect(model)


@require_POST
def cluster_model_source(request, pk: int):
    """The card's switch on a cluster's page: Server copies at once, machine downloads after the check."""
    cluster = get_object_or_404(Cluster, pk=pk)
    try:
        job = sources.model_source_set(cluster, request.POST.get("model_source", ""), user=request.user)
    except ValidationError as exc:
        _say(request, exc)
    else:
        messages.success(request, "Checking that every machine reaches the hub first." if job else
                         f"{cluster.name}'s machines get the next model from the server.")
    return redirect(cluster)

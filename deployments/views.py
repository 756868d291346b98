"""The Deployments pages: the list, Deploy a model (with its plan before anything starts), a deployment's
page, and its buttons (scale, routing, delete). Views read the request, call a service (which checks the role:
PermissionDenied is a 403) and render what pages.py gives them."""
from django.contrib import messages
from django.core.exceptions import ValidationError
from urllib.parse import urlencode

from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from clusters.models import Cluster
from console import params
from console.roles import role_of
from clusters.actions import DEPLOY
from deployments import forms, pages, services
from deployments.models import Deployment, StoredModel
from deployments.store.services import model_add

POLL_STOP = 286  # htmx's status for "stop polling"
FORM_FIELDS = ("name", "copies", "kind", "gpu_quarters", "memory_per_gpu_gib", "context_length", "engine_options", "routing")


def deployment_list(request):
    return render(request, "deployments/deployment_list.html",
                  pages.deployments_page(role_of(request.user), params.int_param(request.GET, "page"))
                  | {"live_topics": "topic=deployments"})


def _chosen(query) -> tuple[Cluster | None, StoredModel | None]:
    cluster_id, model_id = params.int_param(query, "cluster"), params.int_param(query, "model")
    cluster = Cluster.objects.filter(pk=cluster_id).first() if cluster_id else None
    model = StoredModel.objects.filter(pk=model_id).first() if model_id else None
    return cluster, model


def deployment_new(request):
    """The form; choosing another cluster or model (htmx) fills in what suits that pair."""
    cluster, model = _chosen(request.GET)
    if cluster is None and (clusters := pages.selectors.deploy_clusters()):
        cluster = clusters[0] if len(clusters) == 1 else None
    values = {k: request.GET.get(k) for k in FORM_FIELDS} if request.GET.get("keep") else None
    context = pages.deploy_form_page(cluster=cluster, model=model, role=role_of(request.user), values=values)
    return render(request, "deployments/deployment_form.html", context)


def _form_again(request, cluster, model, *, errors: dict | None = None, plan=None, status: int = 400):
    context = pages.deploy_form_page(cluster=cluster, model=model, role=role_of(request.user),
                                     values={k: request.POST.get(k) for k in FORM_FIELDS})
    context |= {"errors": errors or {}, "plan": plan}
    return _form_answer(request, "deployments/deployment_form.html", "#deploy-form", context, status=status)


def _form_answer(request, template: str, form: str, context: dict, *, status: int):
    """A form posted again: the whole page without htmx; with it the plan alone, or the whole form when
    fields were refused (marked where they are: htmx swaps a 200 only)."""
    if not request.htmx:
        return render(request, template, context, status=status)
    if not context["errors"]:
        return render(request, f"{template}#plan", context)
    response = render(request, template, context)
    response["HX-Retarget"], response["HX-Reswap"], response["HX-Reselect"] = form, "outerHTML", form
    return response


@require_POST
def deployment_model_add(request):
    """A model that is not in the store yet, by its repository on the hub: added (its download starts) and
    chosen in the form; one already in the store is simply chosen. Copies deployed from it wait for it."""
    cluster, _ = _chosen(request.POST)
    repo, revision = request.POST.get("repo", "").strip(), request.POST.get("revision", "").strip() or "main"
    model = StoredModel.objects.filter(repo=repo, revision=revision).first()
    if model is None:
        try:
            model = model_add(repo=repo, revision=revision, user=request.user)
        except ValidationError as exc:
            context = pages.deploy_form_page(cluster=cluster, model=None, role=role_of(request.user))
            context |= {"errors": {"repo": " ".join(exc.messages)}, "repo": repo, "revision": revision}
            return render(request, "deployments/deployment_form.html", context, status=400)
        messages.success(request, f"{model} is added to the store and downloads now: copies deployed from it start "
                                  "once it is here.")
    query = urlencode({"cluster": cluster.pk, "model": model.pk} if cluster else {"model": model.pk})
    return redirect(f"{reverse('deployments:new')}?{query}")


@require_POST
def deployment_plan(request):
    """The plan, before anything starts: each copy's machine and GPUs, or why it cannot be placed."""
    cluster, model = _chosen(request.POST)
    try:
        ask = forms.ask_from(request.POST, cluster=cluster, model=model)
        if problems := services.deployment_ask_problems(ask, user=request.user):
            raise ValidationError(problems)
    except ValidationError as exc:
        return _form_again(request, cluster, model, errors=_errors(exc))
    plan = services.deployment_plan(ask)
    names = dict(cluster.members.values_list("machine_id", "machine__name"))
    return _form_again(request, cluster, model, plan={"rows": pages.plan_rows(plan, names), "unplaced": len(plan.unplaced),
                                                      "placed": len(plan.placed), "copies": ask.copies}, status=200)


@require_POST
def deployment_create(request):
    cluster, model = _chosen(request.POST)
    try:
        ask = forms.ask_from(request.POST, cluster=cluster, model=model)
        deployment = services.deployment_create(ask=ask, queue_rest=bool(request.POST.get("queue_rest")), user=request.user)
    except ValidationError as exc:
        return _form_again(request, cluster, model, errors=_errors(exc))
    messages.success(request, f"Deploying {deployment.name}: its copies get the model's files, then start.")
    response = redirect(deployment)
    if request.htmx:
        response["HX-Redirect"] = response["Location"]
    return response


def _errors(exc: ValidationError) -> dict:
    if hasattr(exc, "error_dict"):
        return {field: " ".join(messages_) for field, messages_ in exc.message_dict.items()}
    return {"all": " ".join(exc.messages)}


def deployment_detail(request, pk: int):
    deployment = get_object_or_404(Deployment.objects.shown().select_related("cluster", "model"), pk=pk)
    return render(request, "deployments/deployment_detail.html",
                  pages.deployment_page(deployment, role_of(request.user)) | pages.deployment_traffic(deployment)
                  | pages.deployment_gateway_charts(deployment) | pages.deployment_engine_charts(deployment)
                  | {"live_topics": f"topic=deployment:{pk}"})


def deployment_traffic(request, pk: int):
    """The page's Traffic card alone, polled every few seconds. A deployment that is gone answers 286: htmx
    stops polling and swaps in nothing, so the card goes (the live part says it was deleted)."""
    deployment = Deployment.objects.filter(pk=pk).first()
    if deployment is None:
        return HttpResponse("", status=POLL_STOP)
    return render(request, "deployments/deployment_detail.html#traffic", pages.deployment_traffic(deployment))


def deployment_charts(request, pk: int):
    """The charts' gateway side alone, polled (the engines' side is pushed); 286 for a deployment that is gone."""
    deployment = Deployment.objects.filter(pk=pk).first()
    if deployment is None:
        return HttpResponse("", status=POLL_STOP)
    return render(request, "deployments/deployment_detail.html#charts-gateway", pages.deployment_gateway_charts(deployment))


def deployment_change(request, pk: int):
    """A deployment's Change form (GET), and its submit: the service replaces the copies one at a time. A form
    sent back as it came says so and restarts nothing."""
    deployment = get_object_or_404(Deployment.objects.shown().select_related("cluster", "model"), pk=pk)
    role = role_of(request.user)
    if request.method != "POST":
        return render(request, "deployments/deployment_change.html", pages.deployment_change_page(deployment, role=role))
    DEPLOY.offer(role).check()  # a Viewer is refused before anything is read
    try:
        ask = forms.change_ask_from(request.POST, deployment)
        if not services.deployment_changes(deployment, ask):
            return _change_again(request, deployment, unchanged=True, status=200)
        services.deployment_change(deployment=deployment, ask=ask, user=request.user)
    except ValidationError as exc:
        return _change_again(request, deployment, errors=_errors(exc))
    messages.success(request, f"Changing {deployment.name}: its copies are replaced one at a time, each new copy "
                              "serving before an old one stops.")
    response = redirect(deployment)
    if request.htmx:
        response["HX-Redirect"] = response["Location"]
    return response


@require_POST
def deployment_change_plan(request, pk: int):
    """Where the replacement copies would go, before anything changes."""
    deployment = get_object_or_404(Deployment.objects.shown().select_related("cluster", "model"), pk=pk)
    try:
        ask = forms.change_ask_from(request.POST, deployment)
        if problems := services.deployment_ask_problems(ask, deployment=deployment, user=request.user):
            raise ValidationError(problems)
    except ValidationError as exc:
        return _change_again(request, deployment, errors=_errors(exc))
    plan = services.deployment_change_plan(deployment=deployment, ask=ask)
    names = dict(deployment.cluster.members.values_list("machine_id", "machine__name"))
    rows = pages.change_plan_rows(plan, names)
    return _change_again(request, deployment, status=200, unchanged=not services.deployment_changes(deployment, ask),
                         plan={"rows": rows, "copies": len(rows), "placed": sum(1 for r in rows if "slots" in r)})


def _change_again(request, deployment, *, errors: dict | None = None, plan: dict | None = None, unchanged: bool = False,
                  status: int = 400):
    context = pages.deployment_change_page(deployment, role=role_of(request.user),
                                           values={k: request.POST.get(k) for k in forms.CHANGE_FIELDS})
    context |= {"errors": errors or {}, "plan": plan, "unchanged": unchanged}
    return _form_answer(request, "deployments/deployment_change.html", "#change-form", context, status=status)


@require_POST
def deployment_scale(request, pk: int):
    deployment = get_object_or_404(Deployment.objects.shown(), pk=pk)
    copies = params.int_param(request.POST, "copies", low=0, high=services.COPIES_MAX)
    try:
        if copies is None:
            raise ValidationError("Give the number of copies, a whole number from 0.")
        services.deployment_scale(deployment=deployment, copies=copies, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"{deployment.name} now wants {copies} cop{'ies' if copies != 1 else 'y'}: only the "
                                  "difference starts or stops.")
    return redirect(deployment)


@require_POST
def deployment_routing(request, pk: int):
    """How the gateway picks a copy: changed at once, no copy restarts."""
    deployment = get_object_or_404(Deployment.objects.shown(), pk=pk)
    try:
        deployment = services.deployment_route(deployment=deployment, routing=request.POST.get("routing", ""),
                                               user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(request, f"{deployment.name} is routed {deployment.get_routing_display().lower()} now: the "
                                  "gateway takes it within a second, and no copy restarts.")
    return redirect(deployment)


@require_POST
def deployment_delete(request, pk: int):
    deployment = get_object_or_404(Deployment.objects.shown(), pk=pk)
    name = deployment.name
    try:
        deleted = services.deployment_delete(deployment=deployment, user=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect(deployment)
    if deleted.job is not None:
        messages.success(request, f"Deleting {name}: {deleted.words}")
        return redirect(deployment)
    (messages.warning if deleted.left_on else messages.success)(request, f"{name}: {deleted.words}")
    return redirect("deployments:list")

"""The Gateway page: the URL clients use, its keys (create one and see its secret once, change its limits,
revoke one) with their usage over the last day, and its traffic, read from what the gateway processes write to
Redis (``deployments/gateway/``)."""
from __future__ import annotations

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db.models import Count, Q
from django.http import HttpResponse
from django.http.request import split_domain_port
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.views.decorators.http import require_POST

from console import params, roles
from console.roles import role_of
from deployments import gateway_keys, gateway_usage
from deployments.choices import ROUTED
from deployments.gateway import failures, traffic
from deployments.models import Deployment, GatewayKey

KEYS_PER_PAGE = 50
DEPLOYMENTS_PER_PAGE = 25
REVOKED_SHOWN = 20


def gateway_url(request) -> str:
    """The URL clients use: FADEN_GATEWAY_URL, else this console's host name on the gateway's port (plain
    HTTP: the gateway itself is not behind TLS until model traffic is encrypted)."""
    if settings.FADEN_GATEWAY_URL:
        return settings.FADEN_GATEWAY_URL
    host, _ = split_domain_port(request.get_host())
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host or 'localhost'}:{settings.FADEN_GATEWAY_PORT}"


def traffic_figures(request) -> dict:
    """What the Gateway page reads from Redis, with the deployments it is about: the totals, traffic per
    deployment (a page of them, by name), the gateway processes that are up and the copies they took out of
    rotation lately. The page renders it, and polls it every few seconds (it changes with nothing to push)."""
    deployments = Paginator(
        Deployment.objects.select_related("cluster", "model").annotate(
            serving=Count("copy_rows", filter=Q(copy_rows__state__in=ROUTED)), total=Count("copy_rows"))
        .order_by("name"), DEPLOYMENTS_PER_PAGE).get_page(params.int_param(request.GET, "page"))
    figures = traffic.traffic([d.pk for d in deployments])
    processes = traffic.gateway_processes()
    # Each gateway process has its own rotation: a copy out in any of them is shown once.
    out = list({copy["copy"]: copy for process in processes or [] for copy in process.get("out_of_rotation", [])}.values())
    out_by_name: dict[str, set[int]] = {}
    for copy in out:
        out_by_name.setdefault(copy["name"], set()).add(copy["copy"])
    rows = [{"deployment": d, "figures": figures.get(d.pk), "out": len(out_by_name.get(d.name, ()))} for d in deployments]
    known = [f for f in figures.values()]
    total = traffic.Traffic()
    for f in known:
        total.requests += f.requests
        total.errors += f.errors
        total.buckets = [a + b for a, b in zip(total.buckets, f.buckets)]
    return {
        "deployments": deployments,
        "rows": rows,
        "figures_missing": bool(rows) and not figures,
        "total": total if known else None,
        "serving_count": Deployment.objects.filter(copy_rows__state__in=ROUTED).distinct().count(),
        "refused": traffic.gateway_refused(),
        "processes": processes,
        "out_of_rotation": out,
        "recent_failures": failures.failures_recent(limit=5),
    }


def gateway_page(request, role: roles.Role | None, *, created: tuple | None = None, form: dict | None = None) -> dict:
    """Keys (a page of the active ones, the latest revoked) and the traffic (``traffic_figures``)."""
    keys = Paginator(GatewayKey.objects.filter(revoked_at__isnull=True).select_related("created_by")
                     .order_by("-created_at", "-pk"), KEYS_PER_PAGE).get_page(params.int_param(request.GET, "keys"))
    revoked = GatewayKey.objects.filter(revoked_at__isnull=False).select_related("revoked_by").order_by("-revoked_at")
    usage = gateway_usage.usage_last_day([key.pk for key in keys])
    for key in keys:
        key.day = usage[key.pk]
        key.limits_words = gateway_keys.limits_in_words(key)
    live = traffic_figures(request)
    rows = live["rows"]
    secret = created[1] if created else ""
    url = gateway_url(request)
    example = next((row["deployment"].name for row in rows if row["deployment"].serving), None) or (
        rows[0]["deployment"].name if rows else "MODEL")
    if created and created[0].deployments:
        example = created[0].deployments[0]
    return live | {
        "gateway_url": url,
        "keys": keys,
        "revoked": list(revoked[:REVOKED_SHOWN]),
        "revoked_count": revoked.count(),
        "names": list(Deployment.objects.order_by("name").values_list("name", flat=True)[:500]),
        "create": gateway_keys.KEY_CREATE.offer(role),
        "revoke": gateway_keys.KEY_REVOKE.offer(role),
        "change_limits": gateway_keys.KEY_LIMITS.offer(role),
        "created": created[0] if created else None,
        "secret": secret,
        "example_model": example,
        "curl": curl_example(url, secret or "$FADEN_KEY", example),
        "form": form or {},
        "role": role,
    }


def curl_example(url: str, secret: str, model: str) -> str:
    return (f"curl {url}/v1/chat/completions \\\n"
            f"  -H \"Authorization: Bearer {secret}\" \\\n"
            f"  -H \"Content-Type: application/json\" \\\n"
            f"  -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'")


# -- the views ------------------------------------------------------------------------------------------


def gateway(request):
    return render(request, "deployments/gateway.html", gateway_page(request, role_of(request.user)))


def gateway_traffic(request):
    """The page's figures, polled every few seconds: the traffic card, with the totals and the copies out of
    rotation sent out of band (they change in Redis, with nothing in the database to push on)."""
    context = traffic_figures(request)
    html = [render_to_string("deployments/gateway.html#traffic", context, request=request),
            render_to_string("deployments/gateway.html#stats", context | {"oob": True}, request=request),
            render_to_string("deployments/gateway.html#rotation", context | {"oob": True}, request=request)]
    return HttpResponse("".join(html))


@require_POST
def gateway_key_create(request):
    """Create a key and show its secret in this answer, once: a 201 with the page, never stored, never cached.

    Not a redirect to the page: the secret would have to wait somewhere (the session) to be shown there.
    Its message names the key, not the secret (messages are the audit trail's words)."""
    name, names = request.POST.get("name", ""), request.POST.getlist("deployments")
    limits = {field: request.POST.get(field, "") for field in gateway_keys.LIMITS}
    role = role_of(request.user)
    try:
        key, secret = gateway_keys.gateway_key_create(name=name, deployments=names, user=request.user, **limits)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return render(request, "deployments/gateway.html",
                      gateway_page(request, role, form={"name": name, "deployments": names, **limits}), status=400)
    limited = f" Limits: {gateway_keys.limits_in_words(key)}." if key.limited else ""
    messages.success(request, f"Created the key {key.name} ({key.prefix}…): copy it now, it is shown only this once.{limited}")
    response = render(request, "deployments/gateway.html", gateway_page(request, role, created=(key, secret)),
                      status=201)
    response["Cache-Control"] = "no-store"
    return response


@require_POST
def gateway_key_limits(request, pk: int):
    """Change a key's limits (the dialog of its row); a refusal is the page again, a 400 with the words."""
    key = get_object_or_404(GatewayKey, pk=pk)
    limits = {field: request.POST.get(field, "") for field in gateway_keys.LIMITS}
    try:
        gateway_keys.gateway_key_limits_change(key=key, user=request.user, **limits)
    except ValidationError as exc:
        messages.error(request, f"The limits of {key.name} stay as they were: {' '.join(exc.messages)}")
        return render(request, "deployments/gateway.html", gateway_page(request, role_of(request.user)), status=400)
    words = f"a limit of {gateway_keys.limits_in_words(key)}" if key.limited else "no limit"
    messages.success(request, f"The key {key.name} ({key.prefix}…) now has {words}: the gateway holds it to that "
                              "within a second.")
    return redirect("gateway:page")


@require_POST
def gateway_key_revoke(request, pk: int):
    key = get_object_or_404(GatewayKey, pk=pk)
    gateway_keys.gateway_key_revoke(key=key, user=request.user)
    messages.success(request, f"Revoked the key {key.name} ({key.prefix}…): the gateway refuses it within a second.")
    return redirect("gateway:page")

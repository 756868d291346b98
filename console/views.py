"""The console's own pages: the dashboard (the panels the apps registered, console/dashboard.py, live
where they say so), the audit trail, and the Users page, where an Administrator adds users, changes
their roles and deactivates them."""
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect, render
from django.template.loader import render_to_string
from django.views.decorators.http import require_POST

from console import audit, params
from console import dashboard as panels
from console import roles, users
from console.choices import AuditOutcome
from console.forms import RoleForm, UserAddForm
from console.models import Job

AUDIT_PAGE_SIZE = 50
USERS_PAGE_SIZE = 50


def dashboard(request):
    shown = panels.panels()
    rendered = [(panel, render_to_string(panel.template, panel.context(request), request=request)) for panel in shown]
    return render(request, "console/dashboard.html", {"panels": rendered, "live_topics": panels.live_topics(shown)})


def recent_jobs(request) -> dict:
    """The dashboard's panel of the last jobs, whatever they ran on."""
    return {"jobs": Job.objects.all()[:8]}


def audit_list(request):
    """Who did what, newest first: Administrators only."""
    audit.may_read(request.user).check()
    shown = {"user": params.text_param(request.GET, "user"), "action": params.text_param(request.GET, "action"),
             "outcome": params.choice_param(request.GET, "outcome", AuditOutcome.values)}
    page = Paginator(audit.audit_entries(**shown), AUDIT_PAGE_SIZE).get_page(params.int_param(request.GET, "page", default=1))
    return render(request, "console/audit_list.html", {"page": page, "entries": page.object_list, "outcomes": AuditOutcome.choices,
                                                        "filters": shown, "filtered": any(shown.values())})


# -- the Users page ---------------------------------------------------------------------------------


def user_list(request, form: UserAddForm | None = None):
    """Every account with its role, last login and whether it may sign in; an Administrator's page."""
    role = roles.role_of(request.user)
    roles.MANAGE_USERS.offer(role).check()
    page = Paginator(get_user_model().objects.order_by("username"), USERS_PAGE_SIZE).get_page(params.int_param(request.GET, "page", default=1))
    held = roles.roles_held(page.object_list)
    node_logins = roles.node_logins_held(page.object_list)
    rows = [{"user": user, "role": held[user.pk], "offer": users.user_offer(user, by=request.user, role=role),
             "node_logins": user.pk in node_logins} for user in page.object_list]
    context = {"rows": rows, "page": page, "form": form or UserAddForm(), "roles": roles.ROLES}
    return render(request, "console/users.html", context, status=400 if form is not None else 200)


@require_POST
def user_add(request):
    form = UserAddForm(request.POST)
    if form.is_valid():
        data = form.cleaned_data
        try:
            user = users.user_create(username=data["username"], email=data["email"], password=data["password"],
                                     role=form.chosen_role(), by=request.user)
        except ValidationError as exc:
            field_errors = exc.error_dict if hasattr(exc, "error_dict") else {"password": exc.error_list}
            for field, errors in field_errors.items():
                form.add_error(field if field in form.fields else None, errors)
        else:
            messages.success(request, f"{user.username} can sign in now, as {form.chosen_role().article} {form.chosen_role()}.")
            return redirect("users")
    return user_list(request, form)


@require_POST
def user_role(request, pk: int):
    user = get_object_or_404(get_user_model(), pk=pk)
    form = RoleForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Pick Viewer, Operator or Administrator.")
        return redirect("users")
    users.user_role_change(user=user, role=form.chosen_role(), by=request.user)
    messages.success(request, f"{user.username} is now {form.chosen_role().article} {form.chosen_role()}.")
    return redirect("users")


@require_POST
def user_node_logins(request, pk: int):
    user = get_object_or_404(get_user_model(), pk=pk)
    allowed = request.POST.get("allowed") == "true"
    try:
        users.user_node_logins_set(user=user, allowed=allowed, by=request.user)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect("users")
    messages.success(request, f"{user.username} may now log in to the machines of clusters as root, with a certificate."
                     if allowed else f"{user.username} can no longer get node login certificates; those signed before "
                                     f"stay valid until they expire.")
    return redirect("users")


@require_POST
def user_active(request, pk: int):
    user = get_object_or_404(get_user_model(), pk=pk)
    active = request.POST.get("active") == "true"
    users.user_active_set(user=user, active=active, by=request.user)
    messages.success(request, f"{user.username} can sign in again." if active else f"{user.username} can no longer sign in.")
    return redirect("users")

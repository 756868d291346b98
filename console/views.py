"""The console's own pages: the dashboard (the panels the apps registered, console/dashboard.py, live where
they say so) and the audit trail."""
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.shortcuts import render
from django.template.loader import render_to_string

from console import audit, params
from console import dashboard as panels
from console.choices import AuditOutcome
from console.models import Job

AUDIT_PAGE_SIZE = 50


def dashboard(request):
    shown = panels.panels()
    rendered = [(panel, render_to_string(panel.template, panel.context(request), request=request)) for panel in shown]
    return render(request, "console/dashboard.html", {"panels": rendered, "live_topics": panels.live_topics(shown)})


def recent_jobs(request) -> dict:
    """The dashboard's panel of the last jobs, whatever they ran on."""
    return {"jobs": Job.objects.all()[:8]}


def audit_list(request):
    """Who did what, newest first: Administrators only."""
    if not audit.may_read(request.user):
        raise PermissionDenied("Only Administrators may read the audit trail.")
    shown = {"user": params.text_param(request.GET, "user"), "action": params.text_param(request.GET, "action"),
             "outcome": params.choice_param(request.GET, "outcome", AuditOutcome.values)}
    page = Paginator(audit.audit_entries(**shown), AUDIT_PAGE_SIZE).get_page(params.int_param(request.GET, "page", default=1))
    return render(request, "console/audit_list.html", {"page": page, "entries": page.object_list, "outcomes": AuditOutcome.choices,
                                                        "filters": shown, "filtered": any(shown.values())})

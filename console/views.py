"""The dashboard: the panels the apps registered (console/dashboard.py), live where they say so."""
from django.shortcuts import render
from django.template.loader import render_to_string

from console import dashboard as panels
from console.models import Job


def dashboard(request):
    shown = panels.panels()
    rendered = [(panel, render_to_string(panel.template, panel.context(request), request=request)) for panel in shown]
    return render(request, "console/dashboard.html", {"panels": rendered, "live_topics": panels.live_topics(shown)})


def recent_jobs(request) -> dict:
    """The dashboard's panel of the last jobs, whatever they ran on."""
    return {"jobs": Job.objects.all()[:8]}

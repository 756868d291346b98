"""The dashboard."""
from django.shortcuts import render

from console.models import Job
from machines.models import MachineEvent
from machines.views import machine_summary


def dashboard(request):
    return render(
        request,
        "console/dashboard.html",
        {
            "summary": machine_summary(),
            "events": MachineEvent.objects.select_related("machine")[:12],
            "jobs": Job.objects.all()[:8],
            "live_topics": "topic=machines",
        },
    )

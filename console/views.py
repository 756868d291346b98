"""The dashboard and the endpoint machines send their heartbeats to."""
import json

from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, JsonResponse
from django.shortcuts import render
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from console.models import Job
from machines import services as machine_services
from machines.models import MachineEvent
from machines.views import machine_summary


def dashboard(request):
    return render(
        request,
        "console/dashboard.html",
        {
            "summary": machine_summary(),
            "events": MachineEvent.objects.select_related("machine").defer("machine__facts")[:12],
            "jobs": Job.objects.all()[:8],
            "live_topics": "topic=machines",
        },
    )


@csrf_exempt
@login_not_required
@require_POST
def agent_heartbeat(request: HttpRequest):
    """A machine's agent says it is alive: ``Authorization: Bearer <its token>``, a small JSON body."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme != "Bearer" or len(request.body) > 16384:
        return JsonResponse({"error": "Send the machine's token as Authorization: Bearer."}, status=401)
    try:
        payload = json.loads(request.body or b"{}")
    except ValueError:
        return JsonResponse({"error": "The body is not JSON."}, status=400)
    machine = machine_services.machine_heartbeat(token=token.strip(), payload=payload if isinstance(payload, dict) else {})
    if machine is None:
        return JsonResponse({"error": "No machine holds this token; enrol the machine again."}, status=401)
    return JsonResponse({"ok": True, "machine": machine.name, "state": machine.state})


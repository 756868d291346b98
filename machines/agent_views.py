"""What the machines' agents send to the console: their heartbeats."""
import json

from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from machines import services


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
    machine = services.machine_heartbeat(token=token.strip(), payload=payload if isinstance(payload, dict) else {})
    if machine is None:
        return JsonResponse({"error": "No machine holds this token; enrol the machine again."}, status=401)
    return JsonResponse({"ok": True, "machine": machine.name, "state": machine.state})

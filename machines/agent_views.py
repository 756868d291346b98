"""What the machines' agents send to the console: their heartbeats."""
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from console import bodies
from console.agent_tls import agents_over_tls
from machines import services

# A heartbeat is a few hundred bytes of JSON (the agent's version, its runtime section); this leaves room and no more.
MAX_BODY = 16 * 1024
NO_TOKEN = "Send the machine's token as Authorization: Bearer."
UNKNOWN_TOKEN = "No machine holds this token; enrol the machine again."


@csrf_exempt
@login_not_required
@require_POST
@agents_over_tls
def agent_heartbeat(request: HttpRequest):
    """A machine's agent says it is alive: ``Authorization: Bearer <its token>``, a small JSON body.

    The token is checked first: nothing of the body is read for a caller without one.
    """
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme != "Bearer":
        return JsonResponse({"error": NO_TOKEN}, status=401)
    machine = services.machine_by_heartbeat_token(token.strip())
    if machine is None:
        return JsonResponse({"error": UNKNOWN_TOKEN}, status=401)
    try:
        payload = _payload(request)
    except bodies.BodyRefused as exc:
        return JsonResponse({"error": exc.message}, status=exc.status)
    machine = services.machine_heartbeat(machine=machine, payload=payload)
    if machine is None:
        return JsonResponse({"error": UNKNOWN_TOKEN}, status=401)
    return JsonResponse({"ok": True, "machine": machine.name, "state": machine.state})


def _payload(request: HttpRequest) -> dict:
    """The body as a JSON object (an empty body is an empty one), read within MAX_BODY bytes."""
    raw = bodies.read_bounded(request, limit=MAX_BODY)
    payload = bodies.json_loads(raw) if raw else {}
    return payload if isinstance(payload, dict) else {}

"""The console's error answers (handler400/403/404/500): JSON with a ``message`` under /api/, a page
in the console's shell elsewhere, so nobody gets Django's plain pages or a traceback.

A bad parameter (``console.params.InvalidParameter``) says what was wrong; a body over
DATA_UPLOAD_MAX_MEMORY_SIZE is a 413. Errors inside an API view are answered by DRF and
``console.api.exception_handler``; these handlers answer the rest: a URL that matches nothing, a
body Django refuses before any view, a crash.
"""
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string

from console import bodies
from console.params import InvalidParameter

API_PREFIX = "/api/"
TITLES = {400: "Bad request", 404: "Not found", 413: "Request too large", 500: "Server error"}


def _answer(request: HttpRequest, status: int, message: str) -> HttpResponse:
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"message": message}, status=status)
    return render(request, "console/error.html", {"title": TITLES[status], "message": message}, status=status)


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if isinstance(exception, RequestDataTooBig):
        return _answer(request, 413, bodies.too_large(settings.DATA_UPLOAD_MAX_MEMORY_SIZE).message)
    if isinstance(exception, TooManyFieldsSent):
        return _answer(request, 400, "The request has more fields than the console accepts.")
    if isinstance(exception, InvalidParameter):
        return _answer(request, 400, str(exception))
    return _answer(request, 400, "The console could not read this request.")


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """A role's refusal ("Your role is Viewer: ... needs an Operator."): on a page, the one that says
    what to do about it (templates/403.html)."""
    said = str(exception) if exception and exception.args else ""
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"message": said or "You are not allowed to do this."}, status=403)
    return render(request, "403.html", {"exception": said}, status=403)


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    # A URL that matches no pattern raises Http404 with a dict of what was tried: not for a reader.
    said = exception.args[0] if exception and exception.args and isinstance(exception.args[0], str) else ""
    where = "API endpoint" if request.path.startswith(API_PREFIX) else "page"
    return _answer(request, 404, said or f"There is no such {where}: {request.path}")


def server_error(request: HttpRequest) -> HttpResponse:
    """Nothing here may fail in turn: no database, no user, no template beyond a plain one."""
    message = "Something went wrong on the console; the error is in its log."
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"message": message}, status=500)
    return HttpResponse(render_to_string("console/server_error.html", {"message": message}), status=500)

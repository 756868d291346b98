"""The audit trail: who did what, when, from where, and how it ended.

One uniform way for everything a person does through the console: ``AuditMiddleware``
writes an entry for every request that may change something (any method but GET, HEAD
and OPTIONS) to the pages, the API and the admin, whether it was done or refused, with
the url's name and arguments as what and where it was done, and the words the person
read (the page's message, the API's ``message``) as its outcome. What happens outside
such a request, or more precisely than its url says, is recorded by the signals in
``console/audit_signals.py``: sign-ins and failed ones, API tokens made and revoked,
changes of roles (groups) and of an account's flags.

The machines' own endpoints (``/agent/``: heartbeats, image downloads) are not people's
actions and are left out: a thousand machines beat every ten seconds.
"""
from __future__ import annotations

import ipaddress
from contextvars import ContextVar
from datetime import datetime
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib import messages
from django.contrib.messages.storage.fallback import FallbackStorage
from django.http import HttpRequest, HttpResponse
from django.shortcuts import resolve_url
from django.urls import Resolver404, resolve

from console.choices import AuditOutcome
from console.models import AuditEntry
from console.pruning import delete_in_batches

UNAUDITED_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
UNAUDITED_PREFIXES = ("/agent/", "/static/")
SIGNALLED_VIEWS = frozenset({"login", "logout", "admin:login", "admin:logout"})  # recorded by audit_signals
MESSAGE_MAX = 1000  # characters of a message kept

REFUSED_BECAUSE = {
    400: "The request was not valid.",
    401: "Not signed in.",
    403: "Not allowed.",
    404: "Not found.",
    405: "Not allowed on this address.",
    413: "Too large.",
    429: "Too many tries.",
}

# The request being answered, for the signals that record what it changed (a token, a user's groups).
current_request: ContextVar[HttpRequest | None] = ContextVar("audit_current_request", default=None)


def audit_prune(older_than: datetime) -> int:
    """Delete the entries written before ``older_than`` (the beat's pruning, FADEN_KEEP_AUDIT_DAYS)."""
    return delete_in_batches(AuditEntry.objects.filter(at__lt=older_than))


def client_address(request: HttpRequest) -> str | None:
    """Where the request came from: the address the proxy saw, behind FADEN_BEHIND_PROXY; else the peer's.

    The proxy appends the address it saw to X-Forwarded-For: the last one is the proxy's own word,
    the earlier ones are the client's and could be anything.
    """
    address = request.META.get("REMOTE_ADDR", "")
    if settings.FADEN_BEHIND_PROXY and (forwarded := request.META.get("HTTP_X_FORWARDED_FOR", "")):
        address = forwarded.split(",")[-1].strip()
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        return None


def may_read(user) -> bool:
    """Whether the user may read the audit trail: Administrators (one place to swap for the roles' helper)."""
    return bool(user and user.is_authenticated and (user.is_superuser or user.groups.filter(name="Administrator").exists()))


def audit_entries(*, user: str = "", outcome: str = "", action: str = ""):
    """The entries, newest first, narrowed by part of a user name, an outcome and the start of an action:
    the one filter the page and the API share."""
    entries = AuditEntry.objects.all()
    if user:
        entries = entries.filter(username__icontains=user)
    if outcome in AuditOutcome.values:
        entries = entries.filter(outcome=outcome)
    if action:
        entries = entries.filter(action__startswith=action)
    return entries


def audit_record(*, action: str, outcome: str, request: HttpRequest | None = None, user=None, username: str = "",
                 target: str = "", status: int | None = None, message: str = "") -> AuditEntry:
    """Write one entry. Who and from where come from ``request`` (or the request being answered) unless given."""
    request = request if request is not None else current_request.get()
    if user is None and request is not None:
        user = getattr(request, "user", None)
    if user is not None and not user.is_authenticated:
        user = None
    return AuditEntry.objects.create(
        user=user, username=username or (user.get_username() if user else ""), action=action[:100],
        method=(request.method or "") if request is not None else "", target=target[:300],
        address=client_address(request) if request is not None else None, outcome=outcome, status=status,
        message=message[:MESSAGE_MAX],
    )


class AuditedMessageStorage(FallbackStorage):
    """Django's message storage, also keeping the request's messages for its audit entry: the pages say
    what happened (or why not) in a message, and the entry keeps the same words."""

    def add(self, level, message, extra_tags=""):
        super().add(level, message, extra_tags)
        self.request.audit_messages = [*getattr(self.request, "audit_messages", []), (level, str(message))]


class AuditMiddleware:
    """Record every request that may change something, done or refused (see the module's docstring)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.method in UNAUDITED_METHODS or request.path.startswith(UNAUDITED_PREFIXES):
            return self.get_response(request)
        token = current_request.set(request)
        try:
            response = self.get_response(request)
        finally:
            current_request.reset(token)
        action, target = _what(request)
        if action not in SIGNALLED_VIEWS:
            outcome, message = _outcome(request, response)
            audit_record(request=request, action=action, target=target, outcome=outcome, status=response.status_code,
                         message=message)
        return response


def _what(request: HttpRequest) -> tuple[str, str]:
    """The url's name (``clusters:stop``) and what it names (``/clusters/3/stop/``); the path when it has no name."""
    try:
        match = resolve(request.path_info)
    except Resolver404:
        return request.path, request.path
    return match.view_name or request.path, request.path


def _outcome(request: HttpRequest, response: HttpResponse) -> tuple[str, str]:
    """Done, shown again, refused or failed, and in the words the person read."""
    status = response.status_code
    said = getattr(request, "audit_messages", [])
    errors = [text for level, text in said if level >= messages.WARNING]
    words = _api_message(response) or " ".join(errors or [text for _, text in said])
    if status >= 500:
        return AuditOutcome.FAILED, words or "The console could not answer."
    if status >= 400:
        return AuditOutcome.REFUSED, words or REFUSED_BECAUSE.get(status, "Refused.")
    if _sent_to_sign_in(request, response):
        return AuditOutcome.REFUSED, "Not signed in."
    if errors:
        return AuditOutcome.REFUSED, words
    if status == 200 and response.get("Content-Type", "").startswith("text/html") and "HX-Redirect" not in response:
        return AuditOutcome.SHOWN, words or "The page answered with its form again: its errors, or a step to confirm."
    return AuditOutcome.DONE, words


def _api_message(response: HttpResponse) -> str:
    data = getattr(response, "data", None)  # a DRF Response
    return str(data.get("message", "")) if isinstance(data, dict) else ""


def _sent_to_sign_in(request: HttpRequest, response: HttpResponse) -> bool:
    """An anonymous request that the page shell sent to the sign-in page."""
    user = getattr(request, "user", None)
    if response.status_code not in (301, 302, 303) or (user and user.is_authenticated):
        return False
    return urlsplit(response.get("Location", "")).path == resolve_url(settings.LOGIN_URL)

"""Signing in: every failure is logged and audited, and a run of them is stopped for a while.

django-axes counts failed sign-ins per address and per user name (``AXES_*`` in the settings):
after ``FADEN_LOGIN_FAILURE_LIMIT`` in a row from one address, or for one name, it refuses
every sign-in from there or for that name for ``FADEN_LOGIN_LOCKOUT_MINUTES``, a correct
password included. This module says so to the person (``lockout_response``) and writes each
failure to the log and the audit trail. API clients authenticate with tokens, which cannot be
guessed; there is no password sign-in on the API to throttle.
"""
from __future__ import annotations

import logging

from django.conf import settings
from django.contrib.auth import user_login_failed
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from console.audit import audit_record, client_address
from console.choices import AuditOutcome

log = logging.getLogger(__name__)

LOCKED_OUT_STATUS = 429


def lockout_message() -> str:
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    return (f"Too many failed sign-ins from this address or for this user name: sign-ins are refused "
            f"for {minutes} minutes. Try again later, or ask an administrator to lift the block.")


def lockout_response(request: HttpRequest, original_response=None, credentials=None) -> HttpResponse:
    """What a refused sign-in answers (axes' AXES_LOCKOUT_CALLABLE): the sign-in page's words, or JSON for the API."""
    if request.path.startswith("/api/"):
        return JsonResponse({"message": lockout_message()}, status=LOCKED_OUT_STATUS)
    return render(request, "registration/locked_out.html", {"message": lockout_message()}, status=LOCKED_OUT_STATUS)


def _on_login_failed(sender, credentials, request=None, **kwargs) -> None:
    """Log and audit a failed sign-in with the name tried and the address it came from (never the password)."""
    username = str((credentials or {}).get("username", ""))[:150]
    address = client_address(request) if request is not None else None
    locked = bool(getattr(request, "axes_locked_out", False))
    # Locked: this failure reached the limit, or came while sign-ins from there or for that name are refused.
    why = "too many failed sign-ins, refused for a while" if locked else "wrong user name or password"
    log.warning("Failed sign-in for %r from %s: %s", username, address or "an unknown address", why)
    audit_record(action="login.failed", outcome=AuditOutcome.REFUSED, request=request, username=username,
                 target=f"user {username}", status=LOCKED_OUT_STATUS if locked else None, message=why.capitalize() + ".")


def connect_signals() -> None:
    """Called from the console's AppConfig.ready, after axes' own receiver (it marks a lockout on the request)."""
    user_login_failed.connect(_on_login_failed, dispatch_uid="logins.login_failed")

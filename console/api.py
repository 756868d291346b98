"""Shared pieces of the REST API: errors as JSON a person can read, the browsable API under the CSP.

Named in the settings (REST_FRAMEWORK), so this module imports no view: DRF's views read those settings
when they are defined. The console's own API is in console/audit_api.py."""
from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.utils.csp import CSP, build_policy
from rest_framework import exceptions, renderers, serializers
from rest_framework.views import exception_handler as drf_exception_handler


def _first_message(detail) -> str:
    if isinstance(detail, dict):
        for field, value in detail.items():
            text = _first_message(value)
            return text if field in ("non_field_errors", "detail") else f"{field}: {text}"
    if isinstance(detail, list) and detail:
        return _first_message(detail[0])
    return str(detail)


def exception_handler(exc, context):
    """DRF's handler, plus Django's ValidationError, plus a top-level ``message`` in every error."""
    if isinstance(exc, DjangoValidationError):
        exc = serializers.ValidationError(exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages})
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    data = response.data
    if isinstance(exc, exceptions.ValidationError):
        response.data = {"message": _first_message(data), "errors": data}
    elif isinstance(data, dict) and "detail" in data:
        response.data = {"message": str(data["detail"])}
    return response


class BrowsableAPIRenderer(renderers.BrowsableAPIRenderer):
    """DRF's HTML pages of the API, under the console's Content-Security-Policy but for inline styles.

    DRF's templates put style attributes on their buttons and Pygments' rules in a <style> element;
    inline styles run no script, and every script of these pages is a file, so only style-src is
    widened. A CSP header set on the response is left as it is by Django's middleware.
    """

    def render(self, data, accepted_media_type=None, renderer_context=None):
        response = (renderer_context or {}).get("response")
        if response is not None and settings.SECURE_CSP:
            policy = {**settings.SECURE_CSP, "style-src": [CSP.SELF, CSP.UNSAFE_INLINE]}
            response.headers[CSP.HEADER_ENFORCE] = build_policy(policy)
        return super().render(data, accepted_media_type, renderer_context)


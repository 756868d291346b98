"""Shared pieces of the REST API: errors as JSON a person can read."""
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions, serializers
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

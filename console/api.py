"""Shared pieces of the REST API: errors as JSON a person can read, input read within bounds, and
the browsable API under the CSP.

Every refusal is ``{"message": ...}`` (a 400 adds ``errors``, by field). Bodies are JSON only, at
most DATA_UPLOAD_MAX_MEMORY_SIZE bytes and ``bodies.MAX_DEPTH`` levels deep; ids and page numbers
are parsed by ``console.params``. Errors raised outside a view (a URL that matches nothing, a
crash) are answered by ``console.errors`` in the same shape.

Named in the settings (REST_FRAMEWORK), so this module imports no view: DRF's views read those settings
when they are defined. The console's own API is in console/audit_api.py."""
from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.utils.csp import CSP, build_policy
from django.utils.module_loading import import_string
from rest_framework import exceptions, pagination, parsers, renderers, serializers, status

from console import bodies, params


def _first_message(detail) -> str:
    if isinstance(detail, dict):
        for field, value in detail.items():
            text = _first_message(value)
            return text if field in ("non_field_errors", "detail") else f"{field}: {text}"
    if isinstance(detail, list) and detail:
        return _first_message(detail[0])
    return str(detail)


def drf_exception_handler(exc, context):
    """DRF's own handler, found when first called. Importing rest_framework.views here would be
    circular: defining APIView reads DEFAULT_RENDERER_CLASSES, which names this module, so whichever
    setting is read first (a system check reading DEFAULT_PAGINATION_CLASS, say) broke the other."""
    return import_string("rest_framework.views.exception_handler")(exc, context)


def exception_handler(exc, context):
    """DRF's handler, plus Django's ValidationError and a bad parameter, plus a top-level ``message``
    in every error."""
    if isinstance(exc, DjangoValidationError):
        exc = serializers.ValidationError(exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages})
    elif isinstance(exc, params.InvalidParameter):
        exc = serializers.ValidationError({exc.name: [exc.message]})
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    data = response.data
    if isinstance(exc, exceptions.ValidationError):
        response.data = {"message": _first_message(data), "errors": data}
    elif isinstance(data, dict) and "detail" in data:
        response.data = {"message": str(data["detail"])}
    return response


class RequestTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = "too_large"


class JSONParser(parsers.JSONParser):
    """JSON bodies within the console's bounds (``console.bodies``): too large is a 413, too deep a 400."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return bodies.json_loads(bodies.read_bounded(stream, limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE))
        except bodies.BodyRefused as exc:
            raise (RequestTooLarge if exc.status == 413 else exceptions.ParseError)(exc.message) from None


class PageNumberPagination(pagination.PageNumberPagination):
    """DRF's pages, with ``?page=`` parsed strictly: not a number is a 400; past the last page, a 404."""

    def get_page_number(self, request, paginator):
        if request.query_params.get(self.page_query_param) in self.last_page_strings:
            return paginator.num_pages
        return params.int_param(request.query_params, self.page_query_param, default=1)


class IntegerField(serializers.IntegerField):
    """A whole number in a body, parsed as ``console.params`` does: a JSON number, or a string of the
    digits 0-9 (DRF's own reads "١٢" as 12), within ``min_value`` and ``max_value``."""

    def to_internal_value(self, data):
        low = 0 if self.min_value is None else self.min_value
        high = params.ID_MAX if self.max_value is None else self.max_value
        try:
            return params.parse_int(data, name=self.field_name, low=low, high=high)
        except params.InvalidParameter as exc:
            raise serializers.ValidationError(exc.message, code="invalid") from None


class IdField(IntegerField):
    """An id in a body: from 1 to the largest the database holds."""

    def __init__(self, **kwargs):
        super().__init__(min_value=1, max_value=params.ID_MAX, **kwargs)


class TextField(serializers.CharField):
    """A string in a body, and only a string: DRF's own takes the number 0 as "0"."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise serializers.ValidationError("Give a string.", code="invalid")
        return super().to_internal_value(data)


def id_list_field(**kwargs) -> serializers.ListField:
    """A list of ids, at most ``params.MAX_IDS`` of them."""
    return serializers.ListField(child=IdField(), max_length=params.MAX_IDS, **kwargs)


class ErrorSerializer(serializers.Serializer):
    """Every error the API answers: what went wrong in a sentence, and for a 400 each field's refusals."""

    message = serializers.CharField()
    errors = serializers.DictField(required=False, help_text="For a 400: the refusals by field (non_field_errors, detail or a field's name)")


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

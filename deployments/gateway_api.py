"""REST for the gateway's keys (``/api/gateway/keys/``): list, create with the secret shown once, change the
limits (PATCH), read the usage by the hour (``usage/``), revoke. Same services as the Gateway page; their
refusals are 400s (or 403s for a role) with the service's own message."""
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from console import api, params
from deployments import gateway_keys, gateway_usage
from deployments.models import GatewayKey

LIMITS_HELP = {
    "requests_per_minute": "Requests a minute the gateway lets through with this key (a sliding minute, every gateway "
                           "process together); null: no limit. Over it: 429 with Retry-After",
    "tokens_per_minute": "Prompt and completion tokens a minute, as the copies' answers count them (usage); null: no "
                         "limit. Once a minute's tokens are used, the next requests get 429 with Retry-After",
}


@extend_schema_field({"type": "integer", "minimum": 1, "nullable": True})
class LimitField(serializers.Field):
    """A limit as given: the service (``gateway_keys.gateway_key_limits_check``) reads it and says what is wrong
    with it in words (a negative number, zero, not a number)."""

    def to_internal_value(self, data):
        return data

    def to_representation(self, value):
        return value


class GatewayKeySerializer(serializers.ModelSerializer):
    created_by = serializers.SerializerMethodField()
    deployments = serializers.ListField(child=serializers.CharField(), read_only=True,
                                        help_text="The deployment names the key may use; empty: every one")
    requests_per_minute = serializers.IntegerField(read_only=True, allow_null=True, help_text=LIMITS_HELP["requests_per_minute"])
    tokens_per_minute = serializers.IntegerField(read_only=True, allow_null=True, help_text=LIMITS_HELP["tokens_per_minute"])

    class Meta:
        model = GatewayKey
        fields = ["id", "name", "prefix", "deployments", "requests_per_minute", "tokens_per_minute", "created_by",
                  "created_at", "last_used_at", "revoked_at"]

    def get_created_by(self, key) -> str | None:
        return key.created_by.get_username() if key.created_by else None


class GatewayKeyCreatedSerializer(GatewayKeySerializer):
    secret = serializers.CharField(help_text="The key itself: shown in this answer only, never again")

    class Meta(GatewayKeySerializer.Meta):
        fields = [*GatewayKeySerializer.Meta.fields, "secret"]


class GatewayKeyCreateSerializer(serializers.Serializer):
    name = api.TextField(max_length=gateway_keys.KEY_NAME_MAX, help_text="What or who the key is for")
    deployments = serializers.ListField(child=api.TextField(max_length=63), required=False, max_length=500,
                                        help_text="Limit the key to these deployment names; left out or empty: every one")
    requests_per_minute = LimitField(required=False, allow_null=True, help_text=LIMITS_HELP["requests_per_minute"])
    tokens_per_minute = LimitField(required=False, allow_null=True, help_text=LIMITS_HELP["tokens_per_minute"])


class GatewayKeyLimitsSerializer(serializers.Serializer):
    requests_per_minute = LimitField(required=False, allow_null=True,
                                     help_text=LIMITS_HELP["requests_per_minute"] + "; left out: unchanged")
    tokens_per_minute = LimitField(required=False, allow_null=True,
                                   help_text=LIMITS_HELP["tokens_per_minute"] + "; left out: unchanged")


class UsageFiguresSerializer(serializers.Serializer):
    requests = serializers.IntegerField(help_text="Sent on to a copy")
    errors = serializers.IntegerField(help_text="Of those, answers of 500 and above and copies that could not be reached")
    refused = serializers.IntegerField(help_text="Over the key's limits: answered 429, not sent on")
    prompt_tokens = serializers.IntegerField(help_text="As the copies' answers count them (usage)")
    completion_tokens = serializers.IntegerField(help_text="As the copies' answers count them; a stream counts them when "
                                                            "its client asked for usage (stream_options include_usage)")


class UsageHourSerializer(UsageFiguresSerializer):
    hour = serializers.DateTimeField(help_text="The hour's start")


class KeyUsageSerializer(serializers.Serializer):
    key = serializers.IntegerField()
    start = serializers.DateTimeField(source="from", help_text="The first hour's start")
    end = serializers.DateTimeField(source="to", help_text="The last hour's end")
    hours = UsageHourSerializer(many=True, help_text="Every hour from the oldest, zeros included")
    total = UsageFiguresSerializer()


class GatewayKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """The gateway's API keys. Every role reads them (never their secret) and their usage; Operators create them,
    change their limits and revoke them."""

    queryset = GatewayKey.objects.select_related("created_by").order_by("-created_at", "-pk")
    serializer_class = GatewayKeySerializer

    @extend_schema(request=GatewayKeyCreateSerializer, responses={201: GatewayKeyCreatedSerializer})
    def create(self, request):
        """Create a key, with its limits if given. The answer holds its ``secret`` once: the console keeps only its sha256."""
        data = GatewayKeyCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        given = data.validated_data
        key, secret = gateway_keys.gateway_key_create(name=given["name"], deployments=given.get("deployments"),
                                                      requests_per_minute=given.get("requests_per_minute"),
                                                      tokens_per_minute=given.get("tokens_per_minute"), user=request.user)
        key = self.get_queryset().get(pk=key.pk)
        return Response({**GatewayKeySerializer(key).data, "secret": secret}, status=status.HTTP_201_CREATED)

    @extend_schema(request=GatewayKeyLimitsSerializer, responses={200: GatewayKeySerializer})
    def partial_update(self, request, pk=None):
        """Change the key's limits: each field given is set (null: no limit), each left out stays. The gateway
        holds the key to them within a second; what it counted in the last minute still counts."""
        key = self.get_object()
        data = GatewayKeyLimitsSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        gateway_keys.gateway_key_limits_change(key=key, user=request.user, **data.validated_data)
        return Response(GatewayKeySerializer(self.get_queryset().get(pk=key.pk)).data)

    @extend_schema(parameters=[OpenApiParameter("hours", OpenApiTypes.INT, description=(
        f"How many hours back, this one included: 1 to {gateway_usage.HOURS_MAX} (the 30 days kept); 24 when left out"))],
        responses={200: KeyUsageSerializer})
    @action(detail=True, methods=["get"])
    def usage(self, request, pk=None):
        """The key's usage by the hour, added up over every gateway process (written to the console within
        FADEN_GATEWAY_USAGE_TICK seconds): requests, errors, refusals by its limits, prompt and completion tokens."""
        hours = params.int_param(request.query_params, "hours", default=24, high=gateway_usage.HOURS_MAX)
        return Response(KeyUsageSerializer(gateway_usage.usage_hours(self.get_object(), hours=hours)).data)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request, pk=None):
        """Revoke the key: the gateway refuses it within a second. It stays listed, with ``revoked_at``."""
        gateway_keys.gateway_key_revoke(key=self.get_object(), user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

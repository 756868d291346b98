"""REST for the gateway's keys (``/api/gateway/keys/``): list, create with the secret shown once, revoke.
Same services as the Gateway page; their refusals are 400s (or 403s for a role) with the service's own message."""
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from console import api
from deployments import gateway_keys
from deployments.models import GatewayKey


class GatewayKeySerializer(serializers.ModelSerializer):
    created_by = serializers.SerializerMethodField()
    deployments = serializers.ListField(child=serializers.CharField(), read_only=True,
                                        help_text="The deployment names the key may use; empty: every one")

    class Meta:
        model = GatewayKey
        fields = ["id", "name", "prefix", "deployments", "created_by", "created_at", "last_used_at", "revoked_at"]

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


class GatewayKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """The gateway's API keys. Every role reads them (never their secret); Operators create and revoke them."""

    queryset = GatewayKey.objects.select_related("created_by").order_by("-created_at", "-pk")
    serializer_class = GatewayKeySerializer

    @extend_schema(request=GatewayKeyCreateSerializer, responses={201: GatewayKeyCreatedSerializer})
    def create(self, request):
        """Create a key. The answer holds its ``secret`` once: the console keeps only its sha256."""
        data = GatewayKeyCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        key, secret = gateway_keys.gateway_key_create(name=data.validated_data["name"],
                                                  deployments=data.validated_data.get("deployments"), user=request.user)
        key = self.get_queryset().get(pk=key.pk)
        return Response({**GatewayKeySerializer(key).data, "secret": secret}, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request, pk=None):
        """Revoke the key: the gateway refuses it within a second. It stays listed, with ``revoked_at``."""
        gateway_keys.gateway_key_revoke(key=self.get_object(), user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

"""/api/settings/hugging-face-token/: whether the server's Hugging Face token is set and where from (every
role), and setting, replacing and removing it (Administrators; the others get the role's 403). The page
is deployments/store/hub_token_views.py; both call deployments/store/hub_token.py.

The token goes in (PUT) and never comes out: every answer is ``{"set": ..., "source": ...}``. Answers
are JSON only: DRF's browsable pages fill their forms again with what was sent.
"""
from django.views.decorators.debug import sensitive_variables
from drf_spectacular.utils import extend_schema
from rest_framework import renderers, serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from deployments.store import hub_token


class HfTokenStateSerializer(serializers.Serializer):
    set = serializers.BooleanField(help_text="Whether the console has a token to download with")
    source = serializers.ChoiceField(
        choices=[hub_token.SOURCE_ENVIRONMENT, hub_token.SOURCE_SETTINGS], allow_null=True,
        help_text="environment: FADEN_HF_TOKEN gives it (and wins); settings: set here or on the Settings page; null: none")


class TokenField(serializers.CharField):
    """Text only: DRF's CharField would take the number 12345678 as the string "12345678"."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise serializers.ValidationError("The token must be text.", code="invalid")
        return super().to_internal_value(data)


class HfTokenSerializer(serializers.Serializer):
    token = TokenField(write_only=True, trim_whitespace=False, allow_blank=True,
                       help_text="The token from your Hugging Face account: 8 to 1024 printable ASCII characters")

    @sensitive_variables()
    def validate_token(self, value: str) -> str:
        return hub_token.hf_token_clean(value)


def state() -> dict:
    source = hub_token.hf_token_source()
    return {"set": source is not None, "source": source}


class HfTokenView(APIView):
    """The server's Hugging Face token, as set or not set."""

    renderer_classes = (renderers.JSONRenderer,)

    @extend_schema(responses=HfTokenStateSerializer)
    def get(self, request):
        """Whether a token is set, and where it comes from; never the token."""
        return Response(state())

    @extend_schema(request=HfTokenSerializer, responses=HfTokenStateSerializer)
    @sensitive_variables()
    def put(self, request):
        """Set or replace the token (Administrators). FADEN_HF_TOKEN, when set, still wins."""
        hub_token.may_change_settings(request.user).check()
        data = HfTokenSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        hub_token.hf_token_set(token=data.validated_data["token"], by=request.user)
        return Response(state())

    @extend_schema(request=None, responses={200: HfTokenStateSerializer})
    def delete(self, request):
        """Remove the token set here (Administrators); one from FADEN_HF_TOKEN stays."""
        hub_token.hf_token_remove(by=request.user)
        return Response(state())

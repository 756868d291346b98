"""/api/profile/keys/: your own SSH public keys (list, add, read, remove). Every person with a role has a
profile; nobody reads or removes another's keys (another person's key id is a 404, as a missing one)."""
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from machines import user_keys
from machines.models import UserPublicKey


class UserPublicKeySerializer(serializers.ModelSerializer):
    key = serializers.CharField(max_length=20000, trim_whitespace=False,
                                help_text="One OpenSSH public key line: ssh-ed25519 AAAA... you@laptop; answered as stored")
    name = serializers.CharField(max_length=100, help_text="What you call it: laptop")

    class Meta:
        model = UserPublicKey
        fields = ["id", "name", "key", "fingerprint", "added_at"]
        read_only_fields = ["id", "fingerprint", "added_at"]
        validators = []  # the model's full_clean in the service says it, in its own words


class ProfileKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin,
                        mixins.DestroyModelMixin, viewsets.GenericViewSet):
    """Your SSH public keys: POST /api/clusters/<id>/ssh-certificates/ signs one of them by its name (``key``)."""

    serializer_class = UserPublicKeySerializer
    pagination_class = None  # a person's handful of keys

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # the schema's look at the view: no person asking
            return UserPublicKey.objects.none()
        return user_keys.user_public_keys(self.request.user)

    @extend_schema(request=UserPublicKeySerializer, responses={201: UserPublicKeySerializer})
    def create(self, request, *args, **kwargs):
        """Add a key: refused with the rules' sentence (a private key, a certificate, a weak type...), or
        when you have this key or this name already."""
        data = self.get_serializer(data=request.data)
        data.is_valid(raise_exception=True)
        row = user_keys.user_public_key_add(user=request.user, **data.validated_data)
        return Response(self.get_serializer(row).data, status=status.HTTP_201_CREATED)

    def destroy(self, request, *args, **kwargs):
        """Remove a key. Certificates signed for it stay valid until they expire."""
        user_keys.user_public_key_remove(user=request.user, key_id=self.get_object().pk)
        return Response(status=status.HTTP_204_NO_CONTENT)

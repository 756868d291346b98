"""``encryption`` in GET /api/clusters/<id>/: what the encryption card says (clusters/encryption.py). Its
buttons: clusters/encryption_actions.py."""
from rest_framework import serializers

from clusters import encryption


class RayEncryptionSerializer(serializers.Serializer):
    token = serializers.BooleanField(help_text="Ray authenticates with the cluster's token (always)")
    tls = serializers.BooleanField(help_text="Ray between the machines uses TLS; false: POST encrypt/ turns it on")


class EncryptionModelTrafficSerializer(serializers.Serializer):
    mutual_tls = serializers.BooleanField(help_text="The gateway and the checks reach the copies over mutual TLS")


class CertificatesSerializer(serializers.Serializer):
    roles = serializers.ListField(child=serializers.CharField(), help_text="node (Ray), copy (a copy's server): what each machine holds")
    not_after = serializers.DateTimeField(allow_null=True, help_text="The earliest expiry of the certificates issued")
    ray_not_after = serializers.DateTimeField(allow_null=True, help_text="The earliest expiry of those Ray's servers started with")
    missing = serializers.ListField(child=serializers.CharField(), help_text="Machines without a certificate yet")
    days = serializers.IntegerField(help_text="How long a certificate lasts (FADEN_CERT_DAYS)")
    restart_by = serializers.DateTimeField(allow_null=True, help_text="Restart before then: Ray's certificates are due")


class EncryptionSerializer(serializers.Serializer):
    ray = RayEncryptionSerializer()
    model_traffic = EncryptionModelTrafficSerializer()
    certificates = CertificatesSerializer()


def encryption_field(cluster) -> dict:
    return EncryptionSerializer(encryption.encryption_of(cluster)).data

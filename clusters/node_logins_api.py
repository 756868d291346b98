"""REST for node logins taken back: GET /api/clusters/<id>/node-logins/ lists the certificates signed for the
cluster's nodes (newest first: who, which key, what they open, until when, whether taken back), and POST
/api/clusters/<id>/node-logins/<serial>/revoke/ takes one back (Administrators; 403 for anyone else, 404
for a serial that is not the cluster's): the cluster's revocation list goes to its machines at once.
"""
from django.core.exceptions import ValidationError
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.response import Response

from clusters import node_logins
from clusters.models import NodeCertificate
from console import params


class NodeLoginSerializer(serializers.Serializer):
    serial = serializers.IntegerField(source="certificate_id", help_text="The certificate's serial (also in its key id)")
    username = serializers.CharField(source="certificate.username", help_text="Whom it was signed for, as they were named then")
    key_id = serializers.CharField(source="certificate.key_id", help_text="fadenstack:<user>:<cluster>:<serial>, as sshd logs it")
    public_key_fingerprint = serializers.CharField(source="certificate.public_key_fingerprint")
    principals = serializers.ListField(source="certificate.principals", child=serializers.CharField(),
                                       help_text="What it opens: the cluster's principal (every node) or its machines'")
    valid_after = serializers.DateTimeField(source="certificate.valid_after")
    valid_before = serializers.DateTimeField(source="certificate.valid_before")
    state = serializers.SerializerMethodField(help_text="valid, expired or revoked")
    revoked_at = serializers.DateTimeField(allow_null=True)
    revoked_by = serializers.SerializerMethodField()
    revoked_reason = serializers.CharField(allow_blank=True)

    def get_state(self, row: NodeCertificate) -> str:
        return node_logins.login_state(row)

    def get_revoked_by(self, row: NodeCertificate) -> str:
        return row.revoked_by.get_username() if row.revoked_by else ""


class NodeLoginActions:
    """The cluster viewset's node-login actions (config/cluster_api.py mixes them in)."""

    @extend_schema(request=None, responses={200: NodeLoginSerializer(many=True)})
    @action(detail=True, methods=["get"], url_path="node-logins")
    def node_logins(self, request, pk=None):
        """The certificates signed for node logins to this cluster, newest first."""
        cluster = self.get_object()
        page = self.paginate_queryset(node_logins.node_logins_of(cluster))
        return self.get_paginated_response(NodeLoginSerializer(page, many=True).data)

    @extend_schema(
        parameters=[OpenApiParameter("serial", int, OpenApiParameter.PATH, description="The certificate's serial")],
        request=None, responses={200: NodeLoginSerializer},
    )
    @action(detail=True, methods=["post"], url_path=r"node-logins/(?P<serial>[0-9]{1,19})/revoke")
    def node_login_revoke(self, request, pk=None, serial=None):
        """Take one node login back (Administrators): the cluster's machines refuse the certificate from now on."""
        cluster = self.get_object()
        serial = int(serial)
        if not 1 <= serial <= params.ID_MAX:
            raise NotFound(f"{cluster.name} has no node login certificate with serial {serial}.")
        try:
            row = node_logins.node_login_revoke(cluster=cluster, serial=serial, user=request.user)
        except ValidationError as refused:
            raise NotFound(" ".join(refused.messages)) from None
        return Response(NodeLoginSerializer(row).data)

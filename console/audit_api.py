"""/api/audit/: the audit trail, read-only, for Administrators (the page is console.views.audit_list)."""
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import permissions, serializers, viewsets

from console import audit
from console.choices import AuditOutcome
from console.models import AuditEntry


class AuditReaders(permissions.BasePermission):
    def has_permission(self, request, view) -> bool:
        offer = audit.may_read(request.user)
        self.message = offer.why
        return offer.ok


class AuditEntrySerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditEntry
        fields = ["id", "at", "username", "action", "method", "target", "address", "outcome", "status", "message"]


@extend_schema(parameters=[
    OpenApiParameter("user", OpenApiTypes.STR, description="Part of the user name"),
    OpenApiParameter("outcome", OpenApiTypes.STR, enum=AuditOutcome.values),
    OpenApiParameter("action", OpenApiTypes.STR, description="The start of the action: clusters:, login"),
])
class AuditEntryViewSet(viewsets.ReadOnlyModelViewSet):
    """Who did what, newest first (Administrators only): the audit trail's page as JSON."""

    serializer_class = AuditEntrySerializer
    permission_classes = [permissions.IsAuthenticated, AuditReaders]

    def get_queryset(self):
        wanted = {name: self.request.query_params.get(name, "").strip()[:100] for name in ("user", "outcome", "action")}
        return audit.audit_entries(**wanted)

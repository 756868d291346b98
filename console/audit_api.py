"""/api/audit/: the audit trail, read-only, for Administrators (the page is console.views.audit_list)."""
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import permissions, serializers, viewsets

from console import audit, params
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


@extend_schema_view(list=extend_schema(parameters=[
    OpenApiParameter("user", OpenApiTypes.STR, description="Part of the user name"),
    OpenApiParameter("outcome", OpenApiTypes.STR, enum=AuditOutcome.values),
    OpenApiParameter("action", OpenApiTypes.STR, description="The start of the action: clusters:, login"),
]))
class AuditEntryViewSet(viewsets.ReadOnlyModelViewSet):
    """Who did what, newest first (Administrators only): the audit trail's page as JSON."""

    serializer_class = AuditEntrySerializer
    permission_classes = [permissions.IsAuthenticated, AuditReaders]

    def get_queryset(self):
        """The list's filters narrow the list; an entry is read by its id alone."""
        if self.action != "list":
            return AuditEntry.objects.all()
        query = self.request.query_params
        return audit.audit_entries(user=params.text_param(query, "user"), action=params.text_param(query, "action"),
                                   outcome=params.choice_param(query, "outcome", AuditOutcome.values))

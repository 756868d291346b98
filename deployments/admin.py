from django.contrib import admin

from console.admin import RecordAdmin, RecordInline
from deployments.models import Copy, Deployment, Drain, GatewayKey


class CopyInline(RecordInline):
    model = Copy
    fields = ["number", "state", "state_reason", "machine", "slots", "address", "port", "pid", "restarts", "serving_since"]
    readonly_fields = fields


@admin.register(Deployment)
class DeploymentAdmin(RecordAdmin):
    """Deployed, scaled and deleted on its page or the API, where placement and the engines follow; read here."""

    list_display = ["name", "cluster", "model", "copies", "gpu_model", "created_at"]
    list_filter = ["cluster"]
    search_fields = ["name", "model__repo"]
    inlines = [CopyInline]


@admin.register(GatewayKey)
class GatewayKeyAdmin(RecordAdmin):
    """Made, limited and revoked on the Gateway page or the API (the secret is shown once, there); read here. Deleting
    one here would leave no record of it: revoke it instead."""

    list_display = ["name", "prefix", "deployments", "requests_per_minute", "tokens_per_minute", "created_by", "created_at",
                    "last_used_at", "revoked_at"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["name", "prefix"]
    exclude = ["key_hash"]

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Drain)
class DrainAdmin(RecordAdmin):
    """Started, stopped and cancelled on the cluster's and the machine's pages or the API; read here."""

    list_display = ["machine", "cluster", "state", "remove", "started_by", "started_at"]
    list_filter = ["cluster", "state"]
    search_fields = ["machine__name"]

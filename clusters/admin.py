from django.contrib import admin

from clusters.models import Cluster, ClusterMember, HealthCheck, RuntimeImage


class MemberInline(admin.TabularInline):
    model = ClusterMember
    extra = 0


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    """Records only: states change through the cluster's page and the API, which run the jobs that make them true."""

    list_display = ["name", "state", "network", "restart_attempt", "next_retry_at", "created_at"]
    list_filter = ["state"]
    search_fields = ["name"]
    readonly_fields = ["state", "state_reason", "state_changed_at", "start_attempts", "restart_attempt", "next_retry_at",
                       "last_status", "last_status_at"]
    inlines = [MemberInline]


@admin.register(ClusterMember)
class ClusterMemberAdmin(admin.ModelAdmin):
    list_display = ["machine", "cluster", "role", "state", "address"]
    list_filter = ["state", "role"]


@admin.register(HealthCheck)
class HealthCheckAdmin(admin.ModelAdmin):
    """What every check looked at, found and did: written by the checks, read here."""

    list_display = ["cluster", "started_at", "trigger", "outcome", "action"]
    list_filter = ["outcome", "trigger", "cluster"]
    date_hierarchy = "started_at"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(RuntimeImage)
class RuntimeImageAdmin(admin.ModelAdmin):
    """The builds the server holds. Read-only: builds come in through `faden runtime-images import`,
    which hashes the file and places it in the store; a row changed by hand would no longer match its file."""

    list_display = ["name", "version", "platform", "certified", "size_mib", "short_digest", "imported_at"]
    list_filter = ["accelerator_vendor", "arch", "certified", "version"]
    search_fields = ["name", "version", "digest"]
    readonly_fields = [
        "name", "version", "arch", "accelerator_vendor", "certified", "digest", "size_bytes", "chunk_size",
        "chunk_hashes", "path", "imported_at",
    ]

    @admin.display(description="Platform", ordering="accelerator_vendor")
    def platform(self, image: RuntimeImage) -> str:
        return image.platform

    @admin.display(description="Size", ordering="size_bytes")
    def size_mib(self, image: RuntimeImage) -> str:
        return f"{image.size_bytes / 1024 / 1024:.1f} MiB"

    @admin.display(description="sha256")
    def short_digest(self, image: RuntimeImage) -> str:
        return image.digest[:12]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # its file stays in the store, and members point at it

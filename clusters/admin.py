from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied, ValidationError

from clusters.models import Cluster, ClusterMember, HealthCheck, NcclTest, NodeCertificate, RuntimeImage
from clusters.validators import name_taken, validate_cluster_name
from console.admin import RecordAdmin, RecordInline


class MemberInline(RecordInline):
    model = ClusterMember
    fields = ["machine", "role", "state", "state_reason", "address", "runtime_image", "accelerators_in_ray"]


class ClusterForm(forms.ModelForm):
    """A cluster's name changes under the wizard's rules and refusals (clusters/validators.py)."""

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        validate_cluster_name(name)
        if Cluster.objects.exclude(pk=self.instance.pk).filter(name=name).exists():
            raise ValidationError(name_taken(name))
        return name


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    """Records only: the name can be changed; everything else changes through the cluster's page and the
    API (the network through Change the network, which moves every member's address with it), which
    run the jobs that make it true."""

    form = ClusterForm
    list_display = ["name", "state", "network", "restart_attempt", "next_retry_at", "created_at"]
    list_filter = ["state"]
    search_fields = ["name"]
    readonly_fields = ["state", "state_reason", "state_changed_at", "network", "runtime_version", "ray_port",
                       "start_attempts", "restart_attempt", "next_retry_at", "last_status", "last_status_at"]
    inlines = [MemberInline]

    def has_add_permission(self, request):
        return False  # clusters are created by the wizard or the API, which check the machines and start it


@admin.register(ClusterMember)
class ClusterMemberAdmin(RecordAdmin):
    """Who is in which cluster: Add machines and Remove from cluster change it."""

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


@admin.register(NcclTest)
class NcclTestAdmin(RecordAdmin):
    """Every NCCL test and its sizes: written by the test's job, read here."""

    list_display = ["cluster", "started_at", "state", "started_by", "message"]
    list_filter = ["state", "cluster"]
    date_hierarchy = "started_at"


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


@admin.register(NodeCertificate)
class NodeCertificateAdmin(RecordAdmin):
    """The certificates signed for node logins, by cluster; Take back revokes the selected ones at once
    (clusters/node_logins.py: the cluster's revocation list goes to its machines, an audit entry each)."""

    list_display = ["serial", "cluster", "username", "key_id", "valid_before", "revoked_at", "revoked_reason"]
    list_filter = ["cluster", ("revoked_at", admin.EmptyFieldListFilter)]
    search_fields = ["certificate__username", "certificate__key_id", "cluster__name"]
    list_select_related = ["certificate", "cluster"]
    actions = ["take_back"]

    @admin.display(description="Serial", ordering="certificate_id")
    def serial(self, row: NodeCertificate) -> int:
        return row.certificate_id

    @admin.display(description="User", ordering="certificate__username")
    def username(self, row: NodeCertificate) -> str:
        return row.certificate.username

    @admin.display(description="Key id")
    def key_id(self, row: NodeCertificate) -> str:
        return row.certificate.key_id

    @admin.display(description="Valid until", ordering="certificate__valid_before")
    def valid_before(self, row: NodeCertificate):
        return row.certificate.valid_before

    def has_delete_permission(self, request, obj=None):
        return False  # a row taken back must stay for its serial to stay in the list

    @admin.action(description="Take back the selected node logins")
    def take_back(self, request, queryset):
        from clusters import node_logins

        done = 0
        for row in queryset.select_related("cluster"):
            try:
                node_logins.node_login_revoke(cluster=row.cluster, serial=row.certificate_id, user=request.user)
                done += 1
            except (PermissionDenied, ValidationError) as refused:
                self.message_user(request, " ".join(getattr(refused, "messages", [str(refused)])), level="error")
        self.message_user(request, f"Took back {done} node login(s): each cluster's revocation list goes to its machines now.")

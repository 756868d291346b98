from django.contrib import admin, messages
from django.core.exceptions import ValidationError

from console.admin import RecordAdmin, RecordInline
from machines import services
from machines.models import Accelerator, Machine, MachineEvent, NetworkInterface


class AcceleratorInline(RecordInline):
    model = Accelerator
    fields = ["index", "vendor", "model", "memory_mib", "uuid", "pci_bus_id"]


class InterfaceInline(RecordInline):
    model = NetworkInterface
    fields = ["name", "kind", "addresses", "speed_mbps", "default_route", "management", "mac", "mtu", "state"]


@admin.register(Machine)
class MachineAdmin(admin.ModelAdmin):
    list_display = ["name", "address", "state", "arch", "agent_version", "last_seen"]
    list_filter = ["state", "arch"]
    search_fields = ["name", "address", "hostname"]
    readonly_fields = [
        "state", "state_reason", "state_changed_at", "host_key_fingerprint", "offered_host_key_fingerprint",
        "arch", "hostname", "cpu_count", "memory_mib", "store_path", "store_free_bytes", "store_total_bytes",
        "container_runtime", "container_runtime_version", "container_runtimes", "configured_runtime",
        "runtime_choice",  # chosen on the machine's page or the API, which check the machine has it
        "agent_version", "agent_path", "python_path", "facts", "facts_at", "heartbeat_token_hash",
        "last_seen", "runtime_beat", "runtime_failing_since", "created_at",
    ]  # what enrolment, heartbeats and health checks write; the rest is validated as Add a machine does (the model's validators)
    inlines = [AcceleratorInline, InterfaceInline]
    actions = ["refresh_facts"]

    def has_add_permission(self, request):
        return False  # machines are added through Add a machine, which confirms the host key

    @admin.action(description="Refresh facts")
    def refresh_facts(self, request, queryset):
        for machine in queryset:
            try:
                services.machine_refresh(machine=machine, user=request.user)
            except ValidationError as exc:
                self.message_user(request, f"{machine.name}: {' '.join(exc.messages)}", messages.WARNING)

    def delete_model(self, request, obj):
        services.machine_delete(machine=obj, user=request.user)


@admin.register(MachineEvent)
class MachineEventAdmin(RecordAdmin):
    list_display = ["created_at", "machine", "kind", "message"]
    list_filter = ["kind"]
    search_fields = ["machine__name", "message"]


@admin.register(Accelerator)
class AcceleratorAdmin(RecordAdmin):
    list_display = ["machine", "index", "vendor", "model", "memory_mib"]
    list_filter = ["vendor", "model"]


@admin.register(NetworkInterface)
class NetworkInterfaceAdmin(RecordAdmin):
    list_display = ["machine", "name", "kind", "speed_mbps", "default_route", "management"]
    list_filter = ["kind"]

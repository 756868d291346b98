from django.contrib import admin

from console.models import Job


class RecordAdmin(admin.ModelAdmin):
    """Rows only the console writes (a job, a machine's facts, a membership): shown, never added or
    changed here, where none of the services' checks would run and nothing would make them true."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class RecordInline(admin.TabularInline):
    """A RecordAdmin's rows shown inside another object's page."""

    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Job)
class JobAdmin(RecordAdmin):
    list_display = ["created_at", "title", "kind", "state", "worker", "finished_at"]
    list_filter = ["state", "kind"]
    search_fields = ["title"]

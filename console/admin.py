from django.contrib import admin

from console.models import Job


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["created_at", "title", "kind", "state", "worker", "finished_at"]
    list_filter = ["state", "kind"]
    search_fields = ["title"]
    readonly_fields = [f.name for f in Job._meta.fields]

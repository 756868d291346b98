from django.contrib import admin

from deployments.models import Deployment


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ["name", "cluster", "model_name", "copies", "created_at"]

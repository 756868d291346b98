from django.contrib import admin

from clusters.models import Cluster, ClusterMember


class MemberInline(admin.TabularInline):
    model = ClusterMember
    extra = 0


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    list_display = ["name", "state", "network", "created_at"]
    inlines = [MemberInline]


@admin.register(ClusterMember)
class ClusterMemberAdmin(admin.ModelAdmin):
    list_display = ["machine", "cluster", "role"]

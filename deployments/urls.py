from django.urls import path

from deployments import drain_views, orphan_views, views
from deployments.store.views import cluster_model_source
from deployments.tls_views import cluster_encrypt_model_traffic

app_name = "deployments"

urlpatterns = [
    path("", views.deployment_list, name="list"),
    path("new/", views.deployment_new, name="new"),
    path("plan/", views.deployment_plan, name="plan"),
    path("new/model/", views.deployment_model_add, name="model-add"),
    path("create/", views.deployment_create, name="create"),
    path("<int:pk>/", views.deployment_detail, name="detail"),
    path("<int:pk>/traffic/", views.deployment_traffic, name="traffic"),
    path("<int:pk>/charts/", views.deployment_charts, name="charts"),
    path("<int:pk>/change/", views.deployment_change, name="change"),
    path("<int:pk>/change/plan/", views.deployment_change_plan, name="change-plan"),
    path("<int:pk>/scale/", views.deployment_scale, name="scale"),
    path("<int:pk>/routing/", views.deployment_routing, name="routing"),
    path("<int:pk>/delete/", views.deployment_delete, name="delete"),
    path("clusters/<int:pk>/model-source/", cluster_model_source, name="model-source"),
    path("clusters/<int:pk>/orphans/look/", orphan_views.cluster_orphans_look, name="orphans-look"),
    path("clusters/<int:pk>/orphans/keep/", orphan_views.cluster_orphan_keep, name="orphan-keep"),
    path("clusters/<int:pk>/orphans/delete/", orphan_views.cluster_orphan_delete, name="orphan-delete"),
    path("drain/plan/", drain_views.drain_plan_page, name="drain-plan"),
    path("drain/start/", drain_views.drain_start, name="drain-start"),
    path("machines/<int:pk>/stop-drain/", drain_views.drain_stop, name="stop-drain"),
    path("machines/<int:pk>/cancel-removal/", drain_views.removal_cancel, name="cancel-removal"),
    path("clusters/<int:pk>/encrypt-model-traffic/", cluster_encrypt_model_traffic, name="encrypt-model-traffic"),
]

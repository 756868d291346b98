from django.urls import path

from deployments import deployment_views, views

app_name = "deployments"

urlpatterns = [
    path("", deployment_views.deployment_list, name="list"),
    path("new/", deployment_views.deployment_new, name="new"),
    path("plan/", deployment_views.deployment_plan, name="plan"),
    path("new/model/", deployment_views.deployment_model_add, name="model-add"),
    path("create/", deployment_views.deployment_create, name="create"),
    path("<int:pk>/", deployment_views.deployment_detail, name="detail"),
    path("<int:pk>/traffic/", deployment_views.deployment_traffic, name="traffic"),
    path("<int:pk>/change/", deployment_views.deployment_change, name="change"),
    path("<int:pk>/change/plan/", deployment_views.deployment_change_plan, name="change-plan"),
    path("<int:pk>/scale/", deployment_views.deployment_scale, name="scale"),
    path("<int:pk>/delete/", deployment_views.deployment_delete, name="delete"),
    path("clusters/<int:pk>/model-source/", views.cluster_model_source, name="model-source"),
]

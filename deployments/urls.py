from django.urls import path

from deployments import views
from deployments.store.views import cluster_model_source

app_name = "deployments"

urlpatterns = [
    path("", views.deployment_list, name="list"),
    path("new/", views.deployment_new, name="new"),
    path("plan/", views.deployment_plan, name="plan"),
    path("new/model/", views.deployment_model_add, name="model-add"),
    path("create/", views.deployment_create, name="create"),
    path("<int:pk>/", views.deployment_detail, name="detail"),
    path("<int:pk>/traffic/", views.deployment_traffic, name="traffic"),
    path("<int:pk>/change/", views.deployment_change, name="change"),
    path("<int:pk>/change/plan/", views.deployment_change_plan, name="change-plan"),
    path("<int:pk>/scale/", views.deployment_scale, name="scale"),
    path("<int:pk>/delete/", views.deployment_delete, name="delete"),
    path("clusters/<int:pk>/model-source/", cluster_model_source, name="model-source"),
]

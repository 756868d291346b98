from django.urls import path

from deployments import views

app_name = "deployments"

urlpatterns = [
    path("", views.deployment_list, name="list"),
    path("clusters/<int:pk>/model-source/", views.cluster_model_source, name="model-source"),
]

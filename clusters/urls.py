from django.urls import path

from clusters import views

app_name = "clusters"

urlpatterns = [
    path("", views.cluster_list, name="list"),
    path("new/", views.cluster_new, name="new"),
    path("new/probe/", views.cluster_new_probe, name="new-probe"),
    path("new/create/", views.cluster_new_create, name="new-create"),
    path("<int:pk>/", views.cluster_detail, name="detail"),
    path("<int:pk>/retry/", views.cluster_retry, name="retry"),
]

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
    path("<int:pk>/stop/", views.cluster_stop, name="stop"),
    path("<int:pk>/start/", views.cluster_start, name="start"),
    path("<int:pk>/check/", views.cluster_check, name="check"),
    path("<int:pk>/delete/", views.cluster_delete, name="delete"),
    path("<int:pk>/add/", views.cluster_add, name="add"),
    path("<int:pk>/machines/<int:machine_id>/remove/", views.cluster_member_remove, name="member-remove"),
    path("<int:pk>/runtime/switch/", views.cluster_runtime_switch, name="runtime-switch"),
    path("<int:pk>/network/", views.cluster_network, name="network"),
    path("<int:pk>/network/test/", views.cluster_network_test, name="network-test"),
]

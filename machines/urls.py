from django.urls import path

from machines import views

app_name = "machines"

urlpatterns = [
    path("", views.machine_list, name="list"),
    path("add/", views.machine_add, name="add"),
    path("update-agent/", views.machines_update_agent, name="update-agent-many"),
    path("<id:pk>/", views.machine_detail, name="detail"),
    path("<id:pk>/refresh/", views.machine_refresh, name="refresh"),
    path("<id:pk>/update-agent/", views.machine_update_agent, name="update-agent"),
    path("<id:pk>/runtime/", views.machine_runtime_choose, name="runtime"),
    path("<id:pk>/trust-host-key/", views.machine_trust_host_key, name="trust-host-key"),
    path("<id:pk>/delete/", views.machine_delete, name="delete"),
]

from django.urls import path

from clusters import connection_views, encryption_views, leftovers_views, nccl_views, node_logins_views, views

app_name = "clusters"

urlpatterns = [
    path("", views.cluster_list, name="list"),
    path("new/", views.cluster_new, name="new"),
    path("new/probe/", views.cluster_new_probe, name="new-probe"),
    path("new/create/", views.cluster_new_create, name="new-create"),
    path("<id:pk>/", views.cluster_detail, name="detail"),
    path("<id:pk>/retry/", views.cluster_retry, name="retry"),
    path("<id:pk>/stop/", views.cluster_stop, name="stop"),
    path("<id:pk>/start/", views.cluster_start, name="start"),
    path("<id:pk>/check/", views.cluster_check, name="check"),
    path("<id:pk>/delete/", views.cluster_delete, name="delete"),
    path("<id:pk>/add/", views.cluster_add, name="add"),
    path("<id:pk>/machines/<id:machine_id>/remove/", views.cluster_member_remove, name="member-remove"),
    path("<id:pk>/runtime/switch/", views.cluster_runtime_switch, name="runtime-switch"),
    path("<id:pk>/network/", views.cluster_network, name="network"),
    path("<id:pk>/network/test/", views.cluster_network_test, name="network-test"),
    path("<id:pk>/ssh-certificate/", connection_views.cluster_ssh_certificate, name="ssh-certificate"),
    path("<id:pk>/nccl-test/", nccl_views.cluster_nccl_test, name="nccl-test"),
    path("<id:pk>/node-logins/<id:serial>/revoke/", node_logins_views.cluster_node_login_revoke, name="node-login-revoke"),
    path("<id:pk>/encrypt/", encryption_views.cluster_encrypt, name="encrypt"),
    path("<id:pk>/certificates/renew/", encryption_views.cluster_certificates_renew, name="certificates-renew"),
    # What deleted clusters left on a machine: buttons of the machine's page.
    path("machines/<id:pk>/free-images/", leftovers_views.machine_images_free, name="machine-free-images"),
    path("machines/<id:pk>/free-shared/", leftovers_views.machine_shared_free, name="machine-free-shared"),
]

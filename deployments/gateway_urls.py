from django.urls import path

from deployments.store import views

app_name = "gateway"

urlpatterns = [
    path("", views.gateway, name="page"),
    path("traffic/", views.gateway_traffic, name="traffic"),
    path("keys/", views.gateway_key_create, name="key-create"),
    path("keys/<id:pk>/revoke/", views.gateway_key_revoke, name="key-revoke"),
]

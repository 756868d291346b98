from django.urls import path

from deployments import gateway_views

app_name = "gateway"

urlpatterns = [
    path("", gateway_views.gateway, name="page"),
    path("traffic/", gateway_views.gateway_traffic, name="traffic"),
    path("keys/", gateway_views.gateway_key_create, name="key-create"),
    path("keys/<id:pk>/limits/", gateway_views.gateway_key_limits, name="key-limits"),
    path("keys/<id:pk>/revoke/", gateway_views.gateway_key_revoke, name="key-revoke"),
]

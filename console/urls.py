from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from console import views

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("machines/", include("machines.urls")),
    path("agent/heartbeat/", views.agent_heartbeat, name="agent-heartbeat"),
    path("api/", include("console.api_urls")),
    path("admin/", admin.site.urls),
]

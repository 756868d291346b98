from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_not_required
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from clusters.agent_views import runtime_image_download
from console import views
from console.metrics import metrics
from deployments.store.agent_views import model_file_download
from machines.agent_views import agent_heartbeat

urlpatterns = [
    path("", views.dashboard, name="dashboard"),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("users/", views.user_list, name="users"),
    path("users/add/", views.user_add, name="user-add"),
    path("users/<id:pk>/role/", views.user_role, name="user-role"),
    path("users/<id:pk>/active/", views.user_active, name="user-active"),
    path("users/<id:pk>/node-logins/", views.user_node_logins, name="user-node-logins"),
    path("machines/", include("machines.urls")),
    path("clusters/", include("clusters.urls")),
    path("models/", include("deployments.store.urls")),
    path("deployments/", include("deployments.urls")),
    path("gateway/", include("deployments.gateway_urls")),
    path("audit/", views.audit_list, name="audit"),
    path("metrics", metrics, name="metrics"),  # for Prometheus: the token, or an Administrator (console/metrics.py)
    path("settings/", include("deployments.store.settings_urls")),
    path("profile/", include("machines.profile_urls")),
    path("agent/heartbeat/", agent_heartbeat, name="agent-heartbeat"),
    path("agent/images/<str:digest>/", runtime_image_download, name="agent-image-download"),
    path("agent/models/<str:digest>/", model_file_download, name="agent-model-download"),
    path("api/", include("config.api_urls")),
    path("admin/", admin.site.urls),
    # Pages without an icon link of their own (the admin's, the API's) make browsers ask for this.
    path("favicon.ico", login_not_required(RedirectView.as_view(url=static("favicon.svg"), permanent=True))),
]

# Errors: JSON with a message under /api/, a page in the console's shell elsewhere (console/errors.py).
handler400 = "console.errors.bad_request"
handler403 = "console.errors.permission_denied"
handler404 = "console.errors.not_found"
handler500 = "console.errors.server_error"

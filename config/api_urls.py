from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.routers import DefaultRouter

from config.cluster_api import ClusterApiViewSet
from config.machine_api import MachineApiViewSet
from console.audit_api import AuditEntryViewSet
from deployments.api import DeploymentViewSet
from deployments.gateway_api import GatewayKeyViewSet
from deployments.store.api import ModelViewSet
from deployments.store.hub_token_api import HfTokenView
from machines.profile_api import ProfileKeyViewSet

router = DefaultRouter()
router.register("machines", MachineApiViewSet, basename="machine")
router.register("clusters", ClusterApiViewSet, basename="cluster")
router.register("models", ModelViewSet, basename="model")
router.register("deployments", DeploymentViewSet, basename="deployment")
router.register("audit", AuditEntryViewSet, basename="audit")
router.register("gateway/keys", GatewayKeyViewSet, basename="gateway-key")
router.register("profile/keys", ProfileKeyViewSet, basename="profile-key")

urlpatterns = [
    path("", include(router.urls)),
    path("settings/hugging-face-token/", HfTokenView.as_view(), name="settings-hf-token-api"),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    # The split view serves the page's script from a URL of its own: the Content-Security-Policy allows no inline script.
    path("schema/swagger/", SpectacularSwaggerSplitView.as_view(url_name="schema", template_name="api/swagger_ui.html"),
         name="swagger"),
]

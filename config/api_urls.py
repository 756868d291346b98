from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import DefaultRouter

from clusters.api import ClusterViewSet
from machines.api import MachineViewSet

router = DefaultRouter()
router.register("machines", MachineViewSet, basename="machine")
router.register("clusters", ClusterViewSet, basename="cluster")

urlpatterns = [
    path("", include(router.urls)),
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    path("schema/swagger/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger"),
]

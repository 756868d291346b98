"""What model traffic over mutual TLS adds to /api/clusters/ (config/cluster_api.py composes it)."""
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.decorators import action
from rest_framework.response import Response

from clusters.api import ClusterJobSerializer
from console import roles
from deployments import copy_tls, model_traffic


class ModelTrafficStateSerializer(serializers.Serializer):
    on = serializers.BooleanField(help_text="New copies start behind mutual TLS (the cluster's model_tls)")
    words = serializers.CharField(help_text="mutual TLS, not encrypted, or how many copies are left to move")
    copies = serializers.IntegerField(help_text="The cluster's copies that hold room")
    plain = serializers.IntegerField(help_text="Of them, those still without TLS")


class ModelTrafficActions:
    """``GET .../model-traffic/`` and ``POST .../encrypt-model-traffic/``."""

    @extend_schema(request=None, responses={200: ModelTrafficStateSerializer})
    @action(detail=True, methods=["get"], url_path="model-traffic")
    def model_traffic(self, request, pk=None):
        """Whether the gateway reaches the cluster's copies over mutual TLS, and how many copies are left to move."""
        state = copy_tls.model_traffic(self.get_object(), roles.acting(request.user))
        return Response({"on": state.on, "words": state.words, "copies": state.copies, "plain": state.plain})

    @extend_schema(request=None, responses={200: ClusterJobSerializer})
    @action(detail=True, methods=["post"], url_path="encrypt-model-traffic")
    def encrypt_model_traffic(self, request, pk=None):
        """Encrypt model traffic (an Operator's action, on a running cluster whose machines run agent 0.10.0 or
        newer): new copies start behind TLS, and the copies started before load again behind TLS one at a time,
        each replacement Serving before the old copy stops (each deployment's apply job; ``job`` is null)."""
        cluster = self.get_object()
        model_traffic.model_traffic_encrypt(cluster, user=request.user)
        return self._answer(cluster, None)

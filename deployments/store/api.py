"""REST for models: add one (its download starts), read its progress, files and where it is held, copy it
to a cluster's machines, delete it; the cluster's ``model_source`` with its reach check; and the gateway's
keys (``/api/gateway/keys/``: list, create with the secret shown once, revoke). Same
services as the pages; their refusals are 400s (or 403s for a role) with the service's own message."""
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from clusters.api import ClusterJobSerializer, ClusterViewSet
from clusters.choices import ModelSource
from clusters.models import Cluster
from console import api
from deployments import selectors, services
from deployments.store import sources
from deployments.models import Deployment, GatewayKey, ModelFile, StoredModel


class ModelFileSerializer(serializers.ModelSerializer):
    class Meta:
        model = ModelFile
        fields = ["path", "size", "sha256", "hub_digest"]


class HoldingSerializer(serializers.Serializer):
    machine = serializers.IntegerField(source="machine.pk")
    name = serializers.CharField(source="machine.name")
    bytes = serializers.IntegerField(source="holding.bytes")
    path = serializers.CharField(source="holding.path")
    clusters = serializers.SerializerMethodField()

    def get_clusters(self, entry) -> list[int]:
        return [c.pk for c in entry["clusters"]]


class ModelSerializer(serializers.ModelSerializer):
    progress = serializers.SerializerMethodField(help_text="The download's bytes, rate (bytes/s) and seconds left")

    class Meta:
        model = StoredModel
        fields = ["id", "repo", "revision", "commit", "state", "state_reason", "imported_from", "progress", "facts",
                  "created_at", "ready_at"]

    def get_progress(self, model) -> dict:
        return {"bytes_done": model.bytes_done, "bytes_total": model.bytes_total, "percent": model.percent,
                "rate": round(model.rate), "seconds_left": round(model.seconds_left) if model.seconds_left is not None else None}


class ModelDetailSerializer(ModelSerializer):
    files = ModelFileSerializer(many=True, read_only=True)
    held_on = serializers.SerializerMethodField(help_text="The machines whose store holds every file")

    class Meta(ModelSerializer.Meta):
        fields = [*ModelSerializer.Meta.fields, "files", "held_on"]

    def get_held_on(self, model) -> list[dict]:
        return HoldingSerializer(selectors.model_where(model), many=True).data


class ModelAddSerializer(serializers.Serializer):
    repo = api.TextField(max_length=200, help_text="The repository id on the hub: org/name")
    revision = api.TextField(max_length=200, required=False, default="main")


class CopySerializer(serializers.Serializer):
    cluster = api.IdField(help_text="The cluster whose machines get the model's files")


class CopyStartedSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    cluster = serializers.IntegerField()


class ModelViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = StoredModel.objects.order_by("repo", "revision")

    def get_serializer_class(self):
        return ModelSerializer if self.action == "list" else ModelDetailSerializer

    @extend_schema(request=ModelAddSerializer, responses={202: ModelDetailSerializer})
    def create(self, request):
        """Add a model by its repository id and revision (main by default): the server downloads it into its store."""
        data = ModelAddSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        model = services.model_add(repo=data.validated_data["repo"], revision=data.validated_data["revision"], user=request.user)
        return Response(ModelDetailSerializer(model).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request, pk=None):
        """Delete the model and its files from the server's store; refused while anything uses it."""
        services.model_delete(self.get_object(), user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=None, responses={202: ModelDetailSerializer})
    @action(detail=True, methods=["post"])
    def retry(self, request, pk=None):
        """Download a failed model again, from where it stopped."""
        model = self.get_object()
        services.model_retry(model, user=request.user)
        return Response(ModelDetailSerializer(StoredModel.objects.get(pk=model.pk)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=CopySerializer, responses={202: CopyStartedSerializer})
    @action(detail=True, methods=["post"], url_path="copy-to")
    def copy_to(self, request, pk=None):
        """Put the model's files on every machine of a cluster (the cluster's page shows a bar per machine)."""
        model = self.get_object()
        data = CopySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        cluster = Cluster.objects.filter(pk=data.validated_data["cluster"]).first()
        if cluster is None:
            raise serializers.ValidationError({"cluster": ["There is no such cluster."]})
        job = services.model_copy(model, cluster, user=request.user)
        return Response({"job": job.pk, "cluster": cluster.pk}, status=status.HTTP_202_ACCEPTED)


class ModelSourceSerializer(serializers.Serializer):
    model_source = serializers.ChoiceField(choices=ModelSource.choices,
                                           help_text="server: Server copies; machines: Machines download models themselves")


class ClusterDeploymentSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    model = serializers.CharField()
    copies = serializers.IntegerField()
    serving = serializers.IntegerField()


class ClusterModelSourceViewSet(ClusterViewSet):
    """The clusters' API with what deployments add to it: its deployments, and where the machines get models."""

    def retrieve(self, request, *args, **kwargs):
        response = super().retrieve(request, *args, **kwargs)
        rows = selectors.deployments_list(Deployment.objects.filter(cluster_id=response.data["id"]))
        response.data["deployments"] = ClusterDeploymentSerializer(
            [{"id": d.pk, "name": d.name, "model": str(d.model), "copies": d.copies, "serving": d.serving} for d in rows],
            many=True).data
        return response

    @extend_schema(request=ModelSourceSerializer, responses={200: ClusterJobSerializer, 202: ClusterJobSerializer})
    def partial_update(self, request, pk=None):
        """Change ``model_source``. ``server`` applies at once (200). ``machines`` first checks that every machine
        reaches the hub (202 with the job); the cluster switches only if all do, else it keeps Server copies and
        the job's error names each machine that cannot, and why."""
        cluster = self.get_object()
        data = ModelSourceSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        job = sources.model_source_set(cluster, data.validated_data["model_source"], user=request.user)
        return self._answer(cluster, job)

    @extend_schema(request=None, responses={202: ClusterJobSerializer})
    @action(detail=True, methods=["post"], url_path="model-source-check")
    def model_source_check(self, request, pk=None):
        """Check every machine's reach to the hub (a real request from each), without switching."""
        cluster = self.get_object()
        job = sources.model_source_check(cluster, user=request.user)
        return self._answer(cluster, job)


# -- the gateway's keys -------------------------------------------------------------------------------


class GatewayKeySerializer(serializers.ModelSerializer):
    created_by = serializers.SerializerMethodField()
    deployments = serializers.ListField(child=serializers.CharField(), read_only=True,
                                        help_text="The deployment names the key may use; empty: every one")

    class Meta:
        model = GatewayKey
        fields = ["id", "name", "prefix", "deployments", "created_by", "created_at", "last_used_at", "revoked_at"]

    def get_created_by(self, key) -> str | None:
        return key.created_by.get_username() if key.created_by else None


class GatewayKeyCreatedSerializer(GatewayKeySerializer):
    secret = serializers.CharField(help_text="The key itself: shown in this answer only, never again")

    class Meta(GatewayKeySerializer.Meta):
        fields = [*GatewayKeySerializer.Meta.fields, "secret"]


class GatewayKeyCreateSerializer(serializers.Serializer):
    name = api.TextField(max_length=services.KEY_NAME_MAX, help_text="What or who the key is for")
    deployments = serializers.ListField(child=api.TextField(max_length=63), required=False, max_length=500,
                                        help_text="Limit the key to these deployment names; left out or empty: every one")


class GatewayKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """The gateway's API keys. Every role reads them (never their secret); Operators create and revoke them."""

    queryset = GatewayKey.objects.select_related("created_by").order_by("-created_at", "-pk")
    serializer_class = GatewayKeySerializer

    @extend_schema(request=GatewayKeyCreateSerializer, responses={201: GatewayKeyCreatedSerializer})
    def create(self, request):
        """Create a key. The answer holds its ``secret`` once: the console keeps only its sha256."""
        data = GatewayKeyCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        key, secret = services.gateway_key_create(name=data.validated_data["name"],
                                                  deployments=data.validated_data.get("deployments"), user=request.user)
        key = self.get_queryset().get(pk=key.pk)
        return Response({**GatewayKeySerializer(key).data, "secret": secret}, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request, pk=None):
        """Revoke the key: the gateway refuses it within a second. It stays listed, with ``revoked_at``."""
        services.gateway_key_revoke(key=self.get_object(), user=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)

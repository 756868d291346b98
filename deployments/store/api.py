"""REST for models: add one (its download starts), read its progress, files and where it is held, copy it
to a cluster's machines, delete it; and the cluster's ``model_source`` with its reach check (a mixin of
/api/clusters/). Same services as the pages; their refusals are 400s (or 403s for a role) with the
service's own message."""
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from clusters.api import ClusterJobSerializer
from clusters.choices import ModelSource
from clusters.models import Cluster
from console import api
from deployments.models import ModelFile, StoredModel
from deployments.store import selectors, services, sources


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


class ModelSourceActions:
    """What the store adds to /api/clusters/ (config/cluster_api.py composes it): where the cluster's machines
    get models (``model_source``, changed by PATCH) and the check of their reach to the hub."""

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

"""REST for deployments: list and read them with their copies, plan without deploying, deploy, scale
or change it (``PATCH``), delete. Same services as the pages; their refusals are 400s in their own words (403
for a role)."""
from fractions import Fraction

from django.core.exceptions import ValidationError
from django.db import transaction
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from clusters.models import Cluster
from console import api
from deployments import asks, forms, pages, services
from deployments.choices import ROUTING_REFUSAL, Routing
from deployments.engine import OPTIONS_MAX
from deployments.models import Copy, Deployment, StoredModel
from deployments.selectors import deployments_list
from deployments.store.services import model_add

GPUS = {float(Fraction(q, 4)): q for q, _ in forms.GPU_CHOICES}
ROUTING_HELP = ("How the gateway picks a copy for a request: least-busy (the fewest requests in flight) or cache-aware (the "
                "copy that served the prompt's prefix lately, unless it is much busier); changed without restarting copies")


def routing_field(**kwargs) -> serializers.ChoiceField:
    return serializers.ChoiceField(choices=Routing.choices, help_text=ROUTING_HELP,
                                   error_messages={"invalid_choice": ROUTING_REFUSAL}, **kwargs)


class CopyRowSerializer(serializers.ModelSerializer):
    machine = serializers.CharField(source="machine.name", default=None)
    state_label = serializers.CharField(source="get_state_display")

    class Meta:
        model = Copy
        fields = ["number", "state", "state_label", "state_reason", "machine", "slots", "address", "port", "pid",
                  "serving_since", "restarts", "log_tail"]


class GpuKindSerializer(serializers.Serializer):
    vendor = serializers.CharField(source="gpu_vendor")
    model = serializers.CharField(source="gpu_model")
    memory_mib = serializers.IntegerField(source="gpu_memory_mib")


class DeploymentSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.__str__", read_only=True)
    model_id = serializers.IntegerField(read_only=True)
    gpus_per_copy = serializers.SerializerMethodField(help_text="0.25, 0.5, 1, 2, 4, …")
    gpu_kind = GpuKindSerializer(source="*", read_only=True)
    serving = serializers.SerializerMethodField(help_text="Copies serving now, of `copies` wanted")
    deleting = serializers.SerializerMethodField()

    class Meta:
        model = Deployment
        fields = ["id", "name", "cluster", "model", "model_id", "copies", "serving", "gpus_per_copy", "gpu_kind", "arch",
                  "memory_per_gpu_mib", "context_length", "engine_options", "routing", "deleting", "created_at"]

    def get_gpus_per_copy(self, deployment) -> float:
        return float(deployment.gpus)

    def get_serving(self, deployment) -> int:
        counted = getattr(deployment, "serving", None)
        return counted if isinstance(counted, int) else deployment.copy_rows.filter(state="serving").count()

    def get_deleting(self, deployment) -> bool:
        return deployment.deleting_since is not None


class DeploymentDetailSerializer(DeploymentSerializer):
    copy_rows = CopyRowSerializer(many=True, read_only=True)

    class Meta(DeploymentSerializer.Meta):
        fields = [*DeploymentSerializer.Meta.fields, "copy_rows"]


class DeployAskSerializer(serializers.Serializer):
    cluster = api.IdField()
    model = api.IdField(required=False, help_text="A model in the server's store")
    repo = api.TextField(max_length=200, required=False,
                         help_text="Or a repository id on the hub: added to the store and downloaded first")
    name = api.TextField(max_length=63, help_text="The name clients use at the gateway")
    copies = serializers.IntegerField(min_value=0, max_value=services.COPIES_MAX, default=1)
    gpus_per_copy = serializers.FloatField(required=False,
                                           help_text="GPUs per copy: 0.25, 0.5, 1, 2, 4, 8, 16 or 32; the fewest that hold "
                                                     "the model when left out")
    gpu_kind = api.TextField(required=False, help_text="vendor|model|memory_mib|arch, as GET /api/deployments/plan lists "
                                                        "them; the kind with the most free GPUs when left out")
    memory_per_gpu_mib = serializers.IntegerField(min_value=1, required=False)
    context_length = serializers.IntegerField(min_value=16, required=False)
    engine_options = serializers.ListField(child=api.TextField(max_length=600), max_length=OPTIONS_MAX, default=list)
    routing = routing_field(default=Routing.LEAST_BUSY)
    queue_rest = serializers.BooleanField(default=False, help_text="Deploy the copies that fit and queue the rest")

    def validate_gpus_per_copy(self, value: float) -> float:
        if value not in GPUS:
            raise serializers.ValidationError("A copy takes 0.25 or 0.5 of a GPU, or 1, 2, 4, 8, 16 or 32 GPUs.")
        return value

    def validate(self, data):
        if not data.get("model") and not data.get("repo"):
            raise serializers.ValidationError({"model": ["Give a model from the store, or a repo to download first."]})
        return data


class PlanRowSerializer(serializers.Serializer):
    number = serializers.IntegerField()
    machine = serializers.CharField(required=False)
    slots = serializers.ListField(child=serializers.DictField(), required=False)
    reason = serializers.CharField(required=False)


class DeletedSerializer(serializers.Serializer):
    detail = serializers.CharField()
    job = serializers.IntegerField(required=False)
    left_on = serializers.ListField(child=serializers.CharField(), required=False, help_text=(
        "The machines whose copies run on without a deployment (the cluster could not be reached): "
        "GET /api/clusters/<id>/orphans/ lists them, and take-over keeps or deletes them"))


class ChangeSerializer(serializers.Serializer):
    copies = serializers.IntegerField(min_value=0, max_value=services.COPIES_MAX, required=False)
    name = api.TextField(max_length=63, required=False)
    model = api.IdField(required=False, help_text="Another model (or revision) in the store")
    gpus_per_copy = serializers.FloatField(required=False)
    memory_per_gpu_mib = serializers.IntegerField(min_value=1, required=False)
    context_length = serializers.IntegerField(min_value=16, required=False)
    engine_options = serializers.ListField(child=api.TextField(max_length=600), max_length=OPTIONS_MAX, required=False)
    routing = routing_field(required=False)

    def validate_gpus_per_copy(self, value: float) -> float:
        if value not in GPUS:
            raise serializers.ValidationError("A copy takes 0.25 or 0.5 of a GPU, or 1, 2, 4, 8, 16 or 32 GPUs.")
        return value

    def validate(self, data):
        unknown = sorted(set(self.initial_data) - set(self.fields)) if isinstance(self.initial_data, dict) else []
        if unknown:
            raise serializers.ValidationError({field: ["Not a field a deployment can change."] for field in unknown})
        if not data:
            raise serializers.ValidationError("Give at least one field to change.")
        return data


def ask_of_request(data: dict, user) -> services.DeployAsk:
    """The ask a JSON body describes, with the suggestion filling what it leaves out."""
    cluster = Cluster.objects.filter(pk=data["cluster"]).first()
    if cluster is None:
        raise serializers.ValidationError({"cluster": ["There is no such cluster."]})
    if data.get("model"):
        model = StoredModel.objects.filter(pk=data["model"]).first()
        if model is None:
            raise serializers.ValidationError({"model": ["There is no such model in the store."]})
    else:
        model = StoredModel.objects.filter(repo=data["repo"].strip(), revision="main").first() or \
            model_add(repo=data["repo"], user=user)
    suggestion = services.deployment_suggestion(cluster=cluster, model=model)
    kind = data.get("gpu_kind")
    if not kind:
        if not suggestion.get("kind"):
            raise serializers.ValidationError({"gpu_kind": [f"{cluster.name} has no machine with GPUs that is up."]})
        k = suggestion["kind"]
        kind = forms.kind_value(k.kind.vendor, k.kind.model, k.kind.memory_bytes // 2**20, k.arch)
    form = {"name": data["name"], "copies": data["copies"], "kind": kind,
            "gpu_quarters": GPUS[data["gpus_per_copy"]] if "gpus_per_copy" in data else suggestion.get("gpu_quarters", 4),
            "memory_per_gpu_mib": data.get("memory_per_gpu_mib") or suggestion.get("memory_per_gpu_mib") or 0,
            "context_length": data.get("context_length") or suggestion.get("context_length") or 0,
            "engine_options": data["engine_options"], "routing": data["routing"]}
    try:
        return forms.ask_from(form, cluster=cluster, model=model)
    except ValidationError as exc:
        raise serializers.ValidationError(exc.message_dict) from exc


class DeploymentViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    queryset = Deployment.objects.shown().select_related("cluster", "model").order_by("name")

    def get_serializer_class(self):
        return DeploymentSerializer if self.action == "list" else DeploymentDetailSerializer

    def list(self, request, *args, **kwargs):
        page = self.paginate_queryset(deployments_list())
        return self.get_paginated_response(DeploymentSerializer(page, many=True).data)

    @extend_schema(request=DeployAskSerializer, responses={202: DeploymentDetailSerializer})
    def create(self, request):
        """Deploy a model: its copies are placed (refused with the plan's reasons when some do not fit, unless
        ``queue_rest``), get the model's files, start, and read Serving once they answer."""
        data = DeployAskSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        with transaction.atomic():  # a model added from ``repo`` goes too when the deployment is refused
            ask = ask_of_request(data.validated_data, request.user)
            deployment = services.deployment_create(ask=ask, queue_rest=data.validated_data["queue_rest"], user=request.user)
        return Response(DeploymentDetailSerializer(Deployment.objects.get(pk=deployment.pk)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=DeployAskSerializer, responses={200: PlanRowSerializer(many=True)})
    @action(detail=False, methods=["post"])
    def plan(self, request):
        """Where each copy would go, or why it cannot; nothing is written (what is left out is suggested)."""
        data = DeployAskSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        if not data.validated_data.get("model"):
            raise serializers.ValidationError({"model": ["The plan needs a model in the store (a repo is added when you deploy)."]})
        ask = ask_of_request(data.validated_data, request.user)
        if problems := services.deployment_ask_problems(ask, user=request.user):
            raise serializers.ValidationError(problems)
        plan = services.deployment_plan(ask)
        names = dict(ask.cluster.members.values_list("machine_id", "machine__name"))
        rows = pages.plan_rows(plan, names)
        for row in rows:
            for slot in row.get("slots", []):
                slot["share"] = float(slot["share"])
        return Response(rows)

    @extend_schema(request=ChangeSerializer, responses={202: DeploymentDetailSerializer})
    def partial_update(self, request, pk=None):
        """Change a deployment. ``copies`` alone starts or stops only the difference (the running copies are
        untouched), ``routing`` is the gateway's alone (nothing restarts); any other field replaces the copies one
        at a time, each new one Serving before an old one stops."""
        deployment = self.get_object()
        data = ChangeSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        changes = dict(data.validated_data)
        if "model" in changes:
            changes["model"] = StoredModel.objects.filter(pk=changes["model"]).first()
            if changes["model"] is None:
                raise serializers.ValidationError({"model": ["There is no such model in the store."]})
        if "gpus_per_copy" in changes:
            changes["gpu_quarters"] = GPUS[changes.pop("gpus_per_copy")]
        if "engine_options" in changes:
            changes["engine_options"] = tuple(changes["engine_options"])
        services.deployment_change(deployment=deployment, ask=asks.ask_of(deployment, **changes), user=request.user)
        return Response(DeploymentDetailSerializer(Deployment.objects.get(pk=deployment.pk)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: DeletedSerializer, 200: DeletedSerializer})
    def destroy(self, request, pk=None):
        """Stop its copies (202 with the job; the record goes once they have stopped), or at once when its
        cluster cannot be reached (200): then its copies run on without a deployment on the machines ``left_on``
        names, until they are taken over (``/api/clusters/<id>/orphans/``). Copies the job cannot stop run on so too."""
        deleted = services.deployment_delete(deployment=self.get_object(), user=request.user)
        if deleted.job is not None:
            return Response({"job": deleted.job.pk, "detail": deleted.words}, status=status.HTTP_202_ACCEPTED)
        return Response({"detail": deleted.words, "left_on": list(deleted.left_on)}, status=status.HTTP_200_OK)

    @extend_schema(responses={200: CopyRowSerializer(many=True)})
    @action(detail=True, methods=["get"])
    def copies(self, request, pk=None):
        """The deployment's copies: state (with the reason), machine, GPUs and port, the engine's last lines."""
        return Response(CopyRowSerializer(self.get_object().copy_rows.select_related("machine"), many=True).data)


# -- what deployments add to /api/clusters/ (config/cluster_api.py composes it) -----------------------------


class ClusterDeploymentSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    model = serializers.CharField()
    copies = serializers.IntegerField()
    serving = serializers.IntegerField()


class DeploymentsField:
    """A cluster's answer with its deployments, each with its copies and how many serve."""

    def retrieve(self, request, *args, **kwargs):
        response = super().retrieve(request, *args, **kwargs)
        rows = deployments_list(Deployment.objects.filter(cluster_id=response.data["id"]))  # shown ones only
        response.data["deployments"] = ClusterDeploymentSerializer(
            [{"id": d.pk, "name": d.name, "model": str(d.model), "copies": d.copies, "serving": d.serving} for d in rows],
            many=True).data
        return response

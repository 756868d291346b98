"""REST for clusters: the shared networks and their test, create, read, Try again. Same services as the wizard."""
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from clusters import planning, services
from clusters.choices import MemberState
from clusters.models import Cluster, ClusterMember
from clusters.views import network_view
from console.models import Job


class MemberSerializer(serializers.ModelSerializer):
    machine = serializers.IntegerField(source="machine_id")
    name = serializers.CharField(source="machine.name")
    runtime_image = serializers.CharField(source="runtime_image.digest", default=None)

    class Meta:
        model = ClusterMember
        fields = ["machine", "name", "role", "address", "state", "state_reason", "runtime_image",
                  "image_bytes_done", "image_bytes_total", "image_source", "accelerators_in_ray"]


class ClusterSerializer(serializers.ModelSerializer):
    head = serializers.SerializerMethodField()
    runtime_image = serializers.SerializerMethodField()
    machines_up = serializers.SerializerMethodField()
    accelerators = serializers.SerializerMethodField()
    free_accelerators = serializers.SerializerMethodField()
    members = MemberSerializer(many=True, read_only=True)

    class Meta:
        model = Cluster
        fields = ["id", "name", "state", "state_reason", "network", "head", "runtime_image", "machines_up",
                  "accelerators", "free_accelerators", "members", "created_at"]

    def _joined(self, cluster):
        return [m for m in cluster.members.all() if m.state == MemberState.JOINED]

    def get_head(self, cluster) -> int | None:
        head = cluster.head
        return head.pk if head else None

    def get_runtime_image(self, cluster) -> str:
        """The runtime the cluster runs, by major version (each machine has the build for its platform)."""
        return f"Runtime {cluster.runtime_version}.x"

    def get_machines_up(self, cluster) -> int:
        return len(self._joined(cluster))

    def get_accelerators(self, cluster) -> int:
        return sum(m.accelerators_in_ray for m in self._joined(cluster))

    def get_free_accelerators(self, cluster) -> int:
        return self.get_accelerators(cluster)  # nothing is deployed yet


class ClusterCreateSerializer(serializers.Serializer):
    name = serializers.CharField(allow_blank=True)
    machines = serializers.ListField(child=serializers.IntegerField(), allow_empty=True)
    head = serializers.IntegerField(required=False, allow_null=True)
    network = serializers.CharField(help_text="The subnet as CIDR, one of GET networks/")


class NetworkTestSerializer(serializers.Serializer):
    machines = serializers.ListField(child=serializers.IntegerField(), min_length=2)
    head = serializers.IntegerField(required=False)


def _machine_ids(raw: str) -> list[int]:
    try:
        return [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise serializers.ValidationError({"machines": "Give machine ids separated by commas: ?machines=3,4"}) from None


class ClusterViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = ClusterSerializer

    def get_queryset(self):
        return Cluster.objects.prefetch_related("members__machine", "members__runtime_image")

    @extend_schema(request=ClusterCreateSerializer, responses={201: ClusterSerializer})
    def create(self, request):
        """Create a cluster and start it: the same checks and messages as the wizard."""
        data = ClusterCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        cluster = services.cluster_create(
            name=v["name"], machine_ids=v["machines"], head_id=v.get("head"), network=v["network"], user=request.user
        )
        return Response(ClusterSerializer(self.get_queryset().get(pk=cluster.pk)).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={202: ClusterSerializer})
    @action(detail=True, methods=["post"])
    def retry(self, request, pk=None):
        """Try again at once."""
        cluster = self.get_object()
        services.cluster_retry(cluster=cluster, user=request.user)
        return Response(ClusterSerializer(self.get_queryset().get(pk=cluster.pk)).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        parameters=[OpenApiParameter("machines", str, description="Machine ids, comma separated"),
                    OpenApiParameter("head", int, required=False)],
        request=NetworkTestSerializer,
    )
    @action(detail=False, methods=["get", "post"])
    def networks(self, request):
        """GET: the networks the machines share, with marks, measured figures and the suggestion.
        POST: run the bandwidth test between the head and every other machine (202, then GET again)."""
        if request.method == "POST":
            data = NetworkTestSerializer(data=request.data)
            data.is_valid(raise_exception=True)
            ids = data.validated_data["machines"]
            head = data.validated_data.get("head") or planning.suggest_head(services.candidates(ids))
            job = services.network_probe_start(machine_ids=ids, head_id=head, user=request.user)
            return Response({"job": job.pk, "state": job.state, "head": head}, status=status.HTTP_202_ACCEPTED)
        ids = _machine_ids(request.query_params.get("machines", ""))
        picked, _ = services.cluster_plan_check(machine_ids=ids, head_id=None)
        head = int(request.query_params["head"]) if request.query_params.get("head", "").isdigit() else planning.suggest_head(picked)
        view = network_view({"picked": ids, "head": head, "network": "", "probe": None})
        if view["no_network"]:
            raise DjangoValidationError({"machines": planning.NO_SHARED_NETWORK})
        probe = Job.objects.filter(kind="cluster.probe", params__head=head).first()
        return Response({
            "head": head,
            "suggested": view["suggested"],
            "test": {"job": probe.pk, "state": probe.state} if probe else None,
            "networks": [
                {
                    "subnet": n["net"].subnet,
                    "management": n["net"].management,
                    "vpn": n["net"].vpn,
                    "link_speed_mbps": n["net"].link_speed_mbps,
                    "measured_mbps": n["measured"],
                    "errors": n["failures"],
                    "members": [{"machine": m["member"].machine_id, "name": m["name"], "interface": m["member"].interface,
                                 "address": m["member"].address, "speed_mbps": m["member"].speed_mbps} for m in n["members"]],
                }
                for n in view["networks"]
            ],
        })

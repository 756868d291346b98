"""REST for clusters: the shared networks and their test, create, read, and everything the cluster page
does (start, stop, Try again, Check now, switch the runtime, change the network, add and remove
machines, delete) plus its health checks. Same services as the pages; their refusals are 400s with
the service's own message (console/api.py)."""
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import F, Prefetch
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.plumbing import build_basic_type, build_object_type
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from clusters import choosing, hooks, planning, selectors, services, steps
from clusters.choices import MemberState, Role
from clusters.connection_api import ConnectionSerializer, connection_fields
from clusters.encryption_api import EncryptionSerializer, encryption_field
from clusters.models import Cluster, ClusterMember, HealthCheck, Transfer
from clusters.nccl_api import NcclTestSerializer, last_test
from clusters.pages import network_view
from console import api, params
from console.models import Job


class TransferSerializer(serializers.ModelSerializer):
    class Meta:
        model = Transfer
        fields = ["digest", "what", "source", "bytes_done", "bytes_total", "rate", "bytes_fetched"]


class MemberSerializer(serializers.ModelSerializer):
    machine = serializers.IntegerField(source="machine_id")
    # The machine's name, the build's digest and the transfers as ClusterViewSet's queryset gives them
    # (columns of the member's row, a plain list): a list of clusters holds hundreds of members.
    name = serializers.CharField(source="machine_name")
    runtime_image = serializers.CharField(source="image_digest", allow_null=True)
    image_bytes_done = serializers.SerializerMethodField(help_text="The runtime image's bytes on the machine so far")
    image_bytes_total = serializers.SerializerMethodField()
    image_source = serializers.SerializerMethodField(help_text="the server, or the machine it came from")
    transfers = TransferSerializer(source="transfer_list", many=True, read_only=True, help_text="Every file on its way to the machine")

    class Meta:
        model = ClusterMember
        fields = ["machine", "name", "role", "address", "state", "state_reason", "runtime_image",
                  "image_bytes_done", "image_bytes_total", "image_source", "transfers", "accelerators_in_ray", "last_status"]

    def to_representation(self, member):
        # Three fields read the runtime image's transfer: it is found once per member (a list serializes
        # its members one after the other with this one serializer).
        self._image_transfer = next((t for t in member.transfer_list if t.digest == member.image_digest), None)
        return super().to_representation(member)

    def get_image_bytes_done(self, member) -> int:
        return self._image_transfer.bytes_done if self._image_transfer else 0

    def get_image_bytes_total(self, member) -> int:
        return self._image_transfer.bytes_total if self._image_transfer else 0

    def get_image_source(self, member) -> str:
        return self._image_transfer.source if self._image_transfer else ""


class ClusterSerializer(serializers.ModelSerializer):
    head = serializers.SerializerMethodField()
    runtime_image = serializers.SerializerMethodField()
    machines_up = serializers.SerializerMethodField()
    accelerators = serializers.SerializerMethodField()
    free_accelerators = serializers.SerializerMethodField(help_text="GPUs of the machines that are up, less what copies of models hold (a share of a GPU counts as its share)")
    members = MemberSerializer(many=True, read_only=True)

    class Meta:
        model = Cluster
        fields = ["id", "name", "state", "state_reason", "network", "model_source", "head", "runtime_image", "machines_up",
                  "accelerators", "free_accelerators", "members", "restart_attempt", "next_retry_at",
                  "last_status_at", "created_at"]

    def _joined(self, cluster):
        return [m for m in cluster.members.all() if m.state == MemberState.JOINED]

    def get_head(self, cluster) -> int | None:
        return next((m.machine_id for m in cluster.members.all() if m.role == Role.HEAD), None)

    def get_runtime_image(self, cluster) -> str:
        """The runtime the cluster runs, by major version (each machine has the build for its platform)."""
        return f"Runtime {cluster.runtime_version}.x"

    def get_machines_up(self, cluster) -> int:
        return len(self._joined(cluster))

    def get_accelerators(self, cluster) -> int:
        return sum(m.accelerators_in_ray for m in self._joined(cluster))

    def get_free_accelerators(self, cluster) -> float:
        return hooks.accelerators_free(cluster, self._joined(cluster))


class MemberSummarySerializer(MemberSerializer):
    """A member as the list of clusters gives it: without its last status (GET the cluster for that)."""

    class Meta(MemberSerializer.Meta):
        fields = [f for f in MemberSerializer.Meta.fields if f != "last_status"]


class ClusterSummarySerializer(ClusterSerializer):
    """A cluster as the list gives it: its members without their last status. That status (what the
    runtime and Ray last reported, about 1 KB a machine) is in GET /api/clusters/<id>/: in the list
    it was most of the answer."""

    members = MemberSummarySerializer(many=True, read_only=True)


class ClusterDetailSerializer(ClusterSerializer):
    """One cluster (GET /api/clusters/<id>/): its members' last status, and how to reach it."""

    connection = serializers.SerializerMethodField(help_text="Every node with its ssh_command, and every command of the "
                                                              "Connect card; null until every machine is Up")
    connection_reason = serializers.SerializerMethodField(help_text="Why connection is null (Waiting for lab-b to be Up.); empty otherwise")

    last_test = serializers.SerializerMethodField(help_text="The newest NCCL test (GET tests/<id>/ for one), null before any")
    encryption = serializers.SerializerMethodField(help_text="What the encryption card says: Ray, model traffic, certificates")

    class Meta(ClusterSerializer.Meta):
        fields = [*ClusterSerializer.Meta.fields, "connection", "connection_reason", "last_test", "encryption"]

    @extend_schema_field(EncryptionSerializer())
    def get_encryption(self, cluster):
        return encryption_field(cluster)

    @extend_schema_field(NcclTestSerializer(allow_null=True))
    def get_last_test(self, cluster):
        return last_test(cluster)

    def _reach(self, cluster) -> dict:
        # Both fields come from one look at the cluster.
        if getattr(self, "_reach_of", (None,))[0] != cluster.pk:
            self._reach_of = (cluster.pk, connection_fields(cluster))
        return self._reach_of[1]

    @extend_schema_field(ConnectionSerializer(allow_null=True))
    def get_connection(self, cluster):
        return self._reach(cluster)["connection"]

    def get_connection_reason(self, cluster) -> str:
        return self._reach(cluster)["connection_reason"]


class ClusterJobSerializer(ClusterSerializer):
    """The cluster after an action, and the job that carries it out (null when nothing had to run)."""

    job = serializers.IntegerField(allow_null=True, read_only=True, help_text="The id of the job that carries the action out")

    class Meta(ClusterSerializer.Meta):
        fields = [*ClusterSerializer.Meta.fields, "job"]


class ClusterJobSchema(OpenApiSerializerExtension):
    """ClusterJob in the schema as Cluster plus ``job`` (allOf), so the cluster's fields and enums are
    described once (a copy would make drf-spectacular rename ClusterStateEnum)."""

    target_class = ClusterJobSerializer

    def map_serializer(self, auto_schema, direction):
        cluster = auto_schema.resolve_serializer(ClusterSerializer, direction)
        job = {**build_basic_type(OpenApiTypes.INT), "nullable": True, "readOnly": True,
               "description": "The id of the job that carries the action out; null when nothing had to run"}
        return {"allOf": [cluster.ref, build_object_type(properties={"job": job}, required=["job"])]}


class CheckQueuedSerializer(serializers.Serializer):
    queued = serializers.BooleanField(help_text="A check was queued: GET health-checks/ for what it found")


class ChangeNetworkSerializer(serializers.Serializer):
    network = serializers.CharField(allow_blank=True, help_text="A subnet all the cluster's machines share, as CIDR: 198.18.1.0/24")


class AddMachinesSerializer(serializers.Serializer):
    machines = api.id_list_field(allow_empty=True, help_text="Machine ids, as in join-candidates/")


class HealthCheckSerializer(serializers.ModelSerializer):
    class Meta:
        model = HealthCheck
        fields = ["id", "trigger", "trigger_detail", "outcome", "looked_at", "found", "action", "started_at", "finished_at"]


class JoinCandidateSerializer(serializers.Serializer):
    """A machine outside the cluster, and whether it may join (the Add machines list of the page)."""

    machine = serializers.IntegerField()
    name = serializers.CharField()
    state = serializers.CharField()
    arch = serializers.CharField(allow_blank=True)
    accelerators = serializers.IntegerField()
    accelerator_model = serializers.CharField(allow_blank=True)
    cluster = serializers.CharField(allow_null=True, help_text="The cluster it belongs to, if any")
    address = serializers.CharField(allow_null=True, help_text="Its address on the cluster's network, if it has one")
    selectable = serializers.BooleanField()
    refusal = serializers.CharField(allow_blank=True, help_text="Why it cannot join, when it cannot")
    warning = serializers.CharField(allow_blank=True)
    runtime = serializers.CharField(allow_blank=True, help_text="The runtime it would run")


class JoinCandidatePageSerializer(serializers.Serializer):
    count = serializers.IntegerField(help_text="Machines the filter finds")
    page = serializers.IntegerField()
    pages = serializers.IntegerField()
    results = JoinCandidateSerializer(many=True)


class ClusterCreateSerializer(serializers.Serializer):
    name = serializers.CharField(allow_blank=True)
    machines = api.id_list_field(allow_empty=True)
    head = api.IdField(required=False, allow_null=True)
    network = serializers.CharField(help_text="The subnet as CIDR, one of GET networks/")


class NetworkTestSerializer(serializers.Serializer):
    machines = api.id_list_field(min_length=2)
    head = api.IdField(required=False, help_text="The machine the others are measured from; the suggested head when left out")


class NetworkTestStartedSerializer(serializers.Serializer):
    job = serializers.IntegerField(help_text="The test's job: GET networks/ with the same machines shows its figures")
    state = serializers.CharField()
    head = serializers.IntegerField()


class NetworkMemberSerializer(serializers.Serializer):
    machine = serializers.IntegerField()
    name = serializers.CharField()
    interface = serializers.CharField()
    address = serializers.CharField()
    speed_mbps = serializers.IntegerField(allow_null=True)


class SharedNetworkSerializer(serializers.Serializer):
    subnet = serializers.CharField()
    management = serializers.BooleanField(help_text="It carries the console's traffic or the default route")
    vpn = serializers.BooleanField()
    link_speed_mbps = serializers.IntegerField(allow_null=True, help_text="The slowest link's speed")
    measured_mbps = serializers.FloatField(allow_null=True, help_text="The slowest link as the last test measured it")
    errors = serializers.ListField(child=serializers.CharField(), help_text="What the last test could not measure")
    members = NetworkMemberSerializer(many=True)


class NetworkTestStateSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    state = serializers.CharField()


class NetworksSerializer(serializers.Serializer):
    head = serializers.IntegerField(allow_null=True)
    suggested = serializers.CharField(allow_null=True, help_text="The subnet the wizard suggests")
    test = NetworkTestStateSerializer(allow_null=True, help_text="The last network test from this head, if any")
    networks = SharedNetworkSerializer(many=True)


class ClusterViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """The clusters' own API. /api/clusters/ is this with what each part adds (the connection's certificate,
    the NCCL test, the model source, the deployments), composed in config/cluster_api.py."""

    serializer_class = ClusterSerializer

    def get_serializer_class(self):
        return {"list": ClusterSummarySerializer, "retrieve": ClusterDetailSerializer}.get(self.action, ClusterSerializer)

    def get_queryset(self):
        """The clusters with the columns the answer shows: no raw status of the cluster (it is not in the
        answer), no machine facts, no chunk hashes; the members' last status only for one cluster."""
        fields = ["cluster", "machine", "runtime_image", "role", "address", "state", "state_reason", "accelerators_in_ray",
                  *(() if self.action == "list" else ("last_status",))]
        members = (ClusterMember.objects.only(*fields).annotate(machine_name=F("machine__name"), image_digest=F("runtime_image__digest"))
                   .order_by("machine__name")
                   .prefetch_related(Prefetch("transfers", queryset=Transfer.objects.order_by("what"), to_attr="transfer_list")))
        return Cluster.objects.defer("last_status").prefetch_related(Prefetch("members", queryset=members))

    def _answer(self, cluster: Cluster, job: Job | None, *, started: int = status.HTTP_202_ACCEPTED,
                recorded: int = status.HTTP_200_OK) -> Response:
        """The cluster as it is now, with the job that carries the action out: 202 when a job runs, else 200."""
        body = ClusterSerializer(self.get_queryset().get(pk=cluster.pk)).data
        body["job"] = job.pk if job else None
        return Response(body, status=started if job else recorded)

    @extend_schema(parameters=[OpenApiParameter("name", str, required=False, description="Only the cluster of this name")])
    def list(self, request, *args, **kwargs):
        """Every cluster, 50 a page, with its members; a member's last status only in GET /api/clusters/<id>/.
        ``?name=`` finds one by its name (faden ssh does)."""
        return super().list(request, *args, **kwargs)

    def filter_queryset(self, queryset):
        if self.action == "list" and (name := self.request.query_params.get("name")) is not None:
            queryset = queryset.filter(name=name)
        return super().filter_queryset(queryset)

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

    @extend_schema(request=None, responses={202: ClusterJobSerializer, 204: None})
    def destroy(self, request, pk=None):
        """Delete the cluster; its machines stay enrolled. Refused while deployments exist. A stopped cluster
        (or one whose machines are all offline) goes at once: 204. Otherwise Ray and the runtime stop first:
        202 with the cluster (Deleting) and the job, and the record goes when the job ends."""
        cluster = self.get_object()
        job = services.cluster_delete(cluster=cluster, user=request.user)
        if job is None:
            return Response(status=status.HTTP_204_NO_CONTENT)
        return self._answer(cluster, job)

    @extend_schema(request=None, responses={202: ClusterJobSerializer})
    @action(detail=True, methods=["post"])
    def retry(self, request, pk=None):
        """Try again at once (a cluster that waits, retries or failed)."""
        cluster = self.get_object()
        job = services.cluster_retry(cluster=cluster, user=request.user)
        return self._answer(cluster, job)

    @extend_schema(request=None, responses={202: ClusterJobSerializer})
    @action(detail=True, methods=["post"])
    def start(self, request, pk=None):
        """Start a stopped cluster on its machines, network and runtime."""
        cluster = self.get_object()
        job = services.cluster_start(cluster=cluster, user=request.user)
        return self._answer(cluster, job)

    @extend_schema(request=None, responses={202: ClusterJobSerializer})
    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        """Stop Ray and the runtime on every machine; machines, network and deployments stay."""
        cluster = self.get_object()
        job = services.cluster_stop(cluster=cluster, user=request.user)
        return self._answer(cluster, job)

    @extend_schema(request=None, responses={202: CheckQueuedSerializer})
    @action(detail=True, methods=["post"])
    def check(self, request, pk=None):
        """Check now: look at a running cluster at once; GET health-checks/ for what the check found."""
        services.cluster_check_now(cluster=self.get_object(), user=request.user)
        return Response({"queued": True}, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: ClusterJobSerializer, 200: ClusterJobSerializer})
    @action(detail=True, methods=["post"], url_path="switch-runtime")
    def switch_runtime(self, request, pk=None):
        """Switch every machine to the newest certified build for its kind. A running cluster restarts on
        it (202 with the job); a stopped one only records it (200, job null) and runs it when it starts."""
        cluster = self.get_object()
        job = services.cluster_switch_runtime(cluster=cluster, user=request.user)
        return self._answer(cluster, job)

    @extend_schema(request=ChangeNetworkSerializer, responses={202: ClusterJobSerializer, 200: ClusterJobSerializer})
    @action(detail=True, methods=["post"], url_path="change-network")
    def change_network(self, request, pk=None):
        """Move the cluster to another network its machines share. A running cluster restarts on it
        (202 with the job); a stopped one only records it (200, job null)."""
        cluster = self.get_object()
        data = ChangeNetworkSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        job = services.cluster_change_network(cluster=cluster, network=data.validated_data["network"], user=request.user)
        return self._answer(cluster, job)

    @extend_schema(request=AddMachinesSerializer, responses={202: ClusterJobSerializer})
    @action(detail=True, methods=["post"], url_path="machines")
    def add_machines(self, request, pk=None):
        """Add machines to a running cluster, with the page's checks (GET join-candidates/ says which may join)."""
        cluster = self.get_object()
        data = AddMachinesSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        job = services.cluster_add_machines(cluster=cluster, machine_ids=data.validated_data["machines"], user=request.user)
        return self._answer(cluster, job)

    @extend_schema(
        parameters=[OpenApiParameter("machine_id", int, OpenApiParameter.PATH, description="The machine's id")],
        request=None, responses={202: ClusterJobSerializer},
    )
    @action(detail=True, methods=["delete"], url_path=r"machines/(?P<machine_id>[0-9]{1,19})")
    def remove_machine(self, request, pk=None, machine_id=None):
        """Remove a machine from a stopped cluster's record (nothing runs, so nothing is stopped). Answers
        the cluster as it is now: when the head left, the machine with the most accelerators leads. The job
        takes the cluster's settings off the machine (at its next contact when it is away) and gives the
        others a new node key."""
        cluster = self.get_object()
        machine_id = params.parse_int(machine_id, name="machine_id")
        job = services.cluster_member_remove(cluster=cluster, machine_id=machine_id, user=request.user)
        return self._answer(cluster, job)

    @extend_schema(request=None, responses={200: HealthCheckSerializer(many=True)})
    @action(detail=True, methods=["get"], url_path="health-checks")
    def health_checks(self, request, pk=None):
        """The cluster's health checks, newest first: what each looked at, found and did."""
        cluster = self.get_object()
        checks = HealthCheck.objects.filter(cluster=cluster).order_by("-started_at", "-pk")
        page = self.paginate_queryset(checks)
        return self.get_paginated_response(HealthCheckSerializer(page, many=True).data)

    @extend_schema(
        request=None, responses={200: JoinCandidatePageSerializer},
        parameters=[OpenApiParameter("q", str, required=False, description="Part of the machine's name"),
                    OpenApiParameter("kind", str, required=False, description="vendor/arch (nvidia/x86_64), or none"),
                    OpenApiParameter("state", str, required=False, description="available, or a machine state"),
                    OpenApiParameter("page", int, required=False)],
    )
    @action(detail=True, methods=["get"], url_path="join-candidates", pagination_class=None)
    def join_candidates(self, request, pk=None):
        """The machines outside the cluster, a page of 50 at a time by name, and whether each may join:
        the page's Add machines list, with its filters."""
        cluster = self.get_object()
        found = selectors.MachineFilter.from_params(request.query_params)
        listed = selectors.machines_page(found, exclude=selectors.cluster_machine_ids(cluster))
        rows = [
            {
                "machine": candidate.id,
                "name": candidate.name,
                "state": candidate.state,
                "arch": candidate.arch,
                "accelerators": candidate.accelerator_count,
                "accelerator_model": candidate.accelerator_model,
                "cluster": candidate.cluster_name,
                "address": verdict.address,
                "selectable": verdict.selectable,
                "refusal": verdict.refusal,
                "warning": verdict.warning,
                "runtime": verdict.runtime_label,
            }
            for candidate, verdict in selectors.cluster_join_verdicts(cluster, listed.ids)
        ]
        return Response({"count": listed.total, "page": listed.page, "pages": listed.pages,
                         "results": JoinCandidateSerializer(rows, many=True).data})

    @extend_schema(
        methods=["GET"], request=None, responses={200: NetworksSerializer},
        parameters=[OpenApiParameter("machines", str, required=True, description="Machine ids, comma separated: 3,4"),
                    OpenApiParameter("head", int, required=False, description="The machine measured from")],
    )
    @extend_schema(methods=["POST"], request=NetworkTestSerializer, responses={202: NetworkTestStartedSerializer})
    @action(detail=False, methods=["get", "post"])
    def networks(self, request):
        """GET: the networks the machines share, with marks, measured figures and the suggestion.
        POST: run the bandwidth test between the head and every other machine (202, then GET again)."""
        if request.method == "POST":
            return self._network_test_start(request)
        ids = params.id_list(request.query_params.getlist("machines"), name="machines")
        head = params.int_param(request.query_params, "head")
        picked, _ = choosing.cluster_plan_check(machine_ids=ids, head_id=None)
        head = head or planning.suggest_head(picked)
        view = network_view({"picked": ids, "head": head, "network": "", "probe": None}, picked=picked)
        if view["no_network"]:
            raise DjangoValidationError({"machines": planning.NO_SHARED_NETWORK})
        probe = Job.objects.filter(kind=steps.PROBE_KIND, params__head=head).first()
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

    def _network_test_start(self, request) -> Response:
        data = NetworkTestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        ids = data.validated_data["machines"]
        head = data.validated_data.get("head") or planning.suggest_head(selectors.candidates(ids))
        job = choosing.network_probe_start(machine_ids=ids, head_id=head, user=request.user)
        return Response({"job": job.pk, "state": job.state, "head": head}, status=status.HTTP_202_ACCEPTED)

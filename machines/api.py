"""REST for machines: list, add, read, choose the container runtime, delete, refresh, trust a host key,
update the agent. Same services as the pages."""
import functools

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Prefetch
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from console import api
from console.models import Job
from machines import services
from machines.choices import RuntimeChoice
from machines.models import Accelerator, Machine, NetworkInterface
from machines.validators import (
    validate_address,
    validate_fingerprint,
    validate_machine_name,
    validate_ssh_user,
)


class AcceleratorSerializer(serializers.ModelSerializer):
    class Meta:
        model = Accelerator
        fields = ["index", "vendor", "model", "memory_mib", "uuid", "foreign_pids", "foreign_memory_mib"]
        extra_kwargs = {"foreign_pids": {"help_text": "Processes the console did not start that use this GPU (a person's "
                                                      "job): no copy of a model is placed on it while there are any"}}


class AcceleratorsSerializer(serializers.Serializer):
    """The machine's accelerators in one line (count, model, memory) and each one."""

    count = serializers.IntegerField()
    model = serializers.CharField(allow_blank=True)
    memory_mib = serializers.IntegerField(allow_null=True)
    devices = AcceleratorSerializer(many=True)


class InterfaceSerializer(serializers.ModelSerializer):
    class Meta:
        model = NetworkInterface
        fields = ["name", "kind", "addresses", "speed_mbps", "default_route", "management", "mac", "mtu", "state"]


class RuntimeSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="docker or podman")
    version = serializers.CharField(allow_blank=True)


class MachineSerializer(serializers.ModelSerializer):
    state_display = serializers.SerializerMethodField()
    container_runtime = serializers.CharField(
        read_only=True, help_text="The container runtime in use (the config's driver, else the choice, else Docker, "
        "else Podman); empty: none, and the machine cannot be picked for a cluster")
    container_runtimes = RuntimeSerializer(many=True, read_only=True, help_text="Every engine the agent found")
    accelerators = serializers.SerializerMethodField()
    interfaces = InterfaceSerializer(many=True, read_only=True)
    url = serializers.HyperlinkedIdentityField(view_name="machine-detail")
    agent_latest = serializers.CharField(read_only=True, help_text="The agent version this console ships and installs")
    agent_outdated = serializers.BooleanField(
        read_only=True, help_text="The machine's agent is older than agent_latest (or unknown): POST update-agent/ installs it")

    class Meta:
        model = Machine
        fields = [
            "id", "url", "name", "address", "ssh_port", "ssh_user", "state", "state_display", "state_reason",
            "host_key_fingerprint", "offered_host_key_fingerprint", "arch", "hostname", "cpu_count", "memory_mib",
            "store_path", "store_free_bytes", "container_runtime", "container_runtime_version", "container_runtimes",
            "configured_runtime", "runtime_choice", "agent_version", "agent_latest", "agent_outdated", "accelerators",
            "interfaces",
            "last_seen", "facts_at", "created_at",
        ]
        read_only_fields = fields

    def get_state_display(self, machine: Machine) -> str:
        return machine.get_state_display()

    @functools.cached_property
    def _device(self) -> AcceleratorSerializer:
        # One serializer for every machine's devices: a ModelSerializer reads its model's fields each
        # time one is made, and a page holds fifty machines.
        return AcceleratorSerializer()

    @extend_schema(responses=AcceleratorsSerializer)
    def get_accelerators(self, machine: Machine) -> dict:
        devices = list(machine.accelerators.all())
        models = {d.model for d in devices}
        return {
            "count": len(devices),
            "model": models.pop() if len(models) == 1 else (" + ".join(sorted(models)) if models else ""),
            "memory_mib": devices[0].memory_mib if devices else None,
            "devices": [self._device.to_representation(d) for d in devices],
        }


class MachineCreateSerializer(serializers.Serializer):
    name = serializers.CharField(validators=[validate_machine_name])
    address = serializers.CharField(validators=[validate_address])
    ssh_port = api.IntegerField(default=22, min_value=1, max_value=65535)
    ssh_user = serializers.CharField(default="root", validators=[validate_ssh_user])
    host_key_fingerprint = serializers.CharField(
        required=False, allow_blank=True, validators=[validate_fingerprint],
        help_text="The machine's SHA256 host key fingerprint. Given: enrolment starts at once. "
        "Left out: the machine waits for POST trust-host-key/ with the fingerprint it offered.",
    )


class MachineChangeSerializer(serializers.Serializer):
    """What PATCH changes on a machine: the container runtime its clusters start with."""

    runtime_choice = serializers.ChoiceField(
        choices=RuntimeChoice.choices,
        help_text='"" (automatic: Docker when the machine has it, else Podman), "docker" or "podman": '
        "an engine the machine's agent found. Used from the next start of its cluster.",
        error_messages={"invalid_choice": 'Choose "docker", "podman" or "" (automatic): "{input}" is not a container runtime.'},
    )


class TrustHostKeySerializer(serializers.Serializer):
    fingerprint = serializers.CharField(help_text="The fingerprint the machine offered (SHA256:...)")


class JobSerializer(serializers.ModelSerializer):
    class Meta:
        model = Job
        fields = ["id", "kind", "title", "state", "steps", "error", "created_at", "started_at", "finished_at"]


class MachineViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet
):
    serializer_class = MachineSerializer

    def get_queryset(self):
        """The machines with their accelerators and interfaces, sorted within each machine (the default
        order would join the machines again to sort by name); no facts, no cluster."""
        return Machine.objects.defer("facts").prefetch_related(
            Prefetch("accelerators", queryset=Accelerator.objects.order_by("index")),
            Prefetch("interfaces", queryset=NetworkInterface.objects.order_by("name")))

    @extend_schema(request=MachineCreateSerializer, responses={201: MachineSerializer})
    def create(self, request):
        """Add a machine. The console fetches its host key first; nothing is stored if that fails."""
        data = MachineCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        machine = services.machine_create(**data.validated_data, user=request.user)
        body = MachineSerializer(machine, context={"request": request}).data
        return Response(body, status=status.HTTP_201_CREATED)

    @extend_schema(request=MachineChangeSerializer, responses={200: MachineSerializer})
    def partial_update(self, request, pk=None):
        """Choose the container runtime (``runtime_choice``); an Administrator's. An engine the machine
        does not have is refused with a 400 that says so."""
        data = MachineChangeSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        machine = services.machine_runtime_choose(machine=self.get_object(), choice=data.validated_data["runtime_choice"],
                                                  user=request.user)
        return Response(MachineSerializer(machine, context={"request": request}).data)

    def perform_destroy(self, machine):
        services.machine_delete(machine=machine, user=self.request.user)

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"])
    def refresh(self, request, pk=None):
        """Read the machine's facts again (installing the current agent if needed)."""
        job = services.machine_refresh(machine=self.get_object(), user=request.user)
        return Response(JobSerializer(job).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: JobSerializer})
    @action(detail=True, methods=["post"], url_path="update-agent")
    def update_agent(self, request, pk=None):
        """Install the console's agent (agent_latest) on a Healthy machine and restart its heartbeat on
        it; Ray and the containers keep running. An up-to-date machine's job checks and says so."""
        job = services.machine_update_agent(machine=self.get_object(), user=request.user)
        return Response(JobSerializer(job).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=TrustHostKeySerializer, responses={202: JobSerializer})
    @action(detail=True, methods=["post"], url_path="trust-host-key")
    def trust_host_key(self, request, pk=None):
        """Trust the host key the machine offered (first contact, or after it changed) and enrol it."""
        data = TrustHostKeySerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            job = services.machine_trust_host_key(
                machine=self.get_object(), fingerprint=data.validated_data["fingerprint"], user=request.user
            )
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from exc
        return Response(JobSerializer(job).data, status=status.HTTP_202_ACCEPTED)

"""factory-boy factories for the console's rows: machines, what they report, and jobs."""
import base64
import hashlib

import factory
from django.contrib.auth import get_user_model
from django.utils import timezone

from console import roles
from console.choices import JobState, StepState
from console.models import Job
from machines.agent import agent_version
from machines.choices import InterfaceKind, MachineState
from machines.models import Accelerator, Machine, NetworkInterface


def fingerprint_for(seed: str) -> str:
    """A well-formed host key fingerprint (SHA256: + 43 base64 characters), different for every seed."""
    digest = hashlib.sha256(seed.encode()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


NO_ROLE = "no role"  # UserFactory(role=NO_ROLE): an account made in the admin and given no group


class UserFactory(factory.django.DjangoModelFactory):
    """A user with a role (an Administrator unless told: ``UserFactory(role=roles.VIEWER)``), given
    through its group as the Users page gives it."""

    class Meta:
        model = get_user_model()
        django_get_or_create = ["username"]
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"admin{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.com")
    password = factory.django.Password("correct horse battery staple")

    @factory.post_generation
    def role(user, create, role, **kwargs):
        if create and role != NO_ROLE:
            roles.role_set(user, role or roles.ADMINISTRATOR)


class MachineFactory(factory.django.DjangoModelFactory):
    """An enrolled, healthy machine that beat just now."""

    class Meta:
        model = Machine

    name = factory.Sequence(lambda n: f"gpu-{n:03d}")
    address = factory.Sequence(lambda n: f"198.18.{n // 250}.{n % 250 + 1}")
    ssh_port = 22
    ssh_user = "root"
    host_key_fingerprint = factory.LazyAttribute(lambda m: fingerprint_for(m.name))
    state = MachineState.HEALTHY
    arch = "x86_64"
    agent_version = factory.LazyFunction(agent_version)
    last_seen = factory.LazyFunction(timezone.now)
    # Docker found and in use, as on a real GPU machine (the lab's report "process", configured).
    container_runtime = "docker"
    container_runtime_version = "27.3.1"
    container_runtimes = factory.LazyFunction(lambda: [{"name": "docker", "version": "27.3.1"}])

    class Params:
        # Neither Docker nor Podman found: it cannot be picked for a cluster.
        no_runtime = factory.Trait(container_runtime="", container_runtime_version="", container_runtimes=[])
        # Both found; Docker in use unless ``runtime_choice="podman"`` (give container_runtime too).
        both_runtimes = factory.Trait(container_runtimes=[{"name": "docker", "version": "27.3.1"},
                                                          {"name": "podman", "version": "4.9.3"}])
        # A machine just added without a fingerprint: it waits for an administrator to confirm the key.
        awaiting_host_key = factory.Trait(
            state=MachineState.HOST_KEY,
            host_key_fingerprint="",
            offered_host_key_fingerprint=factory.LazyAttribute(lambda m: fingerprint_for(m.name + "-offered")),
            agent_version="",
            last_seen=None,
            container_runtime="",
            container_runtime_version="",
            container_runtimes=[],
        )


class AcceleratorFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Accelerator

    machine = factory.SubFactory(MachineFactory)
    index = factory.LazyAttribute(lambda a: a.machine.accelerators.count())  # the machine's next device
    vendor = "nvidia"
    model = "NVIDIA H100 80GB HBM3"
    memory_mib = 81559
    uuid = factory.Sequence(lambda n: f"GPU-{n:08x}-0000-0000-0000-000000000000")
    pci_bus_id = factory.Sequence(lambda n: f"00000000:{n % 256:02X}:00.0")


class NetworkInterfaceFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = NetworkInterface

    machine = factory.SubFactory(MachineFactory)
    name = factory.Sequence(lambda n: f"eth{n}")
    kind = InterfaceKind.PHYSICAL
    mac = factory.Sequence(lambda n: f"02:00:00:00:{n // 256 % 256:02x}:{n % 256:02x}")
    mtu = 1500
    state = "up"
    addresses = factory.LazyAttribute(lambda i: [f"{i.machine.address}/24"])
    speed_mbps = 100000
    default_route = False
    management = False


class JobFactory(factory.django.DjangoModelFactory):
    """A queued job on a machine (give ``target_id=machine.pk``), with the enrolment's steps."""

    class Meta:
        model = Job

    kind = "machine.refresh"
    title = "Refresh facts"
    target_type = "machine"
    target_id = factory.LazyAttribute(lambda j: MachineFactory().pk)
    state = JobState.QUEUED
    steps = factory.LazyFunction(
        lambda: [{"name": name, "state": StepState.PENDING, "detail": ""} for name in ("Connect", "Read facts")]
    )

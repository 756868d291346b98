"""The lifecycle of a machine: its states, the allowed moves, and how each state looks."""
from django.db import models


class MachineState(models.TextChoices):
    HOST_KEY = "host_key", "Host key to confirm"  # first contact: an administrator confirms the fingerprint
    ENROLLING = "enrolling", "Enrolling"  # the console installs the agent and reads the facts
    HEALTHY = "healthy", "Healthy"  # enrolled and beating
    OFFLINE = "offline", "Offline"  # no heartbeat for FADEN_OFFLINE_AFTER seconds
    FAILED = "failed", "Failed"  # a job failed or the host key changed; reason says which


TRANSITIONS: dict[str, frozenset[str]] = {
    MachineState.HOST_KEY: frozenset({MachineState.ENROLLING, MachineState.FAILED}),
    MachineState.ENROLLING: frozenset({MachineState.HEALTHY, MachineState.FAILED, MachineState.HOST_KEY}),
    MachineState.HEALTHY: frozenset({MachineState.OFFLINE, MachineState.FAILED, MachineState.ENROLLING}),
    MachineState.OFFLINE: frozenset({MachineState.HEALTHY, MachineState.FAILED, MachineState.ENROLLING}),
    MachineState.FAILED: frozenset({MachineState.ENROLLING, MachineState.HEALTHY, MachineState.OFFLINE}),
}

# Machines that answer and can run work.
MACHINE_USABLE = frozenset({MachineState.HEALTHY})
# The agent is about to be installed (the current one): no update to offer yet.
AGENT_PENDING = frozenset({MachineState.HOST_KEY, MachineState.ENROLLING})
# States a heartbeat or a facts refresh may bring back to Healthy.
MACHINE_RECOVERABLE = frozenset({MachineState.OFFLINE})

MACHINE_BADGE = {
    MachineState.HOST_KEY: "amber",
    MachineState.ENROLLING: "blue",
    MachineState.HEALTHY: "green",
    MachineState.OFFLINE: "grey",
    MachineState.FAILED: "red",
}


class InterfaceKind(models.TextChoices):
    PHYSICAL = "physical", "Physical"
    BRIDGE = "bridge", "Bridge"
    VPN = "vpn", "VPN-like"
    VIRTUAL = "virtual", "Virtual"
    LOOPBACK = "loopback", "Loopback"


class EventKind(models.TextChoices):
    STATE = "state", "State change"
    RECONNECTED = "reconnected", "Reconnected"
    HOST_KEY = "host_key", "Host key"
    FACTS = "facts", "Facts"
    RUNTIME = "runtime", "Container runtime"


class RuntimeChoice(models.TextChoices):
    """The container runtime an administrator chose for a machine (machines/runtimes.py has the rule)."""

    AUTOMATIC = "", "Automatic"  # Docker when the machine has it, else Podman
    DOCKER = "docker", "Docker"
    PODMAN = "podman", "Podman"

"""The lifecycles of a cluster and of each machine in it, and how each state looks."""
from django.db import models


class ClusterState(models.TextChoices):
    STARTING = "starting", "Starting"  # images travel, runtimes start, Ray starts and the others join
    WAITING = "waiting", "Waiting"  # a start failed in a way a retry cannot change, or needs a person: Try again
    RETRYING = "retrying", "Retrying"  # a start failed; tried again after a growing pause
    RUNNING = "running", "Running"  # Ray's own node list holds every machine that joined
    STOPPING = "stopping", "Stopping"  # Ray and the runtime stop on every machine
    STOPPED = "stopped", "Stopped"  # nothing runs; machines, network and deployments are kept
    FAILED = "failed", "Failed"  # three restarts failed; tried again every 15 minutes
    DELETING = "deleting", "Deleting"  # stopped first, then the record goes


_S = ClusterState
CLUSTER_TRANSITIONS: dict[str, frozenset[str]] = {
    _S.STARTING: frozenset({_S.RUNNING, _S.WAITING, _S.RETRYING, _S.FAILED, _S.STOPPING, _S.DELETING}),
    _S.WAITING: frozenset({_S.STARTING, _S.STOPPING, _S.DELETING}),
    _S.RETRYING: frozenset({_S.STARTING, _S.WAITING, _S.FAILED, _S.STOPPING, _S.DELETING}),
    _S.RUNNING: frozenset({_S.STARTING, _S.STOPPING, _S.FAILED, _S.DELETING}),
    _S.STOPPING: frozenset({_S.STOPPED, _S.WAITING, _S.DELETING}),
    _S.STOPPED: frozenset({_S.STARTING, _S.DELETING}),
    _S.FAILED: frozenset({_S.STARTING, _S.STOPPING, _S.DELETING}),
    # A delete that the machines did not confirm leaves the cluster waiting for a person.
    _S.DELETING: frozenset({_S.WAITING}),
}

# What Stop, Start and Delete offer in each state (the page and the API refuse the rest).
CAN_STOP = frozenset({_S.STARTING, _S.WAITING, _S.RETRYING, _S.RUNNING, _S.FAILED})
CAN_START = frozenset({_S.STOPPED})
CAN_RETRY = frozenset({_S.WAITING, _S.RETRYING, _S.FAILED})
CAN_DELETE = frozenset(set(_S) - {_S.DELETING})
# Health checks look at these; a cluster in any other state has a job or a person on it.
CHECKED = frozenset({_S.RUNNING})

CLUSTER_BADGE = {
    ClusterState.STARTING: "blue",
    ClusterState.WAITING: "amber",
    ClusterState.RETRYING: "amber",
    ClusterState.RUNNING: "green",
    ClusterState.STOPPING: "blue",
    ClusterState.STOPPED: "grey",
    ClusterState.FAILED: "red",
    ClusterState.DELETING: "blue",
}


class MemberState(models.TextChoices):
    PENDING = "pending", "Waiting to start"
    IMAGE = "image", "Getting the runtime image"
    LOADING = "loading", "Loading the image"
    RAY = "ray", "Starting Ray"
    JOINED = "joined", "Up"  # in Ray's node list with its accelerators
    FAILED = "failed", "Did not join"  # the reason is on the member
    DOWN = "down", "Out of the cluster"  # was up; a health check found it gone (the reason says why)
    REJOINING = "rejoining", "Joining again"  # a repair: out of Ray, then joined again
    STOPPED = "stopped", "Stopped"


MEMBER_BADGE = {
    MemberState.PENDING: "grey",
    MemberState.IMAGE: "blue",
    MemberState.LOADING: "blue",
    MemberState.RAY: "blue",
    MemberState.JOINED: "green",
    MemberState.FAILED: "red",
    MemberState.DOWN: "red",
    MemberState.REJOINING: "amber",
    MemberState.STOPPED: "grey",
}


class Role(models.TextChoices):
    HEAD = "head", "Head"
    WORKER = "worker", "Worker"


class CheckTrigger(models.TextChoices):
    SCHEDULE = "schedule", "Scheduled"
    RECONNECT = "reconnect", "A machine reconnected"
    OFFLINE = "offline", "A machine went offline"
    MANUAL = "manual", "Check now"
    SECOND_LOOK = "second_look", "Second look"
    STARTED = "started", "After a start"  # fills the raw status and each machine's panel at once


class CheckOutcome(models.TextChoices):
    RUNNING = "running", "Looking"
    HEALTHY = "healthy", "All well"
    LOOK_AGAIN = "look_again", "Looking again"
    REPAIR = "repair", "Repairing"
    WAITING = "waiting", "Waiting for a machine"
    UNANSWERED = "unanswered", "Nobody answered"
    SKIPPED = "skipped", "Skipped"


CHECK_BADGE = {
    CheckOutcome.RUNNING: "blue",
    CheckOutcome.HEALTHY: "green",
    CheckOutcome.LOOK_AGAIN: "amber",
    CheckOutcome.REPAIR: "amber",
    CheckOutcome.WAITING: "amber",
    CheckOutcome.UNANSWERED: "grey",
    CheckOutcome.SKIPPED: "grey",
}

"""The lifecycles of a cluster and of each machine in it, and how each state looks."""
from django.db import models


class ClusterState(models.TextChoices):
    STARTING = "starting", "Starting"  # images travel, runtimes start, Ray starts and the others join
    WAITING = "waiting", "Waiting"  # a start failed in a way a retry cannot change, or needs a person: Try again
    RETRYING = "retrying", "Retrying"  # a start failed; tried again after a growing pause
    RUNNING = "running", "Running"  # Ray's own node list holds every machine that joined
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"  # three restarts failed; tried again every 15 minutes


CLUSTER_TRANSITIONS: dict[str, frozenset[str]] = {
    ClusterState.STARTING: frozenset({ClusterState.RUNNING, ClusterState.WAITING, ClusterState.RETRYING, ClusterState.FAILED}),
    ClusterState.WAITING: frozenset({ClusterState.STARTING}),
    ClusterState.RETRYING: frozenset({ClusterState.STARTING, ClusterState.WAITING}),
    ClusterState.RUNNING: frozenset({ClusterState.STARTING, ClusterState.STOPPED, ClusterState.FAILED}),
    ClusterState.STOPPED: frozenset({ClusterState.STARTING}),
    ClusterState.FAILED: frozenset({ClusterState.STARTING}),
}

CLUSTER_ACTIVE = frozenset({ClusterState.STARTING, ClusterState.RETRYING})

CLUSTER_BADGE = {
    ClusterState.STARTING: "blue",
    ClusterState.WAITING: "amber",
    ClusterState.RETRYING: "amber",
    ClusterState.RUNNING: "green",
    ClusterState.STOPPED: "grey",
    ClusterState.FAILED: "red",
}


class MemberState(models.TextChoices):
    PENDING = "pending", "Waiting to start"
    IMAGE = "image", "Getting the runtime image"
    LOADING = "loading", "Loading the image"
    RAY = "ray", "Starting Ray"
    JOINED = "joined", "Up"  # in Ray's node list with its accelerators
    FAILED = "failed", "Did not join"  # the reason is on the member


MEMBER_BADGE = {
    MemberState.PENDING: "grey",
    MemberState.IMAGE: "blue",
    MemberState.LOADING: "blue",
    MemberState.RAY: "blue",
    MemberState.JOINED: "green",
    MemberState.FAILED: "red",
}


class Role(models.TextChoices):
    HEAD = "head", "Head"
    WORKER = "worker", "Worker"

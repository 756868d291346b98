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
    # Some machines did not confirm a stop or a delete: a person checks them, then stops or deletes again.
    UNCONFIRMED = "unconfirmed", "Stop not confirmed"


_S = ClusterState
CLUSTER_TRANSITIONS: dict[str, frozenset[str]] = {
    _S.STARTING: frozenset({_S.RUNNING, _S.WAITING, _S.RETRYING, _S.FAILED, _S.STOPPING, _S.DELETING}),
    _S.WAITING: frozenset({_S.STARTING, _S.STOPPING, _S.DELETING}),
    _S.RETRYING: frozenset({_S.STARTING, _S.WAITING, _S.FAILED, _S.STOPPING, _S.DELETING}),
    _S.RUNNING: frozenset({_S.STARTING, _S.STOPPING, _S.FAILED, _S.DELETING}),
    _S.STOPPING: frozenset({_S.STOPPED, _S.UNCONFIRMED, _S.DELETING}),
    _S.STOPPED: frozenset({_S.STARTING, _S.DELETING}),
    _S.FAILED: frozenset({_S.STARTING, _S.STOPPING, _S.DELETING}),
    # A stop or a delete that the machines did not confirm waits for a person, who stops or deletes again.
    _S.DELETING: frozenset({_S.UNCONFIRMED}),
    _S.UNCONFIRMED: frozenset({_S.STOPPING, _S.DELETING}),
}

# What Stop, Start and Delete offer in each state (the page and the API refuse the rest).
CAN_STOP = frozenset({_S.STARTING, _S.WAITING, _S.RETRYING, _S.RUNNING, _S.FAILED, _S.UNCONFIRMED})
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
    ClusterState.UNCONFIRMED: "red",
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


_M = MemberState
_STARTING = frozenset({_M.PENDING, _M.IMAGE, _M.LOADING, _M.RAY})
# Every member state change goes through clusters.lifecycle.member_transition, checked against this.
# A start walks a machine forward through the starting states (a resumed job may skip some); a restart
# or a start over puts every machine back to Waiting to start; a stop ends anywhere.
MEMBER_TRANSITIONS: dict[str, frozenset[str]] = {
    _M.PENDING: _STARTING | {_M.JOINED, _M.FAILED, _M.DOWN, _M.STOPPED},
    _M.IMAGE: _STARTING | {_M.JOINED, _M.FAILED, _M.DOWN, _M.STOPPED},
    _M.LOADING: _STARTING | {_M.JOINED, _M.FAILED, _M.DOWN, _M.STOPPED},
    _M.RAY: _STARTING | {_M.JOINED, _M.FAILED, _M.DOWN, _M.STOPPED},
    # Up: a check finds it gone (Out of the cluster), a repair joins it again, a restart starts it over.
    _M.JOINED: frozenset({_M.PENDING, _M.FAILED, _M.DOWN, _M.REJOINING, _M.STOPPED}),
    # Did not join: a check may find it in Ray after all, or gone; a repair tries again.
    _M.FAILED: frozenset({_M.PENDING, _M.JOINED, _M.DOWN, _M.REJOINING, _M.STOPPED}),
    _M.DOWN: frozenset({_M.PENDING, _M.JOINED, _M.FAILED, _M.REJOINING, _M.STOPPED}),
    # A repair: out of Ray, its runtime started again, joined again (or not).
    _M.REJOINING: _STARTING | {_M.JOINED, _M.FAILED, _M.STOPPED},
    _M.STOPPED: frozenset({_M.PENDING, _M.FAILED}),
}


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
    HEARTBEAT = "heartbeat", "A heartbeat"  # a machine's heartbeat reported Ray or its runtime down (clusters/heartbeats.py)
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


class ModelSource(models.TextChoices):
    """Where a cluster's machines get a model's files (the cluster page's "Where the machines get models")."""

    SERVER = "server", "Server copies"  # the server downloads it; machines copy it from the server, then each other
    MACHINES = "machines", "Machines download models themselves"  # each machine from the hub, into its own store

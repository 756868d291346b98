"""The life of a model in the server's store, of a deployment's copies and of a drain, how each state looks; how the
gateway routes a deployment's requests."""
from django.db import models


class ModelState(models.TextChoices):
    DOWNLOADING = "downloading", "Downloading"  # its files come from the hub (or a directory) into the store
    READY = "ready", "Ready"  # every file is in the store and matched its digest
    FAILED = "failed", "Failed"  # the download stopped; Try again resumes it where it stopped


# A model's moves (deployments.store.downloads.model_transition is the one guard). A ready model stays ready
# until it is deleted: a new revision is a model of its own.
MODEL_TRANSITIONS: dict[str, frozenset[str]] = {
    ModelState.DOWNLOADING: frozenset({ModelState.READY, ModelState.FAILED}),
    ModelState.READY: frozenset(),
    ModelState.FAILED: frozenset({ModelState.DOWNLOADING}),  # Try again
}

MODEL_BADGE = {
    ModelState.DOWNLOADING: "blue",
    ModelState.READY: "green",
    ModelState.FAILED: "red",
}


class CopyState(models.TextChoices):
    """One copy of a deployment's model: an engine on the GPUs the placement gave it."""

    QUEUED = "queued", "Queued"  # waiting for room (the reason says what is missing) or for its turn
    COPYING = "copying", "Copying the model"  # the model's files travel to its machine(s)
    STARTING = "starting", "Starting"  # the engine loads the model (its last log lines show)
    SERVING = "serving", "Serving"  # the engine answers /health and lists the model
    FAILED = "failed", "Failed"  # the engine's own words; the health checks restart it or place it elsewhere
    STOPPING = "stopping", "Stopping"  # its engine is told to stop; its GPUs are free once it has
    STOPPED = "stopped", "Stopped"  # with its cluster: started again when the cluster starts


_C = CopyState
# Every change goes through deployments.serving.copies_transition (copy_transition for one copy).
COPY_TRANSITIONS: dict[str, frozenset[str]] = {
    _C.QUEUED: frozenset({_C.COPYING, _C.STARTING, _C.STOPPING, _C.STOPPED}),
    _C.COPYING: frozenset({_C.QUEUED, _C.STARTING, _C.FAILED, _C.STOPPING, _C.STOPPED}),
    # Starting and Serving go back to Queued when their cluster starts or restarts (serving.cluster_running):
    # the console cannot tell whether an engine outlived the restart (a restarted runtime or machine ends it,
    # a Ray restart does not), so each copy goes through its start again where it was; the agent's copy
    # start leaves an engine that still runs the same spec as it is, so a survivor only reads Serving again.
    _C.STARTING: frozenset({_C.QUEUED, _C.SERVING, _C.FAILED, _C.STOPPING, _C.STOPPED}),
    _C.SERVING: frozenset({_C.QUEUED, _C.STARTING, _C.FAILED, _C.STOPPING, _C.STOPPED}),
    # A failed copy is started again where it is, or queued to be placed elsewhere when its machine is gone.
    _C.FAILED: frozenset({_C.QUEUED, _C.COPYING, _C.STARTING, _C.STOPPING, _C.STOPPED}),
    # A stop that could not reach its machine: the engine still runs and answers (a deployment deleted while its
    # cluster could not be reached: its copies run without a deployment, deployments/orphans.py).
    _C.STOPPING: frozenset({_C.STOPPED, _C.FAILED, _C.SERVING}),
    _C.STOPPED: frozenset({_C.QUEUED, _C.STOPPING}),
}

# A copy in these states holds the GPUs, GPU memory and port its slots name (a failed one keeps them
# until it is restarted there or placed elsewhere); the others hold nothing.
HOLDS_ROOM = frozenset({_C.COPYING, _C.STARTING, _C.SERVING, _C.FAILED, _C.STOPPING})
# The gateway sends requests to these.
ROUTED = frozenset({_C.SERVING})

COPY_BADGE = {
    _C.QUEUED: "amber",
    _C.COPYING: "blue",
    _C.STARTING: "blue",
    _C.SERVING: "green",
    _C.FAILED: "red",
    _C.STOPPING: "blue",
    _C.STOPPED: "grey",
}


class DrainState(models.TextChoices):
    """A machine's drain (deployments/drain.py): its copies move to the cluster's other machines, or stop as
    the plan agreed to said, and it takes nothing new."""

    STARTING = "starting", "Starting the drain"  # Ray is told; the plan is checked again against what runs now
    MOVING = "moving", "Moving copies"  # each copy's replacement starts on its target before the copy stops
    DRAINED = "drained", "Drained"  # it runs nothing and takes nothing new: work on it
    LEAVING = "leaving", "Leaving the cluster"  # Remove from cluster: drained, it leaves Ray and the cluster
    STOPPING = "stopping", "Stopping the drain"  # Stop drain: it leaves Ray and joins again


_D = DrainState
DRAIN_TRANSITIONS: dict[str, frozenset[str]] = {
    _D.STARTING: frozenset({_D.MOVING, _D.DRAINED, _D.STOPPING}),
    _D.MOVING: frozenset({_D.DRAINED, _D.STOPPING}),
    _D.DRAINED: frozenset({_D.LEAVING, _D.STOPPING}),
    _D.LEAVING: frozenset(),  # the machine leaves the cluster, and the drain's record with it
    _D.STOPPING: frozenset(),  # the record goes once it is back in Ray
}

DRAIN_BADGE = {_D.STARTING: "blue", _D.MOVING: "blue", _D.DRAINED: "amber", _D.LEAVING: "blue", _D.STOPPING: "blue"}


class Routing(models.TextChoices):
    """How the gateway picks a deployment's copy for a request (docs/gateway.md, *Cache-aware routing*)."""

    LEAST_BUSY = "least-busy", "Least busy"  # the copy with the fewest requests in flight
    # The copy that served the prompt's longest prefix lately (its engine holds it in its KV cache), unless it is
    # busier than the least busy copy by more than FADEN_GATEWAY_PREFIX_BOUND requests in flight.
    CACHE_AWARE = "cache-aware", "Cache-aware"


ROUTING_HELP = {
    Routing.LEAST_BUSY: "Each request goes to the copy with the fewest requests in flight.",
    Routing.CACHE_AWARE: ("A request whose prompt starts like a recent one (the same system prompt, the same "
                          "conversation) goes to the copy that served it, which holds that prefix in its cache, "
                          "unless that copy is much busier than the others."),
}


ROUTING_REFUSAL = "Routing is least-busy or cache-aware, not '{input}'."  # the form's, the API's and the services' words


def routing_refusal(value) -> str | None:
    """Why ``value`` is not a routing, in words (None when it is one)."""
    if value in Routing.values:
        return None
    return ROUTING_REFUSAL.format(input=str(value)[:40])

"""States of a job: the one record every long operation writes."""
from enum import StrEnum

from django.db import models


class JobState(models.TextChoices):
    QUEUED = "queued", "Queued"  # written by a service, waiting for a worker
    RUNNING = "running", "Running"  # a worker holds it and beats
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"  # error holds the user's words
    CANCELLED = "cancelled", "Cancelled"  # the cancel flag was seen by the worker


JOB_ACTIVE = frozenset({JobState.QUEUED, JobState.RUNNING})
JOB_TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

JOB_BADGE = {
    JobState.QUEUED: "grey",
    JobState.RUNNING: "blue",
    JobState.SUCCEEDED: "green",
    JobState.FAILED: "red",
    JobState.CANCELLED: "grey",
}


class ErrorKind(StrEnum):
    """What a failure says about trying again: a job's ``error_kind``, and the ``kind`` of a ``JobError``, of
    a failure talking to a machine (``machines.remote.RemoteError``) and of the hub's. The agent's ``error``
    events use the same words (its ``protocol.ERROR_KINDS``; tests/unit/test_agent_client.py holds them
    equal), so the kind an agent reports becomes the job's as it is."""

    RETRYABLE = "retryable"  # try again later: the same call may succeed
    NOT_RETRYABLE = "not_retryable"  # the same cause comes out of every retry: a person must act
    ADDRESS_IN_USE = "address_in_use"  # a port the command needs is taken
    NO_ROOM = "no_room"  # the machine's store has no room for the file
    UNREACHABLE = "unreachable"  # the machine, or the one it fetches from, does not answer
    BAD_INPUT = "bad_input"  # the server sent something the agent refuses: a bug on our side


class StepState(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"
    SKIPPED = "skipped", "Skipped"


class AuditOutcome(models.TextChoices):
    DONE = "done", "Done"
    SHOWN = "shown", "Shown again"  # a page answered with its form again (its errors, or a step to confirm)
    REFUSED = "refused", "Refused"  # not allowed, not valid, not signed in, locked out
    FAILED = "failed", "Failed"  # the console broke (a 5xx)


AUDIT_BADGE = {AuditOutcome.DONE: "green", AuditOutcome.SHOWN: "grey", AuditOutcome.REFUSED: "amber", AuditOutcome.FAILED: "red"}

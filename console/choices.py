"""States of a job: the one record every long operation writes."""
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

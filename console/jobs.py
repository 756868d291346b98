"""Run a job row: record start, steps, log, error and end; push its card as it goes.

A service creates the row (``job_create``) and enqueues a task on commit; the
task calls ``job_run`` with a function that does the work through a
``JobContext``. Errors the administrator should read are ``JobError``s; any
other exception fails the job with its text and is logged with its traceback.
"""
from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from console.choices import JobState, StepState
from console.models import Job

log = logging.getLogger(__name__)

LOG_LIMIT = 64 * 1024  # characters kept in a job's log; older lines are dropped


class JobError(Exception):
    """A failure with a message for the administrator and a kind that decides retries."""

    def __init__(self, message: str, *, kind: str = "retryable"):
        super().__init__(message)
        self.message = message
        self.kind = kind


class JobCancelled(Exception):
    pass


def job_create(
    *, kind: str, title: str, target_type: str, target_id: int, steps: Sequence[str], user=None, params: dict | None = None
) -> Job:
    """Write a queued job with its steps named up front, so the page can show them all."""
    return Job.objects.create(
        kind=kind,
        params=params or {},
        title=title,
        target_type=target_type,
        target_id=target_id,
        steps=[{"name": name, "state": StepState.PENDING, "detail": ""} for name in steps],
        created_by=user if user and user.is_authenticated else None,
    )


class JobContext:
    """What a job's function uses to report: steps, log lines, and the cancel flag."""

    def __init__(self, job: Job, on_change: Callable[[Job], None]):
        self.job = job
        self._on_change = on_change
        self._current: int | None = None

    def _save(self, *fields: str) -> None:
        self.job.beat_at = timezone.now()
        self.job.save(update_fields=[*fields, "beat_at"])
        self._on_change(self.job)

    def step(self, name: str, detail: str = "") -> None:
        """Finish the running step and start the named one."""
        self._finish_current(StepState.DONE)
        for index, step in enumerate(self.job.steps):
            if step["name"] == name:
                break
        else:
            self.job.steps.append({"name": name, "state": StepState.PENDING, "detail": ""})
            index = len(self.job.steps) - 1
        self.job.steps[index].update(state=StepState.RUNNING, detail=detail)
        self._current = index
        self.check_cancel()
        self._save("steps")

    def detail(self, detail: str) -> None:
        if self._current is not None:
            self.job.steps[self._current]["detail"] = detail
            self._save("steps")

    def skip(self, name: str, detail: str = "") -> None:
        for step in self.job.steps:
            if step["name"] == name:
                step.update(state=StepState.SKIPPED, detail=detail)
        self._save("steps")

    def log(self, line: str) -> None:
        stamp = timezone.now().strftime("%H:%M:%S")
        text = self.job.log + f"{stamp} {line.rstrip()}\n"
        self.job.log = text[-LOG_LIMIT:]
        self._save("log")

    def check_cancel(self) -> None:
        if Job.objects.filter(pk=self.job.pk, cancel_requested=True).exists():
            raise JobCancelled()

    def _finish_current(self, state: str) -> None:
        if self._current is not None:
            self.job.steps[self._current]["state"] = state
            self._current = None


def job_run(job_id: int, work: Callable[[JobContext], None], *, on_change: Callable[[Job], None]) -> Job:
    """Run ``work`` for the job once; a finished job is left as it is (tasks may be delivered twice)."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.state not in (JobState.QUEUED, JobState.RUNNING):
            return job
        job.state = JobState.RUNNING
        job.started_at = job.started_at or timezone.now()
        job.beat_at = timezone.now()
        job.worker = socket.gethostname()
        job.save(update_fields=["state", "started_at", "beat_at", "worker"])
    ctx = JobContext(job, on_change)
    on_change(job)
    started = time.monotonic()
    try:
        work(ctx)
    except JobCancelled:
        _job_end(ctx, JobState.CANCELLED, StepState.FAILED, error="Cancelled.")
    except JobError as exc:
        _job_end(ctx, JobState.FAILED, StepState.FAILED, error=exc.message, error_kind=exc.kind)
    except Exception as exc:  # noqa: BLE001 - the job must end, whatever broke
        log.exception("job %s (%s) failed", job.pk, job.kind)
        _job_end(ctx, JobState.FAILED, StepState.FAILED, error=f"Unexpected error: {exc}", error_kind="retryable")
    else:
        _job_end(ctx, JobState.SUCCEEDED, StepState.DONE)
    log.info("job %s (%s) %s in %.1fs", job.pk, job.kind, ctx.job.state, time.monotonic() - started)
    return ctx.job


def _job_end(ctx: JobContext, state: str, step_state: str, *, error: str = "", error_kind: str = "") -> None:
    ctx._finish_current(step_state)
    job = ctx.job
    job.state = state
    job.error = error
    job.error_kind = error_kind
    job.finished_at = timezone.now()
    # Never overwrite an end state written by someone else (the reaper, say).
    updated = Job.objects.filter(pk=job.pk, state=JobState.RUNNING).update(
        state=state, error=error, error_kind=error_kind, finished_at=job.finished_at, steps=job.steps, log=job.log
    )
    if updated:
        ctx._on_change(job)
    else:
        job.refresh_from_db()  # someone else (the reaper) ended it first: report what the database says


def jobs_reap(*, stale_after: timedelta = timedelta(minutes=5)) -> int:
    """Fail running jobs whose worker has not beaten for a while: no job stays running without one."""
    cutoff = timezone.now() - stale_after
    return Job.objects.filter(state=JobState.RUNNING, beat_at__lt=cutoff).update(
        state=JobState.FAILED,
        error="The worker running this job stopped before it finished. Run it again.",
        error_kind="retryable",
        finished_at=timezone.now(),
    )

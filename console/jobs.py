"""Run a job row: record start, steps, log, error and end; push its card as it goes.

A service creates the row (``job_create``) and enqueues a task on commit; the
task calls ``job_run`` with a function that does the work through a
``JobContext``. Errors the administrator should read are ``JobError``s; any
other exception fails the job with its text and is logged with its traceback.

While the work runs, a thread beats the row every ``FADEN_JOB_BEAT`` seconds.
A running job whose beat is older than ``FADEN_JOB_STALE`` lost its worker:
the reaper hands a resumable kind (``job_kind_register``) to a worker again,
where the steps already done are skipped (``JobContext.done``), and fails any
other kind with a reason, telling the kind (``on_failed``). A job still queued
after as long is sent to a worker again. No job stays running, or queued,
without a live worker.

Each app names its jobs' steps once, as ``Step`` objects grouped in an
``Operation`` (a kind and its steps): the service starts the job with the
operation's step names, the runner begins each step through its object.
"""
from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.module_loading import import_string

from console.choices import JOB_TERMINAL, ErrorKind, JobState, StepState
from console.models import Job
from console.pruning import delete_in_batches
from console.ticker import Ticker

log = logging.getLogger(__name__)

LOG_LIMIT = 64 * 1024  # characters kept in a job's log; older lines are dropped
MAX_RESUMES = 3  # a job handed to a new worker more often than this fails instead


@dataclass(frozen=True)
class JobKind:
    """Which task runs a kind of job, and how the reaper treats it when its worker died."""

    task: str  # dotted path of the Celery task that runs it (takes the job's id)
    resumable: bool  # its steps are idempotent: a new worker takes it up where it stopped
    on_failed: Callable[[Job], None] | None = None  # told when the reaper fails it (resumable or not)


_KINDS: dict[str, JobKind] = {}


def job_kind_register(kind: str, *, task: str, resumable: bool = False, on_failed: Callable[[Job], None] | None = None) -> None:
    """Name the task that runs ``kind``. A resumable kind's steps are idempotent and ``JobContext.done``
    skips finished ones, so the reaper hands it to a new worker instead of failing it. ``on_failed(job)``
    runs when the reaper fails a job of the kind (a kind that cannot resume at once, a resumable one after
    ``MAX_RESUMES``): a kind that keeps a row of its own in a state ends it there."""
    _KINDS[kind] = JobKind(task=task, resumable=resumable, on_failed=on_failed)


def task_enqueue(task: str, *args, countdown: float | None = None) -> None:
    """Send the Celery task named by its dotted path once the transaction commits.

    Named, not imported: a service never imports its app's tasks module (which imports the
    service), so no module needs a function-level import to dodge a circle.
    """
    def send() -> None:
        found = import_string(task)
        if countdown:
            found.apply_async(args, countdown=countdown)
        else:
            found.delay(*args)

    transaction.on_commit(send)


def job_start(
    *, kind: str, title: str, target_type: str, target_id: int, steps: Sequence[str], user=None, params: dict | None = None
) -> Job:
    """Write a queued job (``job_create``) and send it to its kind's task once the transaction commits."""
    job = job_create(kind=kind, title=title, target_type=target_type, target_id=target_id, steps=steps, user=user, params=params)
    task_enqueue(_KINDS[kind].task, job.pk)
    return job


class JobError(Exception):
    """A failure with a message for the administrator and a kind that decides retries."""

    def __init__(self, message: str, *, kind: str = ErrorKind.RETRYABLE):
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
        self._finishers: list[Callable[[], None]] = []

    def on_success(self, finish: Callable[[], None]) -> None:
        """Run ``finish`` in the transaction that marks the job succeeded: what it writes (a cluster
        reading Running, say) is seen together with the job's end, never while the job still runs."""
        self._finishers.append(finish)

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
        self.job.steps[index].update(state=StepState.RUNNING, detail=detail, started_at=timezone.now().isoformat())
        self.job.steps[index].pop("seconds", None)  # run again (a resumed job): its time is this run's
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

    def done(self, name: str) -> bool:
        """Whether the named step finished in an earlier run of this job (a resumed job skips it)."""
        return any(step["name"] == name and step["state"] == StepState.DONE for step in self.job.steps)

    def check_cancel(self) -> None:
        if Job.objects.filter(pk=self.job.pk, cancel_requested=True).exists():
            raise JobCancelled()

    def _finish_current(self, state: str) -> None:
        """End the running step in ``state`` with how long it ran (the card shows it beside the step)."""
        if self._current is not None:
            step = self.job.steps[self._current]
            step["state"] = state
            if started := step.get("started_at"):
                step["seconds"] = round((timezone.now() - datetime.fromisoformat(started)).total_seconds(), 1)
            self._current = None


@dataclass(frozen=True)
class Step:
    """One step of a job, named once: the service lists it up front (the job's card shows every step before
    they run) and the runner begins it through the same object, so a step cannot be renamed on one side only."""

    name: str  # what the job's card shows

    def begin(self, ctx: JobContext, detail: str = "") -> bool:
        """Start the step on the job's card; False when an earlier run of this job finished it (skip it)."""
        if ctx.done(self.name):
            return False
        ctx.step(self.name, detail)
        return True

    def always(self, ctx: JobContext, detail: str = "") -> None:
        """Start a step that runs again on every run of the job (a look at Ray, say)."""
        ctx.step(self.name, detail)


@dataclass(frozen=True)
class Operation:
    """A kind of job and its steps in order: what ``job_start`` writes up front (``step_names``)."""

    kind: str  # the job's kind: job_kind_register and the reaper know it by this
    steps: tuple[Step, ...]

    @property
    def step_names(self) -> list[str]:
        return [step.name for step in self.steps]


def _stale_before():
    return timezone.now() - timedelta(seconds=settings.FADEN_JOB_STALE)


class _Beat(Ticker):
    """Beats the job's row while the work runs."""

    def __init__(self, job_id: int, resumes: int):
        super().__init__(f"job-beat-{job_id}")
        self._job_id, self._resumes = job_id, resumes

    def every(self) -> float:
        return settings.FADEN_JOB_BEAT

    def tick(self) -> None:
        # Only this run's beat: a run the reaper handed to another worker is not ours any more.
        Job.objects.filter(pk=self._job_id, state=JobState.RUNNING, resumes=self._resumes).update(beat_at=timezone.now())


def job_run(job_id: int, work: Callable[[JobContext], None], *, on_change: Callable[[Job], None]) -> Job:
    """Run ``work`` for the job once. A finished job, or one another live worker runs, is left as
    it is (tasks may be delivered twice); a running job whose worker stopped beating is taken over."""
    with transaction.atomic():
        job = Job.objects.select_for_update(no_key=True).get(pk=job_id)
        if job.state not in (JobState.QUEUED, JobState.RUNNING):
            return job
        if job.state == JobState.RUNNING and job.beat_at and job.beat_at >= _stale_before():
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
        with _Beat(job.pk, job.resumes):
            work(ctx)
    except JobCancelled:
        _job_end(ctx, JobState.CANCELLED, StepState.FAILED, error="Cancelled.")
    except JobError as exc:
        _job_end(ctx, JobState.FAILED, StepState.FAILED, error=exc.message, error_kind=exc.kind)
    except Exception as exc:  # noqa: BLE001 - the job must end, whatever broke
        log.exception("job %s (%s) failed", job.pk, job.kind)
        _job_end(ctx, JobState.FAILED, StepState.FAILED, error=f"Unexpected error: {exc}", error_kind=ErrorKind.RETRYABLE)
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
    try:
        with transaction.atomic():
            # Never overwrite an end state written by someone else (the reaper, say).
            updated = Job.objects.filter(pk=job.pk, state=JobState.RUNNING, resumes=job.resumes).update(
                state=state, error=error, error_kind=error_kind, finished_at=job.finished_at, steps=job.steps, log=job.log
            )
            if updated and state == JobState.SUCCEEDED:
                for finish in ctx._finishers:
                    finish()
    except Exception as exc:  # noqa: BLE001 - a finisher that breaks fails the job instead of leaving it running
        if state != JobState.SUCCEEDED:
            raise
        log.exception("job %s (%s): finishing failed", job.pk, job.kind)
        message, kind = (exc.message, exc.kind) if isinstance(exc, JobError) else (f"Unexpected error: {exc}", ErrorKind.RETRYABLE)
        _job_end(ctx, JobState.FAILED, StepState.FAILED, error=message, error_kind=kind)
        return
    if updated:
        ctx._on_change(job)
    else:
        job.refresh_from_db()  # someone else (the reaper) ended it first: report what the database says


STOPPED_WORKER = "The worker running this job stopped before it finished."


def jobs_reap(*, stale_after: timedelta | None = None) -> int:
    """Hand running jobs whose worker stopped beating to a worker again (resumable kinds, up to
    ``MAX_RESUMES`` times), and fail the others with a reason, telling their kind; send again the task of a
    job queued too long (its message may have gone with a killed worker). Returns how many it touched."""
    cutoff = timezone.now() - (stale_after if stale_after is not None else timedelta(seconds=settings.FADEN_JOB_STALE))
    touched = _queued_sent_again(cutoff)
    for job_id in Job.objects.filter(state=JobState.RUNNING, beat_at__lt=cutoff).values_list("pk", flat=True):
        with transaction.atomic():
            job = Job.objects.select_for_update(no_key=True).filter(pk=job_id, state=JobState.RUNNING, beat_at__lt=cutoff).first()
            if job is None:
                continue  # it beat, or ended, meanwhile
            kind = _KINDS.get(job.kind)
            resumable = kind is not None and kind.resumable
            now = timezone.now()
            stamp = now.strftime("%H:%M:%S")
            if resumable and job.resumes < MAX_RESUMES:
                job.state, job.resumes, job.beat_at = JobState.QUEUED, job.resumes + 1, now
                job.log = (job.log + f"{stamp} {STOPPED_WORKER} Taken up again where it stopped "
                                     f"(resume {job.resumes} of {MAX_RESUMES}).\n")[-LOG_LIMIT:]
                job.save(update_fields=["state", "resumes", "beat_at", "log"])
                task = import_string(kind.task)
                transaction.on_commit(lambda task=task, pk=job.pk: task.delay(pk))
            else:
                job.state, job.finished_at, job.error_kind = JobState.FAILED, now, ErrorKind.RETRYABLE
                job.error = f"{STOPPED_WORKER} Run it again." if not resumable else \
                    f"{STOPPED_WORKER} It was taken up again {job.resumes} times; giving up."
                for step in job.steps:
                    if step["state"] == StepState.RUNNING:
                        step["state"] = StepState.FAILED
                job.save(update_fields=["state", "finished_at", "error", "error_kind", "steps"])
                if kind is not None and kind.on_failed is not None:
                    _tell_failed(kind, job)
            touched += 1
    return touched


def _queued_sent_again(cutoff: datetime) -> int:
    """Send again the task of each job still queued since ``cutoff`` (its creation, or its last sending):
    a worker killed after taking its message and before the job began leaves it queued, and the broker
    gives an unacknowledged message out again only after its visibility timeout (an hour). A second
    message is harmless: ``job_run`` takes the row under its lock, and a message that finds the job running
    with a fresh beat, or ended, does nothing. The job's beat marks the sending, so a job waiting behind busy
    workers is sent again once per stale period, not at every tick."""
    now, sent = timezone.now(), 0
    waiting = Job.objects.filter(state=JobState.QUEUED).filter(
        Q(beat_at__lt=cutoff) | Q(beat_at__isnull=True, created_at__lt=cutoff))
    for job_id, kind_name in waiting.values_list("pk", "kind"):
        kind = _KINDS.get(kind_name)
        if kind is None:
            continue
        if Job.objects.filter(pk=job_id, state=JobState.QUEUED).update(beat_at=now):
            task_enqueue(kind.task, job_id)
            sent += 1
    return sent


def _tell_failed(kind: JobKind, job: Job) -> None:
    """Tell the kind its job failed for good (every kind, resumable or not: the rows it keeps in a state,
    an NCCL test reading Running say, end with it). One that breaks is logged and leaves the job failed, so
    the reaper neither stops at it nor meets it again."""
    try:
        with transaction.atomic():
            kind.on_failed(job)
    except Exception:  # noqa: BLE001 - the job's end stands whatever its kind's callback does
        log.exception("job %s (%s): on_failed broke", job.pk, job.kind)


def jobs_prune(older_than: datetime) -> int:
    """Delete the jobs that finished before ``older_than``; a queued or running job stays whatever its age."""
    # A job finished before the cut was created before it too: created_at is indexed, finished_at is not.
    return delete_in_batches(Job.objects.filter(state__in=JOB_TERMINAL, created_at__lt=older_than, finished_at__lt=older_than))

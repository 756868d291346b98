"""Jobs survive their worker: the beat while work runs, the reaper handing a resumable kind to a new
worker (up to MAX_RESUMES times), job_run taking over a job whose worker went silent, and a resumed
job skipping the steps it already finished."""
import threading
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from clusters import steps, tasks
from clusters.choices import ClusterState
from clusters.models import Cluster
from console import jobs
from console.choices import JobState, StepState
from console.jobs import MAX_RESUMES, STOPPED_WORKER, job_create, job_kind_register, job_run, jobs_reap
from console.models import Job
from tests.factories import JobFactory

KIND = "test.resumable"
STEPS = ["Connect", "Copy", "Check"]


class RecordingTask:
    """Stands for a Celery task: records the job ids it was enqueued with."""

    def __init__(self):
        self.enqueued: list[int] = []

    def delay(self, job_id: int) -> None:
        self.enqueued.append(job_id)


resumed_task = RecordingTask()  # the reaper finds it by its dotted path, as it finds a real task


@pytest.fixture
def resumable():
    """A kind registered as resumable for the test only; what the reaper told it when it gave up."""
    assert KIND not in jobs._KINDS
    given_up: list[Job] = []
    resumed_task.enqueued.clear()
    job_kind_register(KIND, task=f"{__name__}.resumed_task", resumable=True, on_failed=given_up.append)
    yield given_up
    jobs._KINDS.pop(KIND, None)
    resumed_task.enqueued.clear()


def stale_running(*, kind=KIND, resumes=0, minutes=10, steps=None, **fields) -> Job:
    """A running job whose worker went silent ``minutes`` ago, its first step done and its second under way."""
    steps = steps or [{"name": "Connect", "state": StepState.DONE, "detail": ""},
                      {"name": "Copy", "state": StepState.RUNNING, "detail": "40 %"},
                      {"name": "Check", "state": StepState.PENDING, "detail": ""}]
    return JobFactory(kind=kind, state=JobState.RUNNING, resumes=resumes, steps=steps,
                      started_at=timezone.now() - timedelta(minutes=minutes + 1),
                      beat_at=timezone.now() - timedelta(minutes=minutes), worker="dead-worker", **fields)


def noop_change(job):
    return None


# -- the reaper --------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_stale_job_of_a_resumable_kind_is_queued_again_and_its_task_enqueued_on_commit(
        resumable, django_capture_on_commit_callbacks):
    job = stale_running()

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        assert jobs_reap() == 1
        assert resumed_task.enqueued == []  # not before the commit
    for callback in callbacks:
        callback()

    job.refresh_from_db()
    assert (job.state, job.resumes) == (JobState.QUEUED, 1)
    assert job.finished_at is None and job.error == ""
    assert job.beat_at > timezone.now() - timedelta(seconds=30)
    assert f"{STOPPED_WORKER} Taken up again where it stopped (resume 1 of {MAX_RESUMES})." in job.log
    assert resumed_task.enqueued == [job.pk]
    assert resumable == []


@pytest.mark.django_db
def test_each_resume_counts_up_and_keeps_the_steps_already_done(resumable, django_capture_on_commit_callbacks):
    job = stale_running(resumes=MAX_RESUMES - 1)

    with django_capture_on_commit_callbacks(execute=True):
        jobs_reap()

    job.refresh_from_db()
    assert (job.state, job.resumes) == (JobState.QUEUED, MAX_RESUMES)
    assert job.steps[0]["state"] == StepState.DONE
    assert resumed_task.enqueued == [job.pk]


@pytest.mark.django_db
def test_after_max_resumes_the_job_fails_with_a_reason_and_its_kind_is_told(resumable, django_capture_on_commit_callbacks):
    job = stale_running(resumes=MAX_RESUMES)

    with django_capture_on_commit_callbacks(execute=True):
        assert jobs_reap() == 1

    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.error == f"{STOPPED_WORKER} It was taken up again {MAX_RESUMES} times; giving up."
    assert job.error_kind == "retryable" and job.finished_at is not None
    assert [s["state"] for s in job.steps] == [StepState.DONE, StepState.FAILED, StepState.PENDING]
    assert job.resumes == MAX_RESUMES
    assert resumed_task.enqueued == []
    assert [(j.pk, j.state, j.error) for j in resumable] == [(job.pk, JobState.FAILED, job.error)]


@pytest.mark.django_db
def test_a_stale_job_of_a_kind_nobody_registered_fails_and_is_not_queued_again(resumable, django_capture_on_commit_callbacks):
    job = stale_running(kind="test.not-resumable")

    with django_capture_on_commit_callbacks(execute=True):
        assert jobs_reap() == 1

    job.refresh_from_db()
    assert (job.state, job.resumes) == (JobState.FAILED, 0)
    assert job.error == f"{STOPPED_WORKER} Run it again."
    assert resumed_task.enqueued == [] and resumable == []


@pytest.fixture
def not_resumable():
    """A kind that cannot resume, with an on_failed, registered for the test only; what it was told."""
    told: list[Job] = []
    job_kind_register("test.once", task=f"{__name__}.resumed_task", on_failed=told.append)
    yield told
    jobs._KINDS.pop("test.once", None)


@pytest.mark.django_db
def test_a_stale_job_of_a_kind_that_cannot_resume_fails_at_once_and_its_kind_is_told(not_resumable, django_capture_on_commit_callbacks):
    job = stale_running(kind="test.once")

    with django_capture_on_commit_callbacks(execute=True):
        assert jobs_reap() == 1

    job.refresh_from_db()
    assert (job.state, job.resumes, job.error) == (JobState.FAILED, 0, f"{STOPPED_WORKER} Run it again.")
    assert [(j.pk, j.state) for j in not_resumable] == [(job.pk, JobState.FAILED)]
    assert resumed_task.enqueued == []


@pytest.mark.django_db
def test_a_kind_whose_on_failed_breaks_leaves_its_job_failed_and_the_reaper_goes_on(django_capture_on_commit_callbacks):
    def broken(job):
        Job.objects.filter(pk=job.pk).update(title="written by the broken callback")
        raise RuntimeError("the row it keeps is gone")

    job_kind_register("test.broken", task=f"{__name__}.resumed_task", on_failed=broken)
    try:
        first, second = stale_running(kind="test.broken"), stale_running(kind="test.broken")
        with django_capture_on_commit_callbacks(execute=True):
            assert jobs_reap() == 2
    finally:
        jobs._KINDS.pop("test.broken", None)

    for job in (first, second):
        job.refresh_from_db()
        assert job.state == JobState.FAILED
        assert job.title != "written by the broken callback"  # what it wrote before it broke is undone


@pytest.mark.django_db
def test_every_kind_that_keeps_a_row_in_a_state_while_its_job_runs_ends_it_when_the_reaper_fails_the_job():
    """The NCCL test reads Running, an enrolling machine Enrolling, an apply's copies Copying the model or
    Starting, a download's model Downloading: each kind is told when the reaper fails its job."""
    from deployments import serving
    from deployments.store import downloads
    import machines.steps

    for kind in (steps.NCCL_TEST.kind, machines.steps.ENROL.kind, serving.KIND, downloads.KIND):
        assert jobs._KINDS[kind].on_failed is not None, kind


@pytest.mark.django_db
def test_the_reaper_leaves_a_resumable_job_with_a_recent_beat_alone_and_only_sends_a_requeued_one_again(
        resumable, django_capture_on_commit_callbacks):
    fresh = stale_running(minutes=0)
    requeued = JobFactory(kind=KIND, state=JobState.QUEUED, resumes=1, beat_at=timezone.now() - timedelta(hours=1))

    with django_capture_on_commit_callbacks(execute=True):
        assert jobs_reap() == 1

    assert [Job.objects.get(pk=j.pk).state for j in (fresh, requeued)] == [JobState.RUNNING, JobState.QUEUED]
    assert Job.objects.get(pk=requeued.pk).resumes == 1  # not a resume: its message is sent again
    assert resumed_task.enqueued == [requeued.pk]


@pytest.mark.django_db
def test_every_cluster_operation_is_resumable_by_the_cluster_job_task():
    for kind in (steps.START.kind, steps.ADD.kind, steps.REJOIN.kind, steps.STOP.kind, steps.DELETE.kind):
        assert jobs._KINDS[kind].task == "clusters.tasks.cluster_job"
        assert jobs._KINDS[kind].on_failed is not None


@pytest.mark.django_db
def test_a_stale_cluster_start_goes_back_to_the_cluster_job_task(monkeypatch, django_capture_on_commit_callbacks):
    enqueued = []
    monkeypatch.setattr(tasks.cluster_job, "delay", enqueued.append)
    cluster = Cluster.objects.create(name="gpu-room", state=ClusterState.STARTING)
    job = stale_running(kind=steps.START.kind, target_type="cluster", target_id=cluster.pk)

    with django_capture_on_commit_callbacks(execute=True):
        jobs_reap()

    assert Job.objects.get(pk=job.pk).state == JobState.QUEUED
    assert enqueued == [job.pk]


@pytest.mark.django_db
def test_a_cluster_start_given_up_on_goes_the_way_a_failed_start_goes(monkeypatch, django_capture_on_commit_callbacks):
    monkeypatch.setattr("console.live.push", lambda *args, **kwargs: None)
    cluster = Cluster.objects.create(name="gpu-room", state=ClusterState.STARTING, start_attempts=1)
    stale_running(kind=steps.START.kind, target_type="cluster", target_id=cluster.pk, resumes=MAX_RESUMES)

    with django_capture_on_commit_callbacks(execute=True):
        jobs_reap()

    cluster.refresh_from_db()
    assert cluster.state == ClusterState.RETRYING
    assert cluster.state_reason.startswith(STOPPED_WORKER)
    assert cluster.next_retry_at is not None


# -- job_run taking over -------------------------------------------------------------------------------


@pytest.mark.django_db
def test_job_run_takes_over_a_running_job_whose_worker_stopped_beating(settings):
    settings.FADEN_JOB_STALE = 45
    job = stale_running(kind=KIND, minutes=1)
    ran = []

    result = job_run(job.pk, lambda ctx: ran.append(ctx.job.pk), on_change=noop_change)

    assert ran == [job.pk]
    assert result.state == JobState.SUCCEEDED
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert job.worker != "dead-worker"
    assert job.started_at < timezone.now() - timedelta(minutes=1)  # it started when the first worker took it


@pytest.mark.django_db
def test_job_run_leaves_a_running_job_with_a_fresh_beat_to_its_worker(settings):
    settings.FADEN_JOB_STALE = 45
    job = JobFactory(kind=KIND, state=JobState.RUNNING, beat_at=timezone.now() - timedelta(seconds=5), worker="live-worker")
    changes = []

    result = job_run(job.pk, lambda ctx: pytest.fail("a job another worker runs was run twice"), on_change=changes.append)

    assert result.state == JobState.RUNNING
    assert changes == []
    job.refresh_from_db()
    assert (job.state, job.worker, job.finished_at) == (JobState.RUNNING, "live-worker", None)


@pytest.mark.django_db
def test_a_resumed_job_skips_the_steps_it_finished_and_redoes_the_one_it_was_in(resumable, django_capture_on_commit_callbacks):
    job = stale_running()
    with django_capture_on_commit_callbacks(execute=True):
        jobs_reap()
    did = []

    def work(ctx):
        for name in STEPS:
            if ctx.done(name):
                continue
            ctx.step(name)
            did.append(name)

    result = job_run(job.pk, work, on_change=noop_change)

    assert did == ["Copy", "Check"]
    assert result.state == JobState.SUCCEEDED
    assert [s["state"] for s in Job.objects.get(pk=job.pk).steps] == [StepState.DONE] * 3


@pytest.mark.django_db
def test_done_names_only_steps_that_finished():
    job = job_create(kind=KIND, title="Copy", target_type="machine", target_id=1, steps=STEPS)
    job.steps[0]["state"], job.steps[1]["state"], job.steps[2]["state"] = StepState.DONE, StepState.FAILED, StepState.SKIPPED
    ctx = jobs.JobContext(job, noop_change)

    assert [ctx.done(name) for name in [*STEPS, "Never named"]] == [True, False, False, False]


# -- the beat -------------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_beat_thread_keeps_beating_the_row_while_the_work_runs(settings):
    """The beat thread writes through its own connection, so this test commits (transaction=True)."""
    settings.FADEN_JOB_BEAT = 0.05
    job = job_create(kind=KIND, title="Copy", target_type="machine", target_id=1, steps=STEPS)
    seen = []

    def work(ctx):
        first = Job.objects.get(pk=job.pk).beat_at
        seen.append(first)
        polled = threading.Event()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            beat = Job.objects.get(pk=job.pk).beat_at
            if beat > seen[-1]:
                seen.append(beat)
                if len(seen) == 3:  # two beats after the start, with no step reported in between
                    return
            polled.wait(0.01)
        pytest.fail(f"the beat did not move beat_at within 10 s: {seen}")

    result = job_run(job.pk, work, on_change=noop_change)

    assert result.state == JobState.SUCCEEDED, result.error
    assert seen[0] < seen[1] < seen[2]


@pytest.mark.django_db(transaction=True)
def test_the_beat_thread_is_gone_once_job_run_returns(settings):
    settings.FADEN_JOB_BEAT = 0.05
    job = job_create(kind=KIND, title="Copy", target_type="machine", target_id=1, steps=STEPS)

    result = job_run(job.pk, lambda ctx: None, on_change=noop_change)

    assert result.state == JobState.SUCCEEDED
    assert f"job-beat-{job.pk}" not in [t.name for t in threading.enumerate()]


# -- what each kind ends when the reaper fails its job -------------------------------------------------------


@pytest.mark.django_db
def test_a_machine_whose_enrolment_worker_died_reads_failed_with_why_instead_of_enrolling(monkeypatch, django_capture_on_commit_callbacks):
    import machines.steps
    from machines.choices import MachineState
    from tests.factories import MachineFactory

    monkeypatch.setattr("console.live.push", lambda *args, **kwargs: None)
    machine = MachineFactory(name="gpu-new", state=MachineState.ENROLLING)
    stale_running(kind=machines.steps.ENROL.kind, target_type="machine", target_id=machine.pk)

    with django_capture_on_commit_callbacks(execute=True):
        jobs_reap()

    machine.refresh_from_db()
    assert (machine.state, machine.state_reason) == (MachineState.FAILED, f"{STOPPED_WORKER} Run it again.")


@pytest.mark.django_db
def test_an_apply_given_up_on_puts_the_copies_it_claimed_or_started_back_in_the_queue(monkeypatch, django_capture_on_commit_callbacks):
    from deployments import serving
    from deployments.choices import CopyState
    from deployments.models import Copy
    from tests.builders import cluster_of, deployment_of, gpu_machine

    monkeypatch.setattr("console.live.push", lambda *args, **kwargs: None)
    deployment = deployment_of(cluster_of([gpu_machine("gpu-a", 11)]))
    for number, state in enumerate([CopyState.COPYING, CopyState.STARTING, CopyState.SERVING], start=1):
        Copy.objects.create(deployment=deployment, number=number, state=state, pid=4000 + number)
    stale_running(kind=serving.KIND, target_type="deployment", target_id=deployment.pk, resumes=MAX_RESUMES)

    with django_capture_on_commit_callbacks(execute=True):
        jobs_reap()

    assert list(deployment.copy_rows.values_list("state", "pid")) == [
        (CopyState.QUEUED, None), (CopyState.QUEUED, None), (CopyState.SERVING, 4003)]
    assert deployment.copy_rows.get(number=1).state_reason == "Waiting for its turn to start: the worker starting it stopped."


@pytest.mark.django_db
def test_a_job_still_queued_after_the_stale_period_is_sent_again_once_per_period_and_a_fresh_one_is_left(
        resumable, django_capture_on_commit_callbacks):
    """A worker killed after taking a job's message and before the job began leaves it queued (the broker
    hands the message out again only after an hour): the reaper sends it again, marking the sending."""
    lost = JobFactory(kind=KIND, state=JobState.QUEUED)
    Job.objects.filter(pk=lost.pk).update(created_at=timezone.now() - timedelta(minutes=5))
    fresh = JobFactory(kind=KIND, state=JobState.QUEUED)

    with django_capture_on_commit_callbacks(execute=True):
        assert jobs_reap() == 1
    assert resumed_task.enqueued == [lost.pk]
    lost.refresh_from_db()
    assert (lost.state, lost.resumes) == (JobState.QUEUED, 0) and lost.beat_at > timezone.now() - timedelta(seconds=30)

    with django_capture_on_commit_callbacks(execute=True):
        assert jobs_reap() == 0  # sent within the period: not again
    assert resumed_task.enqueued == [lost.pk] and fresh.pk not in resumed_task.enqueued


"""The job wrapper: start, steps, error, end, cancel, and the reaper."""
from datetime import timedelta

import pytest
from django.utils import timezone

from console.choices import JobState, StepState
from console.jobs import LOG_LIMIT, JobError, job_create, job_run, jobs_reap
from console.models import Job
from tests.factories import JobFactory

pytestmark = pytest.mark.django_db

STEPS = ["Connect", "Install the agent", "Read facts"]


@pytest.fixture
def job():
    return job_create(kind="machine.enrol", title="Enrol gpu-01", target_type="machine", target_id=1, steps=STEPS)


@pytest.fixture
def changes():
    """Every (job state, step states) the job was pushed in, as the pages would see it."""
    return []


def run(job, work, changes):
    return job_run(job.pk, work, on_change=lambda j: changes.append((j.state, [s["state"] for s in j.steps])))


def states_of_steps(job) -> list[str]:
    return [step["state"] for step in job.steps]


def test_job_create_names_every_step_up_front_as_pending(job):
    assert job.state == JobState.QUEUED
    assert [step["name"] for step in job.steps] == STEPS
    assert set(states_of_steps(job)) == {StepState.PENDING}


def test_job_run_marks_the_job_running_then_succeeded_with_every_step_done(job, changes):
    seen_while_running = []

    def work(ctx):
        for name in STEPS:
            ctx.step(name)
            seen_while_running.append(Job.objects.get(pk=job.pk).state)

    run(job, work, changes)

    job.refresh_from_db()
    assert seen_while_running == [JobState.RUNNING] * 3
    assert job.state == JobState.SUCCEEDED
    assert states_of_steps(job) == [StepState.DONE] * 3
    assert job.error == ""
    assert job.started_at <= job.finished_at
    assert job.worker
    assert changes[0][0] == JobState.RUNNING and changes[-1][0] == JobState.SUCCEEDED


def test_each_step_is_running_while_it_runs_and_done_once_the_next_starts(job, changes):
    def work(ctx):
        ctx.step("Connect")
        ctx.step("Install the agent", "0.1.0")

    run(job, work, changes)

    assert [StepState.RUNNING, StepState.PENDING, StepState.PENDING] in [steps for _, steps in changes]
    assert [StepState.DONE, StepState.RUNNING, StepState.PENDING] in [steps for _, steps in changes]


def test_a_job_error_fails_the_job_with_its_message_and_kind_and_the_running_step_failed(job, changes):
    def work(ctx):
        ctx.step("Connect")
        ctx.step("Install the agent")
        raise JobError("The machine has no python3; the agent needs Python 3.9 or newer.", kind="not_retryable")

    run(job, work, changes)

    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.error == "The machine has no python3; the agent needs Python 3.9 or newer."
    assert job.error_kind == "not_retryable"
    assert states_of_steps(job) == [StepState.DONE, StepState.FAILED, StepState.PENDING]
    assert job.finished_at is not None


def test_an_unexpected_exception_fails_the_job_as_an_unexpected_error(job, changes):
    def work(ctx):
        ctx.step("Connect")
        raise KeyError("facts")

    run(job, work, changes)

    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.error.startswith("Unexpected error")
    assert "facts" in job.error
    assert job.error_kind == "retryable"
    assert states_of_steps(job)[0] == StepState.FAILED


def test_a_cancel_request_cancels_the_job_at_its_next_step(job, changes):
    def work(ctx):
        ctx.step("Connect")
        Job.objects.filter(pk=job.pk).update(cancel_requested=True)  # the administrator, from another process
        ctx.step("Install the agent")
        pytest.fail("the job went on after it was cancelled")

    run(job, work, changes)

    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    assert job.error == "Cancelled."
    assert states_of_steps(job) == [StepState.DONE, StepState.FAILED, StepState.PENDING]


def test_a_job_cancelled_before_it_started_does_no_step(job, changes):
    Job.objects.filter(pk=job.pk).update(cancel_requested=True)
    done = []

    run(job, lambda ctx: (ctx.step("Connect"), done.append("Connect")), changes)

    assert done == []
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED


@pytest.mark.parametrize("state", [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED])
def test_a_finished_job_is_not_run_again(state, changes):
    finished = JobFactory(state=state, error="as it was")

    result = run(finished, lambda ctx: pytest.fail("a finished job ran again"), changes)

    assert result.state == state
    assert changes == []
    finished.refresh_from_db()
    assert finished.state == state and finished.error == "as it was"


def test_a_step_not_named_up_front_is_added_at_the_end(job, changes):
    run(job, lambda ctx: ctx.step("Restart the heartbeat"), changes)
    job.refresh_from_db()
    added = job.steps[-1]
    assert (added["name"], added["state"], added["detail"]) == ("Restart the heartbeat", StepState.DONE, "")
    assert added["seconds"] >= 0


def test_each_step_that_ended_says_how_long_it_ran_and_one_run_again_times_its_new_run(job, changes, monkeypatch):
    from django.template.loader import render_to_string

    from console import jobs

    clock = [timezone.now()]
    monkeypatch.setattr(jobs.timezone, "now", lambda: clock[0])

    def tick(seconds: float) -> None:
        clock[0] += timedelta(seconds=seconds)

    def work(ctx):
        ctx.step("Connect")
        tick(5)
        ctx.step("Install the agent")
        tick(2)
        ctx.step("Connect")  # again (a step a resumed job runs anew): its time is this run's
        assert "seconds" not in ctx.job.steps[0]
        tick(0.8)
        ctx.step("Install the agent")
        tick(125)
        raise JobError("The machine refused the upload.")

    run(job, work, changes)

    job.refresh_from_db()
    assert [(s["state"], s.get("seconds")) for s in job.steps] == [
        (StepState.DONE, 0.8), (StepState.FAILED, 125.0), (StepState.PENDING, None)]
    card = render_to_string("console/_steps.html", {"steps": job.steps})
    assert card.count('class="step__time"') == 2 and ">0.8 s<" in card and ">2 min 5 s<" in card


@pytest.mark.parametrize("seconds, words", [(0, "0.0 s"), (0.84, "0.8 s"), (12.4, "12 s"), (59.4, "59 s"), (59.6, "1 min"), (60, "1 min"),
                                            (125, "2 min 5 s"), (3600, "1 h"), (3840, "1 h 4 min")])
def test_a_steps_time_reads_as_people_say_it(seconds, words):
    from console.templatetags.units import step_seconds

    assert step_seconds(seconds) == words


def test_detail_skip_and_log_are_recorded_on_the_job(job, changes):
    def work(ctx):
        ctx.step("Connect")
        ctx.detail("root@198.18.0.11 port 22")
        ctx.skip("Install the agent", "already there")
        ctx.log("Connected.\n")

    run(job, work, changes)

    job.refresh_from_db()
    assert job.steps[0]["detail"] == "root@198.18.0.11 port 22"
    assert job.steps[1] == {"name": "Install the agent", "state": StepState.SKIPPED, "detail": "already there"}
    assert job.log.endswith(" Connected.\n")


def test_the_log_keeps_only_its_newest_lines(job, changes):
    def work(ctx):
        for n in range(40):
            ctx.log(f"line {n:02d} " + "x" * 2000)

    run(job, work, changes)

    job.refresh_from_db()
    assert len(job.log) <= LOG_LIMIT
    assert "line 39" in job.log and "line 00" not in job.log


# -- the reaper --------------------------------------------------------------------------------


def test_reaper_fails_running_jobs_whose_worker_stopped_beating():
    stale = JobFactory(state=JobState.RUNNING, beat_at=timezone.now() - timedelta(minutes=6))

    assert jobs_reap() == 1

    stale.refresh_from_db()
    assert stale.state == JobState.FAILED
    assert "stopped before it finished" in stale.error
    assert stale.error_kind == "retryable"
    assert stale.finished_at is not None


def test_reaper_leaves_jobs_with_a_recent_beat_and_jobs_that_are_not_running():
    fresh = JobFactory(state=JobState.RUNNING, beat_at=timezone.now() - timedelta(seconds=10))
    queued = JobFactory(state=JobState.QUEUED, beat_at=timezone.now() - timedelta(hours=1))
    done = JobFactory(state=JobState.SUCCEEDED, beat_at=timezone.now() - timedelta(hours=1))

    assert jobs_reap() == 1  # the queued one's task is only sent again (tests/unit/test_job_resume.py)

    assert [Job.objects.get(pk=j.pk).state for j in (fresh, queued, done)] == [
        JobState.RUNNING, JobState.QUEUED, JobState.SUCCEEDED
    ]


def reaped_while_running(job_pk):
    """The worker stalls: the reaper sees it silent for ten minutes and fails the job."""
    Job.objects.filter(pk=job_pk).update(beat_at=timezone.now() - timedelta(minutes=10))
    assert jobs_reap() == 1


def test_an_end_written_by_the_reaper_is_not_overwritten_by_the_worker_finishing_late(job, changes):
    def work(ctx):
        ctx.step("Connect")
        reaped_while_running(job.pk)

    run(job, work, changes)

    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert "stopped before it finished" in job.error
    assert JobState.SUCCEEDED not in [state for state, _ in changes]


def test_an_end_written_by_the_reaper_is_not_overwritten_by_the_worker_failing_late(job, changes):
    def work(ctx):
        ctx.step("Connect")
        reaped_while_running(job.pk)
        raise JobError("Could not reach 198.18.0.11 port 22.", kind="unreachable")

    run(job, work, changes)

    job.refresh_from_db()
    assert "stopped before it finished" in job.error
    assert job.error_kind == "retryable"


def test_job_run_returns_the_job_as_the_database_holds_it_when_the_reaper_ended_it_first(job, changes):
    def work(ctx):
        ctx.step("Connect")
        reaped_while_running(job.pk)

    assert run(job, work, changes).state == JobState.FAILED

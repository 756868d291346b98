"""The reaper through a worker that really died: a process running an NCCL test's job is killed (SIGKILL)
in the middle of the all-reduce, and the reaper fails the job and the test with it, so that the cluster
takes a new test. The NCCL test's kind cannot resume; its on_failed runs all the same."""
import os
import select
import signal
import subprocess
import sys
from datetime import timedelta

import pytest

from clusters import nccl_tests, tasks
from clusters.models import NcclTest, NcclTestState
from console import roles
from console.choices import JobState, StepState
from console.jobs import STOPPED_WORKER, jobs_reap
from console.models import Job
from tests.builders import cluster_of, gpu_machine
from tests.factories import UserFactory
from tests.processes import database_url

pytestmark = pytest.mark.django_db(transaction=True)  # the worker process reads what the test wrote

WORKER_START_TIMEOUT = 60  # seconds for the worker process to set Django up and reach the agent


def worker_running(task: str, job_id: int) -> subprocess.Popen:
    """The job's task in a process of its own, once it stands in its first agent call."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DATABASE_URL": database_url()}
    worker = subprocess.Popen([sys.executable, "-m", "tests.job_worker", task, str(job_id)], env=env,
                              stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([worker.stdout], [], [], WORKER_START_TIMEOUT)
    said = worker.stdout.readline() if ready else ""
    if not said.startswith("agent "):
        worker.kill()
        worker.wait(timeout=10)
        pytest.fail(f"the worker did not reach the agent within {WORKER_START_TIMEOUT} s (exit status {worker.poll()})")
    return worker


def test_a_worker_killed_during_an_nccl_test_fails_the_test_and_the_cluster_takes_a_new_one(monkeypatch):
    monkeypatch.setattr(tasks.nccl_test, "delay", lambda job_id: None)  # the process below is its worker
    room = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)])
    operator = UserFactory(username="ann", role=roles.OPERATOR)
    test = nccl_tests.nccl_test_start(cluster=room, user=operator)

    worker = worker_running("clusters.tasks.nccl_test", test.job_id)
    job = Job.objects.get(pk=test.job_id)
    assert (job.state, job.steps[0]["state"]) == (JobState.RUNNING, StepState.RUNNING)
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=10)

    assert jobs_reap(stale_after=timedelta(0)) == 1  # its last beat is older than now: the worker is gone

    job.refresh_from_db()
    assert (job.state, job.error) == (JobState.FAILED, f"{STOPPED_WORKER} Run it again.")
    test.refresh_from_db()
    assert (test.state, test.message) == (NcclTestState.FAILED, nccl_tests.STOPPED_WORKER)
    assert test.finished_at is not None
    assert nccl_tests.nccl_test_offer(room, roles.OPERATOR).ok
    again = nccl_tests.nccl_test_start(cluster=room, user=operator)
    assert again.state == NcclTestState.RUNNING and again.pk != test.pk
    assert NcclTest.objects.filter(cluster=room, state=NcclTestState.RUNNING).count() == 1

"""One job's worker in a process of its own, for the tests that kill a worker mid-job (SIGKILL, as a crash
would): ``python -m tests.job_worker TASK JOB_ID`` runs the job's task, as a Celery worker would, on the
test database (``DATABASE_URL``). Every machine's agent stands still in its first call, so the job stays
in the middle of its work: the process prints ``agent <method>`` once a call is under way, then waits
until it is killed."""
import os
import sys
import threading


class StandingAgent:
    """An agent whose every call is under way and never returns (a machine that stopped answering)."""

    def __init__(self, machine):
        self.machine = machine

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def __getattr__(self, method: str):
        def call(*args, **kwargs):
            print(f"agent {method} on {self.machine.name}", flush=True)
            threading.Event().wait()  # until the test kills the process

        return call


def main(task_path: str, job_id: int) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.utils.module_loading import import_string

    from machines.agent_client import Agent

    Agent.open = classmethod(lambda cls, machine: StandingAgent(machine))
    import_string(task_path)(job_id)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

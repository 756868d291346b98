"""faden serve's processes: a killed gateway starts again while web, worker and beat keep running; one that
keeps dying waits longer each time; any other process that stops stops them all."""
import os
import signal
import sys
import time

import pytest

from console import supervisor as module
from console.supervisor import Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def said():
    return []


@pytest.fixture
def watched(said):
    watching = Supervisor(said.append)
    yield watching
    watching.stop(grace=2)


def check_until(watching: Supervisor, condition, timeout: float = 5):
    deadline = time.monotonic() + timeout
    while not condition():
        assert watching.check() is None
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def test_a_killed_gateway_starts_again_and_the_others_keep_running(watched, said, monkeypatch):
    monkeypatch.setattr(module, "FIRST_PAUSE", 0.2)
    for name in ("web", "worker", "beat"):
        watched.spawn(name, SLEEPER)
    watched.spawn("gateway", SLEEPER, restart=True)
    others = {name: watched.process(name).pid for name in ("web", "worker", "beat")}
    killed = watched.process("gateway")

    os.kill(killed.pid, signal.SIGKILL)
    check_until(watched, lambda: watched.process("gateway") is not killed)

    assert watched.process("gateway").poll() is None
    assert {name: watched.process(name).pid for name in others} == others
    assert all(watched.process(name).poll() is None for name in others)
    assert "The gateway process stopped with exit status -9" in said[0] and "the others keep running" in said[0]
    assert said[1] == "Starting the gateway process again (restart 1)."


def test_a_gateway_that_keeps_dying_waits_longer_each_time(said):
    now = [100.0]
    watching = Supervisor(said.append, clock=lambda: now[0])
    watching.spawn("gateway", [sys.executable, "-c", "raise SystemExit(3)"], restart=True)
    pauses = []
    for _ in range(8):
        watching.process("gateway").wait(timeout=10)
        assert watching.check() is None
        pauses.append(watching.children["gateway"].pause)
        now[0] = watching.children["gateway"].due
        watching.check()  # due: started again
    assert pauses == [1, 2, 4, 8, 16, 32, 60, 60]
    assert "exit status 3" in said[0] and "starts again in 60 s" in said[-2]

    watching.process("gateway").wait(timeout=10)
    now[0] += module.STEADY  # it had run a long while before it died: a new series
    watching.check()
    assert watching.children["gateway"].pause == 1
    watching.stop(grace=1)


def test_any_other_process_that_stops_stops_them_all(watched):
    watched.spawn("web", [sys.executable, "-c", "raise SystemExit(2)"])
    watched.spawn("gateway", SLEEPER, restart=True)
    watched.process("web").wait(timeout=10)
    stopped = watched.check()
    assert stopped.name == "web" and stopped.process.returncode == 2

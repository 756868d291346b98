"""``raystop.terminate``: Ray's processes stopped in Ray's order, with stand-ins for them (small Python
processes under Ray's names that write down when SIGTERM reached them, and may ignore it)."""

import os
import socket
import subprocess
import sys
import time

import pytest

from fadenstack_agent import rayproc, raystop

# argv[1:] of each stand-in: the file it writes "<time> TERM" to, and whether it ignores SIGTERM.
STAND_IN = r"""
import signal, sys, time
log, ignore = sys.argv[1], sys.argv[2] == "ignore"
def term(*_):
    with open(log, "a") as fh:
        fh.write("%f TERM\n" % time.time())
    if not ignore:
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(log, "a").close()
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def spawn(tmp_path):
    """Start a stand-in for a Ray process: a binary by its argv[0] (``raylet``), a Python one by its
    script's path under ``ray/`` (as ``python .../ray/dashboard/dashboard.py`` runs); its Proc, and
    the file it writes to."""
    started = []

    def start(name, *, ignore=False, extra=()):
        log = tmp_path / f"{os.path.basename(name)}-{len(started)}.log"
        args = [str(log), "ignore" if ignore else "obey", *extra]
        if name.endswith(".py"):
            script = tmp_path / name
            script.parent.mkdir(parents=True, exist_ok=True)
            script.write_text(STAND_IN)
            argv = [sys.executable, str(script), *args]
        else:
            argv = [name, "-c", STAND_IN, *args]
        process = subprocess.Popen(argv, executable=sys.executable)
        started.append(process)
        deadline = time.monotonic() + 10
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return rayproc.read_proc(process.pid), log

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def told_at(log) -> float:
    lines = log.read_text().split()
    return float(lines[0]) if lines else float("inf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_gcs_server_is_told_last_after_the_raylet_and_its_clients(spawn):
    gcs, gcs_log = spawn("/opt/ray/core/src/ray/gcs/gcs_server")
    raylet, raylet_log = spawn("/opt/ray/core/src/ray/raylet/raylet")
    monitor, monitor_log = spawn("ray/autoscaler/_private/monitor.py")

    started = time.monotonic()
    stopped, forced = raystop.terminate([monitor, gcs, raylet])

    assert sorted(stopped) == sorted([monitor.pid, gcs.pid, raylet.pid]) and forced == []
    assert told_at(raylet_log) < told_at(monitor_log) < told_at(gcs_log)
    assert time.monotonic() - started < 2  # each went when told: no wave waited its grace


def test_a_raylet_whose_gcs_does_not_answer_is_not_waited_for(spawn):
    raylet, _ = spawn("/opt/ray/core/src/ray/raylet/raylet", ignore=True,
                      extra=("--gcs-address=127.0.0.1:%d" % free_port(),))  # nothing listens there
    agent, _ = spawn("ray/dashboard/agent.py", ignore=True)

    started = time.monotonic()
    stopped, forced = raystop.terminate([raylet, agent])

    assert sorted(forced) == sorted([raylet.pid, agent.pid])
    assert not raystop._still_there(raylet) and not raystop._still_there(agent)
    assert time.monotonic() - started < 3 * raystop.UNREACHABLE_GRACE + raystop.GCS_PROBE_TIMEOUT + 1


def test_a_raylet_that_outlives_its_wave_is_killed_and_the_rest_still_get_their_sigterm(spawn):
    with socket.socket() as gcs_port:  # a GCS that answers: the raylet gets its grace
        gcs_port.bind(("127.0.0.1", 0))
        gcs_port.listen()
        raylet, raylet_log = spawn("/opt/ray/core/src/ray/raylet/raylet", ignore=True,
                                   extra=("--gcs-address=127.0.0.1:%d" % gcs_port.getsockname()[1],))
        worker, worker_log = spawn("ray/_private/workers/default_worker.py")

        started = time.monotonic()
        stopped, forced = raystop.terminate([raylet, worker], grace=0.5)

    assert forced == [raylet.pid] and told_at(raylet_log) < told_at(worker_log)
    assert 0.5 <= time.monotonic() - started < 2  # the raylet's grace, not the worker's wave on top


def test_the_dashboard_head_is_killed_with_its_wave(spawn):
    dashboard, dashboard_log = spawn("ray/dashboard/dashboard.py", ignore=True)

    started = time.monotonic()
    stopped, forced = raystop.terminate([dashboard])

    assert forced == [dashboard.pid] and told_at(dashboard_log) == float("inf")  # SIGKILL, no SIGTERM
    assert time.monotonic() - started < 1

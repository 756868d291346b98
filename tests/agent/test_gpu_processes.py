"""Which processes use the GPUs (agent 0.9): nvidia-smi's list of compute processes parsed, the copies'
own processes told from a person's job by the copy records, the facts and the heartbeat carrying the
list, and the lab's stand-in nvidia-smi reporting a process that declares a GPU."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fadenstack_agent import beat, facts, gpuprocs, parsers
from fadenstack_agent.parsers import ToolOutputError
from fadenstack_agent.rayproc import read_proc

from .test_facts_parsing import FakeTools, _collect, _ip_answers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAND_IN = os.path.join(REPO, "lab", "stubs", "nvidia-smi")
UUID_0 = "GPU-6513270e-269e-4d37-b2a7-4de452e6b438"
UUID_3 = "GPU-0e1b2e2a-4b9f-4c57-8a55-3c2f1e0d9a11"


def test_compute_apps_are_one_entry_per_process_and_gpu():
    text = "%s, 4121, 2048\n%s, 4121, 2048\n%s, 977, [N/A]\n" % (UUID_0, UUID_3, UUID_3)
    assert parsers.parse_nvidia_compute_apps(text) == [
        {"gpu_uuid": UUID_0, "pid": 4121, "used_memory_mib": 2048},
        {"gpu_uuid": UUID_3, "pid": 4121, "used_memory_mib": 2048},
        {"gpu_uuid": UUID_3, "pid": 977, "used_memory_mib": None},
    ]


@pytest.mark.parametrize("idle", ["", "\n", "No running processes found\n"])
def test_no_compute_apps_is_an_empty_list(idle):
    assert parsers.parse_nvidia_compute_apps(idle) == []


@pytest.mark.parametrize("bad", ["Failed to initialize NVML: Driver/library version mismatch\n",
                                 "%s, not-a-pid, 10\n" % UUID_0, "[N/A], 4121, 10\n", "%s, 4121\n" % UUID_0])
def test_what_is_not_the_list_is_refused_with_its_first_line(bad):
    with pytest.raises(ToolOutputError):
        parsers.parse_nvidia_compute_apps(bad)


@pytest.fixture
def copy_tree(tmp_path):
    """A copy's engine as the agent records it (its host pid and start time) with a child of its own, and a
    record of a copy whose process is gone and whose pid another process took (another start time)."""
    store = tmp_path / "store"
    (store / "copies").mkdir(parents=True)
    engine = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen(['sleep', '60']); print('up', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert engine.stdout.readline().strip() == "up"
    stranger = subprocess.Popen(["sleep", "60"])
    records = {"d1-c1": {"copy": "d1-c1", "host_pid": engine.pid, "start_ticks": read_proc(engine.pid).start},
               "d2-c1": {"copy": "d2-c1", "host_pid": stranger.pid, "start_ticks": read_proc(stranger.pid).start - 1}}
    for name, record in records.items():
        (store / "copies" / f"{name}.json").write_text(json.dumps(record))
    deadline = time.monotonic() + 5
    children = []
    while not children and time.monotonic() < deadline:
        children = [int(p) for p in os.listdir("/proc") if p.isdigit() and read_proc(int(p))
                    and read_proc(int(p)).ppid == engine.pid]
    yield str(store), engine.pid, children[0], stranger.pid
    for process in (engine, stranger):
        process.kill()
        process.wait()
    os.kill(children[0], signal.SIGKILL)


def test_the_copies_engines_and_what_runs_under_them_are_the_consoles_and_nothing_else(copy_tree):
    store, engine, child, stranger = copy_tree
    assert gpuprocs.copy_pids(store) == {engine, child}  # the stranger reused no record's start time


def test_a_persons_job_is_marked_not_the_consoles_and_listed_first(copy_tree):
    store, engine, child, stranger = copy_tree
    tools = FakeTools({"nvidia-smi compute-apps": (
        0, "%s, %d, 30000\n%s, %d, 512\n%s, %d, 2048\n" % (UUID_0, engine, UUID_0, child, UUID_3, stranger), "")})
    processes, warning = gpuprocs.read(tools, store)
    assert warning is None
    assert processes == [
        {"gpu_uuid": UUID_3, "pid": stranger, "used_memory_mib": 2048, "console": False},
        {"gpu_uuid": UUID_0, "pid": engine, "used_memory_mib": 30000, "console": True},
        {"gpu_uuid": UUID_0, "pid": child, "used_memory_mib": 512, "console": True},
    ]
    assert tools.calls == [gpuprocs.COMPUTE_APPS]


def test_no_nvidia_smi_is_no_list_and_a_failing_one_a_warning(tmp_path):
    assert gpuprocs.read(FakeTools({}), str(tmp_path)) == (None, None)
    failing = FakeTools({"nvidia-smi compute-apps": (9, "NVIDIA-SMI has failed because it couldn't communicate", "")})
    processes, warning = gpuprocs.read(failing, str(tmp_path))
    assert processes is None and "exited with status 9" in warning
    none_here = FakeTools({"nvidia-smi compute-apps": (6, "No devices were found\n", "")})
    assert gpuprocs.read(none_here, str(tmp_path)) == ([], None)


def test_facts_carry_the_gpus_processes(tmp_path):
    answers = _ip_answers()
    answers["nvidia-smi"] = (0, open(os.path.join(os.path.dirname(__file__), "fixtures", "nvidia_smi_h100x8.csv")).read(), "")
    answers["nvidia-smi compute-apps"] = (0, "%s, 4121, 2048\n" % UUID_0, "")
    result, _ = _collect(tmp_path, answers)
    assert result["gpu_processes"] == [{"gpu_uuid": UUID_0, "pid": 4121, "used_memory_mib": 2048, "console": False}]
    assert result["warnings"] == []
    result, _ = _collect(tmp_path, _ip_answers())
    assert result["gpu_processes"] is None


def test_the_heartbeat_reads_the_gpus_at_most_every_ten_seconds_and_sends_only_what_it_read(tmp_path):
    now = [100.0]
    tools = FakeTools({"nvidia-smi compute-apps": (0, "%s, 4121, 2048\n" % UUID_0, "")})
    watch = gpuprocs.GpuWatch(tools, str(tmp_path), clock=lambda: now[0])
    first = beat.beat_payload(gpus=watch)
    assert first["gpu_processes"][0]["pid"] == 4121
    now[0] += 4
    assert "gpu_processes" not in beat.beat_payload(gpus=watch)  # the console keeps what it has
    now[0] += 6
    assert beat.beat_payload(gpus=watch)["gpu_processes"][0]["pid"] == 4121
    assert len(tools.calls) == 2
    absent = gpuprocs.GpuWatch(FakeTools({}), str(tmp_path), clock=lambda: now[0])
    assert absent.report() is None and absent.error is None
    now[0] += 10
    assert absent.report() is None and len(absent.run.calls) == 1  # no nvidia-smi: asked again after 100 s


def test_at_most_64_processes_go_out_and_the_consoles_are_the_ones_left_out():
    processes = [{"gpu_uuid": UUID_0, "pid": pid, "used_memory_mib": 1} for pid in range(1, 101)]
    marked = gpuprocs.mark(processes, console=set(range(1, 51)))
    assert len(marked) == gpuprocs.MAX_PROCESSES
    assert sum(not p["console"] for p in marked) == 50


def test_the_lab_stand_in_lists_a_process_that_declares_gpus_in_its_own_network_namespace(tmp_path):
    spec = tmp_path / "machine.json"
    spec.write_text(json.dumps({"name": "lab-a", "accelerators": [
        {"vendor": "nvidia", "model": "NVIDIA H100 80GB HBM3", "count": 4, "memory_mib": 81559}]}))
    env = {"PATH": "/usr/bin:/bin", "FADEN_LAB_MACHINE_JSON": str(spec), "FADEN_LAB_GPU_STATE_JSON": str(tmp_path / "none")}
    job = subprocess.Popen(["sleep", "60"], env=dict(env, FADEN_LAB_GPU_MEMORY_MIB="2048", CUDA_VISIBLE_DEVICES="1,3"))
    try:
        def ask(*args):
            done = subprocess.run([sys.executable, STAND_IN, *args], capture_output=True, text=True, env=env)
            assert done.returncode == 0, done.stdout
            return done.stdout
        uuids = [line.split(", ")[1] for line in ask("--query-gpu=index,uuid", "--format=csv,noheader").splitlines()]
        found = parsers.parse_nvidia_compute_apps(ask(*gpuprocs.COMPUTE_APPS[1:]))
        mine = [p for p in found if p["pid"] == job.pid]
        assert mine == [{"gpu_uuid": uuids[1], "pid": job.pid, "used_memory_mib": 2048},
                        {"gpu_uuid": uuids[3], "pid": job.pid, "used_memory_mib": 2048}]
        used = ask("--query-gpu=memory.used", "--format=csv,noheader,nounits").split()
        assert used[1] == used[3] == "2048"
        assert ask("--query-compute-apps=pid,process_name", "--format=csv").splitlines()[0] == "pid, process_name"
    finally:
        job.kill()
        job.wait()
    assert not [p for p in parsers.parse_nvidia_compute_apps(ask(*gpuprocs.COMPUTE_APPS[1:])) if p["pid"] == job.pid]

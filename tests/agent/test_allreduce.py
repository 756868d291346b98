"""``allreduce run|exec``: the NCCL test's agent side. The argv and the launcher's quoting (pure), then
the command itself with the ``process`` driver: a fake ``mpirun`` for the line streaming, the lock and
the kill, and, when Open MPI is on this host, a real mpirun across two "nodes" on loopback addresses
(127.0.0.2, 127.0.0.3) running the lab's ``all_reduce_perf``, its launcher asking the agent, whose ssh
is a stand-in that runs the command here (as the remote login shell would), through ``allreduce exec``.
The runtime never holds the cluster's key, and a link planted where the run once wrote is not followed."""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from fadenstack_agent import allreduce, allreducespec, proctree
from fadenstack_agent.protocol import AgentError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(REPO, "agent")
STUB = os.path.join(REPO, "lab", "stubs", "all_reduce_perf")
HAS_MPIRUN = shutil.which("mpirun") is not None and os.path.exists("/usr/bin/python3")
NODES = [{"name": "node-0", "address": "127.0.0.2", "gpus": 1}, {"name": "node-1", "address": "127.0.0.3", "gpus": 1}]
SPEC = {"cluster": "gpu-room", "nodes": NODES, "minbytes": 1048576, "maxbytes": 4194304, "iters": 2, "warmup": 0,
        "check": True, "timeout": 120}
# ssh as the launcher calls it, for tests: options skipped, the command given to a shell here, as a
# remote login shell gets it (ssh joins its words with spaces), in a session of its own as sshd
# would start it: a signal to the head's run does not reach it but through mpirun. Its exit status is
# the remote command's, as ssh's is (setsid --wait: setsid forks when its caller leads a process group).
FAKE_SSH = """#!/bin/sh
while [ $# -gt 0 ]; do case $1 in -o|-F) shift 2;; --) shift; break;; -*) shift;; *) break;; esac; done
host=$1; shift
echo "$host" >> "$FAKE_SSH_LOG"
exec setsid --wait sh -c "$*"
"""


# ------------------------------------------------------------------ the spec and the argv


def test_mpirun_runs_one_process_per_gpu_on_nodes_of_different_gpu_counts_with_nccl_tests_own_flags():
    spec = allreducespec.check_spec(dict(SPEC, nodes=[dict(NODES[0], gpus=8), dict(NODES[1], gpus=4)], check=False))
    assert allreducespec.mpirun_argv(spec, "/tmp/fadenstack-allreduce/launch") == [
        "mpirun", "--allow-run-as-root", "--leave-session-attached", "--host", "127.0.0.2:8,127.0.0.3:4", "-np", "12",
        "--map-by", "slot", "--bind-to", "none", "--mca", "plm_rsh_agent", "python3 /tmp/fadenstack-allreduce/launch",
        "--mca", "plm_rsh_no_tree_spawn", "1", "-x", "FADEN_ALLREDUCE_NODES=127.0.0.2,127.0.0.3",
        "-x", "FADEN_ALLREDUCE_SLOTS=8,4",
        "all_reduce_perf", "-b", "1048576", "-e", "4194304", "-f", "2", "-g", "1", "-n", "2", "-w", "0", "-c", "0"]


@pytest.mark.parametrize("change, words", [
    ({"nodes": [dict(NODES[0], gpus=0), NODES[1]]}, "gpus must be a whole number from 1 to 64, got 0"),
    ({"minbytes": 8388608}, "minbytes (8388608) is above its maxbytes (4194304)"),
    ({"nodes": [dict(NODES[0], address="node-0.example"), NODES[1]]}, "nodes[0].address must be an IP address"),
    ({"nodes": [NODES[0], NODES[0]]}, "127.0.0.2 is in the allreduce spec's nodes twice"),
    ({"argv": ["sh"]}, "unknown keys: argv"),
    ({"check": 1}, "check must be true or false"),
    ({"timeout": 0}, "timeout must be a whole number from 1 to 3600"),
])
def test_a_spec_that_cannot_run_is_refused_as_bad_input_saying_why(change, words):
    with pytest.raises(AgentError) as refused:
        allreducespec.check_spec(dict(SPEC, **change))
    assert refused.value.kind == "bad_input"
    assert words in refused.value.message


def test_a_nodes_own_nccl_and_gloo_settings_come_from_its_cluster_env(tmp_path):
    (tmp_path / "etc" / "fadenstack").mkdir(parents=True)
    (tmp_path / "etc" / "fadenstack" / "cluster.env").write_text(
        "# This node's place\nMASTER_ADDR=198.18.1.11\nNCCL_SOCKET_IFNAME='=eth1'\nGLOO_SOCKET_IFNAME=eth1\n")
    assert allreducespec.node_env(allreducespec.Root(str(tmp_path))) == {"NCCL_SOCKET_IFNAME": "=eth1", "GLOO_SOCKET_IFNAME": "eth1"}
    assert allreducespec.node_env(allreducespec.Root(str(tmp_path / "none"))) == {}


def test_a_signal_inside_a_container_goes_to_the_pid_the_run_wrote(tmp_path):
    pidfile = tmp_path / "mpirun.pid"
    runner = subprocess.Popen(allreducespec.pid_wrapped(["sleep", "60"], str(pidfile)))
    try:
        deadline = time.monotonic() + 10
        # The shell makes the file before it writes the pid in it: wait for the line, not for the file.
        while not (pidfile.exists() and pidfile.read_text().endswith("\n")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert int(pidfile.read_text()) == runner.pid  # sh became the program: the pid is the program's
        subprocess.run(allreducespec.kill_argv("TERM", str(pidfile)), check=True, timeout=10)
        assert runner.wait(10) == -signal.SIGTERM
    finally:
        runner.kill()


def test_a_closed_session_is_seen_on_a_pipe_and_on_a_socket_alike():
    # sshd hands a command its output as a pipe or a socketpair: when the console closes its channel,
    # sshd closes the other end.
    reader, writer = os.pipe()
    ours, theirs = socket.socketpair()
    try:
        assert (allreduce.reader_gone(writer), allreduce.reader_gone(ours.fileno())) == (False, False)
        os.close(reader)
        theirs.close()
        assert (allreduce.reader_gone(writer), allreduce.reader_gone(ours.fileno())) == (True, True)
    finally:
        os.close(writer)
        ours.close()


# ------------------------------------------------------------------ the command, with the process driver


@pytest.fixture
def machine(tmp_path):
    """A machine whose runtime (the process driver) is started, its cluster SSH files in place, with
    ssh and the programs on the PATH as ``bin`` holds them; ``run(spec)`` starts ``allreduce run``."""
    root, store, home, bin_dir = tmp_path / "root", tmp_path / "store", tmp_path / "home", tmp_path / "bin"
    for directory in (root / "root" / ".ssh", root / "etc" / "fadenstack", store / "runtime", home, bin_dir):
        directory.mkdir(parents=True)
    (root / "root" / ".ssh" / "config").write_text(
        "# fadenstack cluster nodes: begin\nHost node-0 127.0.0.2\n    HostName 127.0.0.2\nHost node-* 127.0.0.2 127.0.0.3\n"
        "    User root\n    IdentityFile /root/.ssh/fadenstack_cluster\n    UserKnownHostsFile /etc/fadenstack/known_hosts\n"
        "Host *\n# fadenstack cluster nodes: end\n")
    (root / "root" / ".ssh" / "fadenstack_cluster").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    (root / "etc" / "fadenstack" / "known_hosts").write_text("node-0,127.0.0.2 ssh-ed25519 AAAA\n")
    (root / "etc" / "fadenstack" / "cluster.env").write_text("NCCL_SOCKET_IFNAME=lo\n")
    (tmp_path / "agent.json").write_text(json.dumps({"runtime_driver": "process", "process": {
        "ray": "/bin/true", "python": sys.executable, "all_reduce_perf": STUB}}))  # the lab's stub, by path
    (store / "runtime" / "state.json").write_text(json.dumps({"state": "started", "driver": "process", "cluster": "gpu-room"}))
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    port = free_port()
    # Open MPI's session directories go under TMPDIR: one of this test's own, short (they hold Unix
    # sockets), so that another test's mpirun ending at the same moment does not remove the shared
    # /tmp/ompi.* under this one's feet (mpirun then stops with exit 213, "File exists").
    sessions = tempfile.mkdtemp(prefix="ompi-")
    env = dict(os.environ, PATH="%s:%s" % (bin_dir, os.environ["PATH"]), PYTHONPATH=AGENT, FADEN_AGENT_HOME=str(home),
               TMPDIR=sessions,
               FADEN_AGENT_STORE=str(store), FADEN_AGENT_CONFIG=str(tmp_path / "agent.json"),
               FADEN_NODE_FILES_ROOT=str(root), FADEN_LAB_HOSTFILE=str(tmp_path / "no-hostfile"),  # -x tells the nodes
               FADEN_LAB_ALL_REDUCE_PORT=str(port), FAKE_SSH_LOG=str(tmp_path / "ssh.log"), MARK=str(tmp_path))

    class Machine:
        path, environ = tmp_path, env

        @staticmethod
        def run(spec):
            proc = subprocess.Popen([sys.executable, "-m", "fadenstack_agent", "allreduce", "run"], cwd=AGENT, env=env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
            proc.stdin = None  # sent: communicate() has nothing more to write
            return proc

        @staticmethod
        def fake_mpirun(script):
            (bin_dir / "mpirun").write_text("#!/bin/sh\n" + script)
            (bin_dir / "mpirun").chmod(0o755)

    yield Machine
    shutil.rmtree(sessions, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.2", 0))
        return sock.getsockname()[1]


def events(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert err == b"", err
    return [json.loads(line) for line in out.decode().splitlines()]


def next_event(proc) -> dict:
    return json.loads(proc.stdout.readline())


def alive(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid) as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_each_line_comes_as_a_progress_event_while_the_program_still_runs(machine):
    # The fake prints one line, then waits until the test has seen it: the line came while it ran.
    machine.fake_mpirun('echo "first line"\nwhile [ ! -e "$MARK/seen" ]; do sleep 0.05; done\n'
                        'echo "second line"\necho "its words" >&2\nexit 3\n')
    proc = machine.run(SPEC)
    assert next_event(proc)["event"] == "log"
    assert next_event(proc) == {"event": "progress", "line": "first line"}
    (machine.path / "seen").touch()
    rest = events(proc)
    assert rest[0] == {"event": "progress", "line": "second line"}
    result = rest[-1]
    assert (result["event"], result["exit_status"], result["timed_out"], result["stderr_tail"]) == (
        "result", 3, False, ["its words"])
    assert sorted(os.listdir(machine.path / "store")) == ["runtime"]  # nothing of the run in the store


def digests(paths) -> dict:
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in paths}


def test_the_runs_ssh_config_is_the_agents_own_with_roots_key_and_links_planted_where_the_run_once_wrote_are_not_followed(machine):
    # A hostile runtime's links where the run wrote before (the store), and one in the agent's own directory.
    targets = [machine.path / "root" / "root" / ".ssh" / "authorized_keys", machine.path / "root" / "etc" / "shadow"]
    for target in targets:
        target.write_text("root's own\n")
    planted = machine.path / "store" / "allreduce"
    (planted / "ssh").mkdir(parents=True)
    for index, name in enumerate(["hostfile", "launch", "run.json", "mpirun.pid", "orted.pid", "ssh/key", "ssh/config",
                                  "ssh/known_hosts"]):
        os.symlink(targets[index % 2], planted / name)
    (machine.path / "home" / "allreduce").mkdir(mode=0o700)
    os.symlink(targets[0], machine.path / "home" / "allreduce" / "run.json")
    before = digests(targets)
    machine.fake_mpirun('cat "$FADEN_AGENT_HOME/allreduce/ssh_config"\nstat -c %a "$FADEN_AGENT_HOME/allreduce/ssh_config"\n'
                        'grep -rl secret "$FADEN_AGENT_STORE" "$FADEN_AGENT_HOME" || echo "no key"\n')
    *progress, result = events(machine.run(SPEC))
    lines = [event["line"] for event in progress if event["event"] == "progress"]
    assert "    IdentityFile %s/root/.ssh/fadenstack_cluster" % (machine.path / "root") in lines  # root's key, not a copy
    assert "    UserKnownHostsFile %s/etc/fadenstack/known_hosts" % (machine.path / "root") in lines
    assert lines[-2:] == ["600", "no key"] and result["exit_status"] == 0
    assert digests(targets) == before
    assert all(os.path.islink(planted / name) for name in ["hostfile", "launch", "run.json", "ssh/key"])  # not even removed
    assert sorted(os.listdir(machine.path / "home" / "allreduce")) == []  # the run's files went with it


def test_a_second_run_on_the_machine_is_refused_naming_the_one_that_runs(machine):
    machine.fake_mpirun('touch "$MARK/started"\nwhile [ ! -e "$MARK/go" ]; do sleep 0.05; done\n')
    first = machine.run(SPEC)
    assert wait_for(lambda: (machine.path / "started").exists())
    second = events(machine.run(dict(SPEC, cluster="other")))
    assert second[-1]["event"] == "error" and second[-1]["kind"] == "retryable"
    assert second[-1]["message"].startswith("An NCCL test (allreduce run) is already running on this machine: cluster "
                                            "gpu-room's, started at ")
    (machine.path / "go").touch()
    assert events(first)[-1]["exit_status"] == 0


def test_the_timeout_ends_the_program_and_what_it_started(machine):
    machine.fake_mpirun('sleep 300 &\necho $! > "$MARK/child"\necho started\nwait\n')
    proc = machine.run(dict(SPEC, timeout=2))
    *_, result = events(proc, timeout=60)
    assert result["timed_out"] is True and result["exit_status"] == 128 + signal.SIGTERM
    assert not alive(int((machine.path / "child").read_text()))


def test_the_console_closing_its_session_ends_the_program_and_what_it_started(machine):
    machine.fake_mpirun('sleep 300 &\necho $! > "$MARK/child"\necho started\nwait\n')
    proc = machine.run(dict(SPEC, timeout=600))
    next_event(proc)
    assert next_event(proc) == {"event": "progress", "line": "started"}
    proc.stdout.close()  # the console's abort: its SSH channel closes, our stdout's reader is gone
    assert proc.wait(30) == 0
    assert wait_for(lambda: not alive(int((machine.path / "child").read_text())))


# An engine for tests: ``exec [-e NAME]... CONTAINER COMMAND...`` runs the command here, the container's
# /var/lib/fadenstack being the machine's store (as the runtime container's mount makes it); each call logged.
FAKE_PODMAN = """#!/usr/bin/python3
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_ENGINE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
if args[0] == "inspect":  # the container's first process: this machine's init (the commands run here)
    print(json.dumps({"Status": "running", "Running": True, "Pid": 1, "ExitCode": 0}))
    sys.exit(0)
assert args[0] == "exec", args
at = 1
while args[at] == "-e":
    assert args[at + 1] in os.environ, args[at + 1]
    at += 2
command = [word.replace("/var/lib/fadenstack", os.environ["FADEN_AGENT_STORE"]).replace(
    "/tmp/fadenstack-allreduce", os.environ["FAKE_INSIDE"]) for word in args[at + 1:]]
os.execvp(command[0], command)
"""


def in_container(machine):
    """The machine's runtime as a podman container of cluster gpu-room; the engine's calls, read later."""
    (machine.path / "bin" / "podman").write_text(FAKE_PODMAN)
    (machine.path / "bin" / "podman").chmod(0o755)
    (machine.path / "store" / "runtime" / "state.json").write_text(json.dumps(
        {"state": "started", "driver": "podman", "cluster": "gpu-room", "container": "fadenstack-gpu-room"}))
    (machine.path / "agent.json").write_text("{}")
    os.symlink(STUB, machine.path / "bin" / "all_reduce_perf")  # the image's, on its PATH
    machine.environ["FAKE_ENGINE_LOG"] = str(machine.path / "engine.log")
    machine.environ["FAKE_INSIDE"] = str(machine.path / "inside")  # the container's /tmp/fadenstack-allreduce
    return lambda: [json.loads(line) for line in (machine.path / "engine.log").read_text().splitlines()]


def test_in_a_container_the_run_goes_through_the_engines_exec_and_is_ended_inside_it(machine):
    calls = in_container(machine)
    machine.fake_mpirun('trap \'echo "ended by TERM" > "$MARK/ended"; exit 143\' TERM\necho started\n'
                        'while :; do sleep 0.05; done\n')
    *_, result = events(machine.run(dict(SPEC, timeout=2)), timeout=60)
    assert result["timed_out"] is True and result["exit_status"] == 143
    assert (machine.path / "ended").read_text() == "ended by TERM\n"
    execs = [call for call in calls() if call[0] == "exec"]
    check, put, run = execs[:3]
    assert ["inspect", "--format", "{{json .State}}", "fadenstack-gpu-room"] in calls()  # to find mpirun's tree
    assert check[:4] == ["exec", "fadenstack-gpu-room", "sh", "-c"] and check[-3:] == ["mpirun", "all_reduce_perf", "python3"]
    assert put[:4] == ["exec", "fadenstack-gpu-room", "sh", "-c"] and put[-2] == "/tmp/fadenstack-allreduce"  # written inside
    assert "allreduce launcher" in put[-1] and "PRIVATE KEY" not in put[-1]
    assert run[:7] == ["exec", "-e", "NCCL_SOCKET_IFNAME", "fadenstack-gpu-room", "sh", "-c",
                       'mkdir -p -m 700 "${0%/*}" && echo $$ > "$0" && exec "$@"']
    assert run[7:13] == ["/tmp/fadenstack-allreduce/mpirun.pid", "mpirun", "--allow-run-as-root",
                         "--leave-session-attached", "--host", "127.0.0.2:1,127.0.0.3:1"]
    assert "python3 /tmp/fadenstack-allreduce/launch" in run and run[-1] == "1"
    assert ["exec", "fadenstack-gpu-room"] + allreducespec.kill_argv("TERM", "/tmp/fadenstack-allreduce/mpirun.pid") in execs
    assert execs[-1][-4:] == ["-c", 'rm -rf "$1"', "sh", "/tmp/fadenstack-allreduce"]  # cleaned inside
    assert not (machine.path / "store" / "allreduce").exists() and not (machine.path / "inside").exists()


def test_allreduce_exec_runs_the_daemons_command_in_the_nodes_container_with_its_nccl_settings(machine):
    calls = in_container(machine)
    done = subprocess.run([sys.executable, "-m", "fadenstack_agent", "allreduce", "exec", "--cluster", "gpu-room",
                           "--command", 'echo "orted here"; echo "$NCCL_SOCKET_IFNAME"; exit 7'],
                          cwd=AGENT, env=machine.environ, capture_output=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (7, b"orted here\nlo\n", b"")  # the command's own, only
    assert calls() == [["exec", "-e", "NCCL_SOCKET_IFNAME", "fadenstack-gpu-room"] + allreducespec.pid_wrapped(
        ["sh", "-c", 'echo "orted here"; echo "$NCCL_SOCKET_IFNAME"; exit 7'], "/tmp/fadenstack-allreduce/orted.pid")]


def test_allreduce_exec_for_another_cluster_is_refused_on_stderr_too_for_mpirun_to_show(machine):
    in_container(machine)
    done = subprocess.run([sys.executable, "-m", "fadenstack_agent", "allreduce", "exec", "--cluster", "other",
                           "--command", "orted"], cwd=AGENT, env=machine.environ, capture_output=True, timeout=60)
    words = "This machine's runtime is cluster gpu-room's, not other's"
    assert done.returncode == 1 and json.loads(done.stdout)["message"] == words
    assert done.stderr.decode() == "fadenstack-agent allreduce exec: %s\n" % words


def test_allreduce_exec_ends_all_it_started_when_the_heads_session_closes(machine):
    # orted's ranks each have a process group of their own: the tree, not a group, is what ends.
    part = subprocess.Popen([sys.executable, "-m", "fadenstack_agent", "allreduce", "exec", "--cluster", "gpu-room",
                             "--command", 'setsid sleep 300 & echo $! > "$MARK/rank"; echo up; wait'],
                            cwd=AGENT, env=machine.environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert part.stdout.readline() == b"up\n"
    assert wait_for(lambda: (machine.path / "rank").exists() and (machine.path / "rank").read_text().strip())
    rank = int((machine.path / "rank").read_text())
    assert alive(rank)
    part.stdout.close()  # the head's mpirun, its launcher and their SSH session are gone
    assert part.wait(30) == 128 + signal.SIGKILL
    assert wait_for(lambda: not alive(rank))
    part.stderr.close()


def test_a_snapshot_of_a_tree_kills_what_outlived_its_killed_root():
    root = subprocess.Popen(["sh", "-c", "setsid sleep 300 & sh -c 'sleep 300' & wait"])
    try:
        assert wait_for(lambda: len(proctree.snapshot(root.pid)) == 4)  # sh, setsid's sleep, sh, its sleep
        taken = proctree.snapshot(root.pid)
        root.kill()
        root.wait()
        left = [pid for pid in taken if alive(pid)]
        assert len(left) == 3  # handed to init, one in a group of its own: no group kill would take them all
        assert sorted(proctree.kill_left(taken)) == sorted(left)
        assert wait_for(lambda: not any(alive(pid) for pid in left))
    finally:
        root.kill()


def test_a_machine_whose_runtime_is_not_started_refuses_the_run(machine):
    (machine.path / "store" / "runtime" / "state.json").write_text(json.dumps({"state": "stopped", "driver": "process"}))
    error = events(machine.run(SPEC))[-1]
    assert (error["kind"], error["message"]) == ("not_retryable", "The runtime is not started on this machine: the NCCL "
                                                 "test runs in the cluster's runtime (start the cluster first)")


def test_a_machine_without_the_clusters_ssh_files_says_which_are_missing(machine):
    machine.fake_mpirun("exit 0\n")
    os.remove(machine.path / "root" / "root" / ".ssh" / "fadenstack_cluster")
    error = events(machine.run(SPEC))[-1]
    assert error["kind"] == "not_retryable"
    assert "/root/.ssh/fadenstack_cluster missing" in error["message"]


# ------------------------------------------------------------------ real Open MPI, two nodes on loopback


def rank_pids(marker: str) -> list:
    """The all_reduce_perf processes of this test's run (their environment names its port)."""
    found = []
    for name in os.listdir("/proc"):
        try:
            with open("/proc/%s/cmdline" % name, "rb") as handle:
                cmdline = handle.read()
            with open("/proc/%s/environ" % name, "rb") as handle:
                environ = handle.read().split(b"\0")
        except OSError:
            continue
        argv = cmdline.split(b"\0")
        is_rank = len(argv) > 1 and os.path.basename(argv[1]) == b"all_reduce_perf"  # python3 <the stub> (its #!)
        if is_rank and marker.encode() in environ and alive(int(name)):
            found.append(int(name))
    return found


def hwloc_crashed(result) -> bool:
    """Open MPI 4.1.4's mpirun (Debian's, with libhwloc 2.9.0) died of SIGSEGV in hwloc_alloc_setup_object
    as it read the host's topology, in about 1 run of this file in 10 and never in a test run alone; the
    cause is not found (not veth churn in the host's namespace, not stale session directories). The run
    reports it in the engine's own words, as a user would see it; the two-node test of the launcher, which
    asserts our part, runs again once when it happens (the other mpirun tests here may still meet it)."""
    return result["exit_status"] == 139 and any("hwloc_" in line for line in result["stderr_tail"])


@pytest.mark.skipif(not HAS_MPIRUN, reason="Open MPI's mpirun is not on this host (apt-get install openmpi-bin)")
def test_real_mpirun_runs_the_stub_on_two_nodes_through_the_launcher_and_allreduce_exec(machine):
    uneven = dict(SPEC, nodes=[dict(NODES[0], gpus=2), NODES[1]])  # one process per GPU: 2 on one node, 1 on the other
    *progress, result = events(machine.run(uneven))
    if hwloc_crashed(result):  # Open MPI's, at its start; the test of our part runs again once
        (machine.path / "ssh.log").unlink(missing_ok=True)
        *progress, result = events(machine.run(uneven))
    lines = [event["line"] for event in progress if event["event"] == "progress"]
    assert result["exit_status"] == 0, result
    assert lines[0].startswith("# nThread 1 nGpus 1 minBytes 1048576 maxBytes 4194304 step: 2(factor)")
    assert sum(1 for line in lines if line.startswith("#  Rank ")) == 3  # every GPU of both nodes
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == [1048576, 2097152, 4194304]
    assert all(row[8] == "0" and row[12] == "0" for row in rows)  # no wrong element, out of place and in place
    assert lines[-3] == "# Out of bounds values : 0 OK"
    assert sorted(open(machine.path / "ssh.log").read().split()) == ["127.0.0.2", "127.0.0.3"]


@pytest.mark.skipif(not HAS_MPIRUN, reason="Open MPI's mpirun is not on this host (apt-get install openmpi-bin)")
def test_real_mpirun_aborted_by_the_console_leaves_no_rank_on_any_node(machine):
    marker = "FADEN_LAB_ALL_REDUCE_PORT=" + machine.environ["FADEN_LAB_ALL_REDUCE_PORT"]
    proc = machine.run(dict(SPEC, maxbytes=1024 ** 3, timeout=600))
    seen = ""
    while not seen.startswith("     1048576"):
        event = next_event(proc)
        assert event["event"] in ("log", "progress"), event
        seen = event.get("line", "")
    assert len(rank_pids(marker)) == 2  # both nodes' ranks run
    proc.stdout.close()
    assert proc.wait(60) == 0
    assert wait_for(lambda: rank_pids(marker) == [], 30), rank_pids(marker)


def global_address():
    """An IPv4 address of this host's own (not loopback): a head mpirun sees as itself."""
    done = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True)
    words = done.stdout.split()
    return words[words.index("inet") + 1].split("/")[0] if "inet" in words else None


def abort_after_the_first_row(machine, spec) -> str:
    marker = "FADEN_LAB_ALL_REDUCE_PORT=" + machine.environ["FADEN_LAB_ALL_REDUCE_PORT"]
    proc = machine.run(spec)
    seen = ""
    while not seen.startswith("     1048576"):
        event = next_event(proc)
        assert event["event"] in ("log", "progress"), event
        seen = event.get("line", "")
    assert len(rank_pids(marker)) == 2
    proc.stdout.close()
    proc.wait(60)
    return marker


@pytest.mark.skipif(not HAS_MPIRUN or not global_address(), reason="needs Open MPI's mpirun and an address of this host")
def test_real_mpirun_with_the_head_here_runs_its_rank_itself_and_the_abort_ends_both(machine):
    head = global_address()
    spec = dict(SPEC, nodes=[dict(NODES[0], address=head), NODES[1]], maxbytes=1024 ** 3, timeout=600)
    marker = abort_after_the_first_row(machine, spec)
    assert wait_for(lambda: rank_pids(marker) == [], 30), rank_pids(marker)
    assert open(machine.path / "ssh.log").read().split() == ["127.0.0.3"]  # the head's rank is mpirun's own child


@pytest.mark.skipif(not HAS_MPIRUN or not global_address(), reason="needs Open MPI's mpirun and an address of this host")
def test_a_run_that_ignores_sigterm_is_killed_whole_after_the_grace(machine):
    # mpirun behind a wrapper that takes SIGTERM and goes on: the snapshot of the tree ends it all.
    # (The real one by name: from an absolute path mpirun puts its own directory first on the PATH.)
    (machine.path / "real").mkdir()
    os.symlink(shutil.which("mpirun"), machine.path / "real" / "mpirun")
    machine.fake_mpirun('trap "echo ignored" TERM\nPATH="$MARK/real:$PATH" mpirun "$@" &\nchild=$!\n'
                        'while kill -0 $child 2>/dev/null; do wait $child; done\n')
    head = global_address()
    spec = dict(SPEC, nodes=[dict(NODES[0], address=head), NODES[1]], maxbytes=1024 ** 3, timeout=600)
    started = time.monotonic()
    marker = abort_after_the_first_row(machine, spec)
    assert time.monotonic() - started >= allreduce.KILL_GRACE  # the grace was given first
    assert wait_for(lambda: rank_pids(marker) == [], 30), rank_pids(marker)


@pytest.mark.skipif(not HAS_MPIRUN, reason="Open MPI's mpirun is not on this host (apt-get install openmpi-bin)")
def test_a_daemon_that_dies_at_its_start_ends_the_run_at_once(machine):
    # As CI saw it once: a node's orted crashed in hwloc as it started (SIGSEGV). mpirun learns of it from
    # its launcher's exit status, which ssh passes on; this file's ssh stand-in passed 0 (setsid forked,
    # since mpirun makes each launcher a group leader, and its parent exited at once), so mpirun waited
    # and the run took its whole timeout (600 s). The first node's daemon crashes, the second is Open MPI's.
    (machine.path / "bin" / "orted").write_text(
        '#!/bin/sh\nif mkdir "$MARK/crashed" 2>/dev/null; then\n'
        '    echo "[vm:01445] *** Process received signal ***" >&2\n    kill -SEGV $$\nfi\n'
        'exec %s "$@"\n' % shutil.which("orted"))
    (machine.path / "bin" / "orted").chmod(0o755)
    started = time.monotonic()

    *logs, result = events(machine.run(dict(SPEC, timeout=600)), timeout=60)

    assert time.monotonic() - started < allreduce.KILL_GRACE + 10, result
    assert result["timed_out"] is False and result["exit_status"] != 0, (logs, result)
    assert "[vm:01445] *** Process received signal ***" in result["stderr_tail"]

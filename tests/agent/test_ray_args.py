"""``ray`` and ``runtime`` of the agent, without Ray: argv building, checks,
output parsing, and the commands' refusals (no Ray process is started here)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from fadenstack_agent import ray as raycmd
from fadenstack_agent import rayargs, rayproc
from fadenstack_agent import runtime
from fadenstack_agent.__main__ import main
from fadenstack_agent.protocol import AgentError

DIGEST = "ab" * 32
VENV = "/venv"


def driver(num_cpus=1):
    return runtime.ProcessDriver(VENV + "/bin/ray", VENV + "/bin/python", num_cpus)


def run_cli(capsys, *argv):
    code = main(list(argv))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    return code, lines[-1], lines


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A store and a machine config naming the process driver (executables that exist)."""
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    for name in ("ray", "python"):
        (bindir / name).write_text("#!/bin/sh\nexit 0\n")
        (bindir / name).chmod(0o755)
    config = tmp_path / "agent.json"
    config.write_text(json.dumps({"runtime_driver": "process",
                                  "process": {"ray": str(bindir / "ray"), "python": str(bindir / "python")}}))
    monkeypatch.setenv("FADEN_AGENT_CONFIG", str(config))
    store = tmp_path / "store"
    store.mkdir()
    return {"store": str(store), "config": config, "bindir": bindir}


def load(store, digest=DIGEST, manifest=None):
    os.makedirs(os.path.join(store, "runtime"), exist_ok=True)
    with open(os.path.join(store, "runtime", "loaded.json"), "w") as fh:
        json.dump({"digest": digest, "manifest": manifest or {"name": "faden-runtime", "version": "2.0.1"}}, fh)


# ---------------------------------------------------------------- argv


def test_head_argv_is_the_designs_ray_start_plus_the_drivers_arguments():
    argv = rayargs.head_start_argv(driver(), "198.18.1.11", 6379, 8, {"h100": 8}, "/var/lib/fadenstack/ray")
    assert argv == [
        "/venv/bin/ray", "start", "--head", "--node-ip-address=198.18.1.11", "--port=6379",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--dashboard-port=8265",
        "--ray-client-server-port=10001",
        "--num-gpus=8", '--resources={"h100":8}',
        "--node-manager-port=6380", "--object-manager-port=6381", "--dashboard-agent-grpc-port=6382",
        "--dashboard-agent-listen-port=6383", "--metrics-export-port=6384", "--runtime-env-agent-port=6385",
        "--min-worker-port=10002", "--max-worker-port=10199",
        "--object-store-memory=100000000", "--temp-dir=/var/lib/fadenstack/ray", "--disable-usage-stats",
        "--num-cpus=1", "--log-style=record", "--log-color=false"]


def test_join_argv_has_no_head_only_flags_and_no_resources_when_none_given():
    argv = rayargs.join_argv(driver(num_cpus=2), "198.18.1.11:6379", "198.18.1.12", 4, {},
                            "/var/lib/fadenstack/ray")
    assert argv[:4] == ["/venv/bin/ray", "start", "--address=198.18.1.11:6379",
                        "--node-ip-address=198.18.1.12"]
    assert "--num-gpus=4" in argv and "--num-cpus=2" in argv
    assert not [a for a in argv if a.startswith(("--head", "--port", "--include-dashboard", "--dashboard-host",
                                                  "--dashboard-port", "--resources", "--ray-client"))]
    # Every node's own ports pinned, as on the head (the firewall names them).
    assert rayargs.port_args() == [a for a in argv if a in rayargs.port_args()]


def test_the_heads_dashboard_is_asked_for_on_loopback_only_and_the_ray_client_port_is_pinned():
    argv = rayargs.head_start_argv(driver(), "198.18.1.11", 6379, 0, {}, "/var/lib/fadenstack/ray")
    dashboard = [a for a in argv if a.startswith(("--include-dashboard", "--dashboard-host", "--dashboard-port"))]
    # Asked for outright: a Ray without ray[default] fails its start instead of running without it.
    assert dashboard == ["--include-dashboard=true", "--dashboard-host=127.0.0.1", "--dashboard-port=8265"]
    # ray[default] (which the image needs for the dashboard) carries the Ray Client's packages.
    assert "--ray-client-server-port=10001" in argv


def test_ray_runs_without_its_metrics_exporter_which_listens_on_every_address():
    assert rayargs.ray_env({})["RAY_enable_metrics_collection"] == "0"


def test_status_argv_runs_the_script_isolated_with_its_arguments():
    argv = rayargs.status_argv(driver(), "198.18.1.11:6379", "198.18.1.12", "abc", "198.18.1.12", 30)
    assert argv[:4] == ["/venv/bin/python", "-I", "-c", rayargs.STATUS_SCRIPT]
    assert argv[4:] == ["198.18.1.11:6379", "198.18.1.12", "abc", "198.18.1.12", "30"]
    assert rayargs.status_argv(driver(), "h:1")[4:] == ["h:1", "", "", "", "0"]


def test_status_driver_bounds_rays_gcs_requests_to_our_deadline():
    assert rayargs.status_env(20)["RAY_gcs_server_request_timeout_seconds"] == "20"
    assert rayargs.status_env(0.5)["RAY_gcs_server_request_timeout_seconds"] == "5"
    assert rayargs.STATUS_LOOKUP + rayargs.STATUS_SLACK == 30


def test_status_script_asks_the_gcs_without_a_driver_and_falls_back_to_a_quiet_one():
    compile(rayargs.STATUS_SCRIPT, "<status>", "exec")
    assert "GcsClient(address=address)" in rayargs.STATUS_SCRIPT and "get_all_node_info(" in rayargs.STATUS_SCRIPT
    fallback = rayargs.STATUS_SCRIPT.split("except (ImportError, TypeError, AttributeError):")[1]
    assert 'log_to_driver": False' in fallback and 'logging_level": "ERROR"' in fallback
    assert "nodes = driver_nodes" in fallback and "ray.nodes()" in rayargs.STATUS_SCRIPT


def test_status_script_reports_an_import_failure_as_a_marked_line(tmp_path):
    # No Ray on sys.path with -I and an empty environment: the script says so.
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", rayargs.STATUS_SCRIPT, "h:1", "", "", "", "0"],
                          capture_output=True, text=True, timeout=30, cwd=str(tmp_path))
    answer = rayargs.parse_status_output(proc.stdout)
    assert proc.returncode == 3 and answer["error"] == "import"
    assert "ray" in answer["message"]


def test_ray_environment_drops_proxies_and_ray_address_and_disables_usage_stats():
    env = rayargs.ray_env({"PATH": "/bin", "http_proxy": "http://p:3128", "HTTPS_PROXY": "x", "NO_PROXY": "y",
                          "all_proxy": "z", "RAY_ADDRESS": "auto", "RAY_USAGE_STATS_ENABLED": "1"})
    assert env == {"PATH": "/bin", "RAY_USAGE_STATS_ENABLED": "0", "RAY_prestart_worker_first_driver": "0",
                   "RAY_enable_metrics_collection": "0", "DASHBOARD_METRIC_PORT": "6386",
                   "AUTOSCALER_METRIC_PORT": "6387"}


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("text, expected", [
    ("198.18.1.11:6379", ("198.18.1.11", 6379)),
    ("lab-a:7000", ("lab-a", 7000)),
    ("[fd00::1]:6379", ("fd00::1", 6379)),
])
def test_head_address_parses(text, expected):
    assert rayargs.parse_host_port(text) == expected


@pytest.mark.parametrize("text", ["198.18.1.11", ":6379", "198.18.1.11:", "198.18.1.11:0",
                                  "198.18.1.11:70000", "a b:1", ""])
def test_bad_head_address_is_bad_input(text):
    with pytest.raises(AgentError) as caught:
        rayargs.parse_host_port(text)
    assert caught.value.kind == "bad_input"


def test_build_address_brackets_ipv6():
    assert rayargs.build_address("198.18.1.11", 6379) == "198.18.1.11:6379"
    assert rayargs.build_address("fd00::1", 6379) == "[fd00::1]:6379"


@pytest.mark.parametrize("text, expected", [
    (None, {}), ("", {}), ('{"h100": 8}', {"h100": 8}), ('{"a": 0.5, "b": 0}', {"a": 0.5, "b": 0})])
def test_resources_parse(text, expected):
    assert rayargs.parse_resources(text) == expected
    assert rayargs.resources_arg(expected) == (['--resources=' + json.dumps(expected, sort_keys=True,
                                                                          separators=(",", ":"))]
                                              if expected else [])


@pytest.mark.parametrize("text", ["[1]", "{bad", '{"GPU": 8}', '{"CPU": 1}', '{"x": -1}', '{"x": "8"}',
                                  '{"x": true}'])
def test_bad_resources_are_bad_input(text):
    with pytest.raises(AgentError) as caught:
        rayargs.parse_resources(text)
    assert caught.value.kind == "bad_input"


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_bad_gpu_count_is_bad_input(value):
    with pytest.raises(AgentError) as caught:
        rayargs.parse_num_gpus(value)
    assert caught.value.kind == "bad_input"


def test_address_must_be_an_ip_literal():
    assert rayargs.parse_ip("198.18.1.11") == "198.18.1.11"
    with pytest.raises(AgentError) as caught:
        rayargs.parse_ip("lab-a")
    assert caught.value.kind == "bad_input"


# ---------------------------------------------------------------- socket paths


def test_socket_budget_counts_rays_longest_socket_path():
    temp = "/var/lib/fadenstack/ray"
    session = "session_2026-11-30_11-23-05_398143_4194304"
    longest = "%s/%s/sockets/plasma_store.99" % (temp, session)
    assert rayargs.longest_socket_path(temp) == len(longest)
    assert rayargs.check_temp_dir(temp) == temp


def test_a_temp_dir_whose_sockets_would_not_fit_is_refused_with_the_numbers():
    temp = "/" + "x" * 40 + "/ray"
    with pytest.raises(AgentError) as caught:
        rayargs.check_temp_dir(temp)
    assert caught.value.kind == "not_retryable"
    assert "107" in caught.value.message and temp in caught.value.message
    assert rayargs.longest_socket_path("/" + "x" * 35 + "/ray") <= 107


# ---------------------------------------------------------------- Ray's output


def test_status_output_takes_the_marked_line_among_rays_noise():
    stdout = ("2026-11-30 INFO worker.py:1 -- Connecting to existing Ray cluster\n"
              'FADEN-RAY-STATUS {"nodes": [{"node_id": "n1", "address": "198.18.1.11", "alive": true, '
              '"gpus": 8.0}, {"node_id": "n2", "address": "198.18.1.12", "alive": true, "gpus": 8.0}, '
              '{"node_id": "n0", "address": "198.18.1.12", "alive": false, "gpus": 8.0}]}\n')
    answer = rayargs.parse_status_output(stdout)
    assert [n["node_id"] for n in answer["nodes"]] == ["n1", "n2", "n0"]
    assert rayargs.summarize_nodes(answer["nodes"]) == {"alive_nodes": 2, "gpus": 16}
    assert rayargs.parse_status_output("no marker\nFADEN-RAY-STATUS {broken\n") is None


GCS_ERR = ('E1130 11:23:27.495771738   13901 chttp2_server.cc:1059] UNKNOWN:No address added out of total 1 '
           'resolved for \'0.0.0.0:6379\' {children:[UNKNOWN:Address already in use {errno:98, '
           'os_error:"Address already in use", syscall:"bind"}]}\n')
GCS_OUT = ("[2026-11-30 11:23:27,558 C 13901 13901] (gcs_server) grpc_server.cc:134:  An unexpected system "
           "state has occurred. Check failed: server_ Failed to start the grpc server. The specified port is "
           "6379. This means that Ray's core components will not be able to function correctly. If the server "
           "startup error message is `Address already in use`, it indicates the server fails to start\n")
START_OUT = ("Traceback (most recent call last):\n  File \"/venv/bin/ray\", line 6, in <module>\n"
             "    sys.exit(main())\nRuntimeError: Failed to start GCS.  Last 1 lines of error files:\n"
             + GCS_OUT + "\n.Please check /var/lib/fadenstack/ray/session_latest/logs/gcs_server.out\n")


def test_a_taken_gcs_port_is_told_in_rays_words_not_its_hint():
    assert rayargs.port_taken_in_logs(START_OUT, GCS_ERR)
    assert rayargs.in_use_words(START_OUT, GCS_ERR) == (
        "Failed to start the grpc server. The specified port is 6379.")
    # gRPC's hint alone (the failure may have another cause) is no proof.
    assert not rayargs.port_taken_in_logs(START_OUT)


def test_a_failed_start_is_classified_from_the_session_logs(tmp_path):
    store = str(tmp_path)
    logs = os.path.join(store, "ray", "session_latest", "logs")
    os.makedirs(logs)
    with open(os.path.join(logs, "gcs_server.err"), "w") as fh:
        fh.write(GCS_ERR)
    error = rayproc.start_failure(store, 1, START_OUT, "198.18.1.13", 6379)
    assert error.kind == "address_in_use"
    assert error.message.startswith("Address already in use (port 6379 on 198.18.1.13); Ray: Failed to start")
    # Logs of an older session (ray start failed before making its own) are not taken as proof.
    assert rayproc.start_failure(store, 1, START_OUT, "198.18.1.13", 6379, since=time.time() + 60).kind == \
        "retryable"
    os.unlink(os.path.join(logs, "gcs_server.err"))
    error = rayproc.start_failure(store, 1, START_OUT, "198.18.1.13", 6379)
    assert error.kind == "retryable" and "RuntimeError: Failed to start GCS." in error.message
    assert rayproc.start_failure(store, None, "", "198.18.1.13", 6379).message.startswith(
        "ray start did not finish within")


def test_failure_summary_is_the_exception_and_what_follows():
    assert rayargs.summarize_failure(START_OUT).startswith("RuntimeError: Failed to start GCS.")
    assert rayargs.summarize_failure("one\ntwo\n\n") == "two"
    assert rayargs.summarize_failure("") == "no output"


# The end of `ray start --head --include-dashboard=true` by Ray 2.60.0 without ray[default] (the lab's image).
NO_DASHBOARD_OUT = """\
2026-12-03 14:12:16,934\tERROR services.py:1327 -- Ray dashboard dependencies failed to install properly: No module named 'aiohttp'.
Potential causes include:
1. --include-dashboard is not supported when minimal ray is used. Download ray[default] to use the dashboard.
Traceback (most recent call last):
  File "/opt/fadenstack/ray/ray/_private/services.py", line 1335, in start_api_server
    raise Exception("Cannot include dashboard with missing packages.")
Exception: Cannot include dashboard with missing packages.
"""


def test_a_ray_without_the_dashboards_packages_is_named_as_such_with_rays_own_words():
    said = rayargs.summarize_failure(NO_DASHBOARD_OUT)
    assert said.startswith("the runtime's Ray has no dashboard packages (it is ray, not ray[default])")
    assert said.endswith("; Ray: Exception: Cannot include dashboard with missing packages.")


# ---------------------------------------------------------------- processes


def proc(pid, argv, ppid=1, sid=None):
    return rayproc.Proc(pid, ppid, sid if sid is not None else pid, "S", 100 + pid, argv)


TEMP = "/var/lib/fadenstack/ray"
SESSION = TEMP + "/session_2026-11-30_11-23-05_398143_100"


def machine_table():
    return [
        proc(10, ["/venv/lib/python3.12/site-packages/ray/core/src/ray/gcs/gcs_server",
                  "--log_dir=%s/logs" % SESSION, "--gcs_server_port=6379"], sid=100),
        proc(11, ["/venv/lib/python3.12/site-packages/ray/core/src/ray/raylet/raylet",
                  "--raylet_socket_name=%s/sockets/raylet" % SESSION, "--node_id=n1",
                  "--node_ip_address=198.18.1.11", "--temp_dir=" + TEMP, "--gcs-address=198.18.1.11:6379",
                  "--head"], sid=100),
        proc(12, ["ray::IDLE"], ppid=11, sid=12),                       # a worker: its own session
        proc(13, ["ray::DashboardAgent"], ppid=11, sid=100),
        proc(14, ["/venv/bin/python3.12", "-u", "/venv/lib/python3.12/site-packages/ray/autoscaler/_private/"
                  "monitor.py", "--logs-dir=%s/logs" % SESSION], sid=100),
        proc(20, ["tail", "-f", SESSION + "/logs/raylet.out"], sid=20),  # someone reading the logs
        proc(30, ["/usr/lib/ray/raylet", "--temp_dir=/tmp/ray", "--node_id=other"], sid=30),  # another Ray
        proc(31, ["ray::IDLE"], ppid=30, sid=31),
        proc(40, ["/usr/bin/sleep", "100"], sid=100),                    # not Ray, whatever its session
    ]


def test_ray_processes_are_those_of_this_temp_dir_and_their_workers():
    found = rayproc.ray_processes(TEMP, procs=machine_table())
    assert [p.pid for p in found] == [10, 11, 12, 13, 14]


def test_the_recorded_session_finds_ray_processes_that_do_not_name_the_temp_dir():
    table = [p for p in machine_table() if p.pid != 11]     # the raylet died; its agent lives on
    assert [p.pid for p in rayproc.ray_processes(TEMP, procs=table)] == [10, 14]
    assert [p.pid for p in rayproc.ray_processes(TEMP, sids=[100], procs=table)] == [10, 13, 14]


def test_the_node_is_read_from_its_raylets_argv():
    node = rayproc.node_from_processes(rayproc.ray_processes(TEMP, procs=machine_table()), TEMP)
    assert node == {"pid": 11, "node_id": "n1", "node_ip": "198.18.1.11",
                    "gcs_address": "198.18.1.11:6379", "head": True}
    assert rayproc.node_from_processes(machine_table()[2:], TEMP) is None


def test_this_process_is_found_among_the_machines_processes():
    child = subprocess.Popen(["sleep", "30"])
    try:
        pids = [p.pid for p in rayproc.machine_processes()]
        assert child.pid in pids and os.getpid() not in pids
    finally:
        child.kill()
        child.wait()


# ---------------------------------------------------------------- local network checks


def test_a_port_held_on_the_address_is_told_in_the_os_words():
    import socket
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        assert rayproc.port_holder_message("127.0.0.1", port) == (
            "Address already in use (port %d on 127.0.0.1)" % port)
    finally:
        holder.close()
    assert rayproc.port_holder_message("127.0.0.1", port) is None


def test_an_address_of_another_machine_is_refused():
    with pytest.raises(AgentError) as caught:
        rayproc.check_local_address("192.0.2.123")
    assert caught.value.kind == "not_retryable"
    assert "192.0.2.123 is not an address of this machine" in caught.value.message


def test_an_unanswered_head_is_unreachable():
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(AgentError) as caught:
        rayproc.check_reachable("127.0.0.1", port)
    assert caught.value.kind == "unreachable" and "Connection refused" in caught.value.message


# ---------------------------------------------------------------- drivers and the runtime


def test_no_driver_configured_is_not_retryable_with_the_install_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FADEN_AGENT_CONFIG", str(tmp_path / "absent.json"))
    code, final, _ = run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--store", str(tmp_path))
    assert code == 1 and final["kind"] == "not_retryable"
    assert final["message"] == "No container runtime on this machine: install Docker or Podman"
    code, final, _ = run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--cluster", "c1",
                             "--store", str(tmp_path))
    assert final["message"] == "No container runtime on this machine: install Docker or Podman"
    code, final, _ = run_cli(capsys, "ray", "start-head", "--address", "127.0.0.1", "--num-gpus", "8",
                             "--store", str(tmp_path))
    assert final["kind"] == "not_retryable" and final["message"].startswith(
        "The runtime is not started on this machine: run `runtime start --digest D` first")


@pytest.mark.parametrize("config, words", [
    ({"runtime_driver": "podman", "podman": {"gpus": "all"}}, "\"podman\".gpus must be \"auto\" or \"none\""),
    ({"runtime_driver": "podman", "podman": {"global_args": ["runc"]}}, "follows no option"),
    ({"runtime_driver": "docker", "docker": {"ulimits": {"nofile": [10, 5]}}}, "exceeds the hard limit"),
    ({"runtime_driver": "process"}, "\"process\" section is missing"),
    ({"runtime_driver": "process", "process": {"ray": "ray", "python": "/p"}}, "absolute path"),
    ({"runtime_driver": "process", "process": {"ray": "/r", "python": "/p", "num_cpus": 0}}, "num_cpus"),
    ({"runtime_driver": "lxc"}, "Unknown runtime driver 'lxc' in the machine config (known: process, docker, "
                                "podman)"),
])
def test_driver_config_mistakes_are_not_retryable(config, words):
    with pytest.raises(AgentError) as caught:
        runtime.load_driver(config)
    assert caught.value.kind == "not_retryable" and words in caught.value.message


def test_process_driver_reads_its_executables_and_cpu_count():
    found = runtime.load_driver({"runtime_driver": "process",
                                 "process": {"ray": "/v/bin/ray", "python": "/v/bin/python", "num_cpus": 3}})
    assert (found.ray, found.python, found.start_args()) == ("/v/bin/ray", "/v/bin/python", ["--num-cpus=3"])


def test_missing_executable_is_named(machine, capsys):
    os.unlink(str(machine["bindir"] / "ray"))
    load(machine["store"])
    code, final, _ = run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--store", machine["store"])
    assert final["kind"] == "not_retryable" and "ray executable" in final["message"]
    assert "does not exist" in final["message"]


def test_runtime_start_needs_the_loaded_image(machine, capsys):
    store = machine["store"]
    code, final, _ = run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--store", store)
    assert final["kind"] == "not_retryable" and "No runtime image is loaded" in final["message"]
    load(store, digest="cd" * 32)
    code, final, _ = run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--store", store)
    assert final["kind"] == "not_retryable" and "The loaded runtime image is cdcdcdcdcdcd" in final["message"]
    code, final, _ = run_cli(capsys, "runtime", "start", "--digest", "nothex", "--store", store)
    assert code == 2 and final["kind"] == "bad_input"


def test_runtime_start_records_the_runtime_and_is_idempotent(machine, capsys):
    store = machine["store"]
    load(store)
    code, final, _ = run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--store", store)
    assert code == 0 and final["already_running"] is False
    assert final["manifest"]["version"] == "2.0.1" and final["driver"] == "process"
    state = json.load(open(os.path.join(store, "runtime", "state.json")))
    assert state["state"] == "started" and state["digest"] == DIGEST
    code, final, _ = run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--store", store)
    assert final["already_running"] is True
    code, final, _ = run_cli(capsys, "runtime", "status", "--store", store)
    assert final["state"] == "started" and final["driver"]["name"] == "process"
    assert final["ray"]["running"] is False and final["loaded_digest"] == DIGEST
    code, final, _ = run_cli(capsys, "runtime", "stop", "--store", store)
    assert code == 0 and final["was_started"] is True and final["ray"]["stopped"] is False
    code, final, _ = run_cli(capsys, "runtime", "status", "--store", store)
    assert final["state"] == "stopped"
    load(store, digest="cd" * 32)
    code, final, _ = run_cli(capsys, "runtime", "start", "--digest", "cd" * 32, "--store", store)
    assert final["already_running"] is False and final["replaced"] is None


def test_ray_commands_need_the_runtime_started(machine, capsys):
    code, final, _ = run_cli(capsys, "ray", "join", "--head", "198.18.1.11:6379", "--address", "127.0.0.1",
                             "--num-gpus", "8", "--store", machine["store"])
    assert final["kind"] == "not_retryable" and "runtime start --digest" in final["message"]


def test_ray_command_line_refusals_are_bad_input(machine, capsys):
    code, final, _ = run_cli(capsys, "ray")
    assert code == 2 and "ray needs an action (known: start-head, join, status, stop, reach, drain)" in final["message"]
    code, final, _ = run_cli(capsys, "ray", "start-head", "--num-gpus", "8")
    assert code == 2 and "--address" in final["message"]
    code, final, _ = run_cli(capsys, "ray", "start-head", "--address", "127.0.0.1", "--num-gpus", "8",
                             "--resources", '{"GPU": 8}', "--store", machine["store"])
    assert code == 2 and "--num-gpus for GPUs" in final["message"]
    code, final, _ = run_cli(capsys, "runtime")
    assert code == 2 and "runtime needs an action" in final["message"]


def test_ray_stop_with_nothing_running_is_a_no_op(machine, capsys):
    code, final, _ = run_cli(capsys, "ray", "stop", "--store", machine["store"])
    assert code == 0 and final["stopped"] is False and final["pids"] == []


def test_the_agent_never_imports_ray():
    for module in (raycmd, rayargs, rayproc, runtime):
        source = open(module.__file__).read()
        code_lines = [line for line in source.splitlines()
                      if line.startswith(("import ", "from ")) and "ray" in line.split("#")[0]]
        assert all(line.startswith("from .") for line in code_lines), code_lines


def test_status_needs_a_node_of_that_cluster_on_this_machine(machine, capsys):
    import socket
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        head = "127.0.0.1:%d" % holder.getsockname()[1]
        code, final, _ = run_cli(capsys, "ray", "status", "--head", head, "--store", machine["store"])
    finally:
        holder.close()
    assert final["kind"] == "not_retryable" and "no Ray node runs here" in final["message"]


def test_start_head_on_a_taken_port_is_address_in_use_before_ray_runs(machine, capsys):
    import socket
    import tempfile
    # pytest's tmp_path is too long for Ray's sockets (the check above): a short store.
    machine["store"] = tempfile.mkdtemp(prefix="fs-ray-")
    load(machine["store"])
    assert run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--store", machine["store"])[0] == 0
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        code, final, _ = run_cli(capsys, "ray", "start-head", "--address", "127.0.0.1", "--port", str(port),
                                 "--num-gpus", "8", "--store", machine["store"])
    finally:
        holder.close()
    assert code == 1 and final["kind"] == "address_in_use", final
    assert final["message"].startswith("Address already in use (port %d on 127.0.0.1)" % port)
    assert not os.path.exists(os.path.join(machine["store"], "runtime", "ray-start.log"))
    shutil.rmtree(machine["store"])


def test_ray_drain_refuses_what_is_not_a_ray_node_id_before_asking_anything(machine, capsys):
    code, final, _ = run_cli(capsys, "ray", "drain", "--head", "198.18.1.11:6379", "--node-id", "lab-b; reboot",
                             "--reason", "maintenance", "--store", machine["store"])
    assert final["kind"] == "bad_input" and "is not a Ray node id" in final["message"]
    script = rayargs.DRAIN_SCRIPT
    assert "DRAIN_NODE_REASON_PREEMPTION" in script and rayargs.DRAIN_MARK.strip() in script

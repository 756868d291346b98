"""The docker and podman drivers without an engine: the command lines they
run (the engine is a recorder here), the driver chosen, Ray's paths in a
container, and the sentences of their refusals.  ``test_engines_real`` runs
the same drivers against Podman (and Docker when a daemon answers)."""

import json
import os

import pytest

from fadenstack_agent import containers, engines, rayargs, runtime
from fadenstack_agent.__main__ import main
from fadenstack_agent.containers import Engine
from fadenstack_agent.protocol import AgentError

LAB_PODMAN = {"podman": {"global_args": ["--runtime", "runc", "--cgroup-manager", "cgroupfs"],
                         "ulimits": {"nofile": 20000, "nproc": 4096}}}
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
DIGEST = "ab" * 32
STORE = "/var/lib/fadenstack"
RUNNING = json.dumps({"Status": "running", "Running": True, "Pid": 4242, "ExitCode": 0})
EXITED = json.dumps({"Status": "exited", "Running": False, "Pid": 0, "ExitCode": 3})


class Recorder:
    """Stands in for ``engines.run_engine``: records each argv, answers by subcommand."""

    def __init__(self, answers=None):
        self.calls = []
        self.answers = answers or {}

    def __call__(self, argv, timeout=engines.ENGINE_TIMEOUT):
        self.calls.append(list(argv))
        subcommand = next(part for part in argv[1:] if not part.startswith("-") and part not in (
            "runc", "cgroupfs"))
        answer = self.answers.get(subcommand, (0, "", ""))
        return answer.pop(0) if isinstance(answer, list) else answer

    def subcommands(self):
        return [argv[len(PODMAN)] if argv[:len(PODMAN)] == PODMAN else argv[1] for argv in self.calls]


class Out:
    def __init__(self):
        self.lines = []

    def log(self, message, **fields):
        self.lines.append(message)

    def progress(self, **fields):
        pass


def podman_driver(cluster="alpha", config=LAB_PODMAN, **kwargs):
    return engines.ContainerDriver.from_config("podman", config, cluster, **kwargs)


# ---------------------------------------------------------------- Ray through exec


def test_ray_runs_inside_the_clusters_container_with_its_variables_by_name(monkeypatch, tmp_path):
    for name in [n for n in os.environ if n.startswith("RAY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FADEN_AGENT_SECRETS", str(tmp_path / "clusters"))  # no token on this machine
    monkeypatch.setenv("RAY_health_check_period_ms", "2000")  # the machine's own setting for Ray: passed on
    monkeypatch.setenv("RAYON_NUM_THREADS", "4")  # not Ray's
    driver = podman_driver()
    assert driver.ray_argv("start", "--head") == PODMAN + [
        "exec", "-e", "AUTOSCALER_METRIC_PORT", "-e", "DASHBOARD_METRIC_PORT",
        "-e", "RAY_USAGE_STATS_ENABLED", "-e", "RAY_enable_metrics_collection",
        "-e", "RAY_gcs_server_request_timeout_seconds",
        "-e", "RAY_health_check_period_ms", "-e", "RAY_prestart_worker_first_driver", "fadenstack-alpha", "ray", "start", "--head"]
    assert driver.python_argv("-c", "print(1)")[-5:] == ["fadenstack-alpha", "python3", "-I", "-c", "print(1)"]
    # Once the cluster's token is on the machine, Ray's token mode and the file's path (never the token).
    from fadenstack_agent import clustersecrets
    clustersecrets.write_secrets("alpha", {"ray-token": b"x" * 32})
    for argv in (driver.ray_argv("status"), driver.python_argv("-c", "print(1)")):
        assert argv[argv.index("fadenstack-alpha") - 4:argv.index("fadenstack-alpha")] == [
            "-e", "RAY_AUTH_MODE=token", "-e", "RAY_AUTH_TOKEN_PATH=/etc/fadenstack/cluster/ray-token"]
        assert "x" * 32 not in " ".join(argv)


def test_ray_start_in_a_container_uses_the_containers_temp_dir_and_the_images_executables():
    driver = podman_driver(ray="/opt/r/bin/ray", python="/opt/r/bin/python")
    temp = driver.ray_temp_dir("/srv/faden/store")
    argv = rayargs.head_start_argv(driver, "198.18.1.11", 6379, 8, {}, temp)
    assert argv[:len(PODMAN) + 1] == PODMAN + ["exec"]
    assert argv[argv.index("fadenstack-alpha") + 1:argv.index("fadenstack-alpha") + 3] == ["/opt/r/bin/ray", "start"]
    assert "--temp-dir=/var/lib/fadenstack/ray" in argv and not any("num-cpus" in a for a in argv)
    assert rayargs.status_argv(driver, "198.18.1.11:6379")[-9:-6] == ["/opt/r/bin/python", "-I", "-c"]


def test_paths_ray_prints_in_the_container_are_the_stores_on_the_machine():
    driver = podman_driver()
    assert driver.host_path("/srv/store", "/var/lib/fadenstack/ray/session_1") == "/srv/store/ray/session_1"
    assert driver.host_path("/srv/store", "/var/lib/fadenstackish/x") == "/var/lib/fadenstackish/x"
    assert driver.host_path("/srv/store", "/tmp/ray") == "/tmp/ray"


def test_docker_execs_the_same_way_without_global_options():
    driver = engines.ContainerDriver.from_config("docker", {}, "beta")
    assert driver.ray_argv("stop")[:2] == ["docker", "exec"] and driver.ray_argv("stop")[-3:] == [
        "fadenstack-beta", "ray", "stop"]


# ---------------------------------------------------------------- start, stop, load


@pytest.mark.parametrize("vendor, cdi, engine_name, devices", [
    (None, False, "podman", []),
    ("nvidia", False, "podman", ["--device", "nvidia.com/gpu=all"]),
    ("nvidia", False, "docker", ["--gpus", "all"]),
    ("nvidia", True, "docker", ["--device", "nvidia.com/gpu=all"]),
    ("amd", False, "docker", ["--device", "/dev/kfd", "--device", "/dev/dri", "--group-add", "video"]),
])
def test_start_removes_what_other_clusters_left_then_runs_the_container(monkeypatch, vendor, cdi, engine_name,
                                                                         devices, tmp_path):
    monkeypatch.setenv("FADEN_AGENT_SECRETS", str(tmp_path / "clusters"))
    store = str(tmp_path / "store")
    ps = [{"Names": ["fadenstack-old"], "Labels": {"fadenstack.cluster": "old"}},
          {"Names": ["fadenstack-alpha"], "Labels": {"fadenstack.cluster": "alpha"}},
          {"Names": ["someone-else"], "Labels": {"fadenstack.cluster": "x"}}]
    ps_out = json.dumps(ps) if engine_name == "podman" else "\n".join(
        json.dumps(dict(row, Names=row["Names"][0], Labels="fadenstack.cluster=" + row["Labels"]
                        ["fadenstack.cluster"])) for row in ps)
    recorder = Recorder({"ps": (0, ps_out, ""), "inspect": (0, RUNNING, "")})
    monkeypatch.setattr(engines, "run_engine", recorder)
    monkeypatch.setattr(engines.ContainerDriver, "gpu_vendor", lambda self, config: vendor)
    monkeypatch.setattr(engines, "has_cdi_specs", lambda: cdi)
    monkeypatch.setattr(engines, "START_SETTLE", 0.0)
    config = dict(LAB_PODMAN, machine_name="m1")
    driver = engines.ContainerDriver.from_config(engine_name, config, "alpha")
    started = driver.start("localhost/rt:2", store, {}, config, Out())
    assert started == {"container": "fadenstack-alpha", "removed": ["fadenstack-old"]}
    prefix = PODMAN if engine_name == "podman" else ["docker"]
    assert recorder.calls[0][len(prefix):] == ["ps", "-a", "--filter", "label=fadenstack.machine=m1", "--format",
                                               "json" if engine_name == "podman" else "{{json .}}"]
    assert recorder.calls[1][len(prefix):] == ["rm", "-f", "fadenstack-old"]
    assert recorder.calls[2][len(prefix):] == ["rm", "-f", "fadenstack-alpha"]
    run = recorder.calls[3]
    ulimits = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096"] if engine_name == "podman" else []
    assert run == prefix + [
        "run", "--detach", "--name", "fadenstack-alpha", "--restart", "no", "--network", "host", "--ipc", "host",
        "--label", "fadenstack.cluster=alpha", "--label", "fadenstack.machine=m1",
        "--cap-drop", "all", "--security-opt", "no-new-privileges"] + containers.store_mounts(store) + [
        "-v", str(tmp_path / "clusters" / "alpha") + ":/etc/fadenstack/cluster:ro"] + ulimits + devices + [
        "localhost/rt:2"] + engines.KEEP_ALIVE
    # What Ray and the engines write is there before the engine mounts it; the secrets directory is 0700.
    assert all(os.path.isdir(os.path.join(store, sub)) for sub in containers.WRITABLE)
    assert os.stat(str(tmp_path / "clusters" / "alpha")).st_mode & 0o777 == 0o700
    assert recorder.subcommands()[4:] == ["inspect"]


def test_a_container_that_stops_at_once_is_refused_with_its_log(monkeypatch, tmp_path):
    recorder = Recorder({"ps": (0, "[]", ""), "inspect": (0, EXITED, ""),
                         "logs": (0, "loading the engine\n", "CUDA driver not found\n")})
    monkeypatch.setattr(engines, "run_engine", recorder)
    driver = podman_driver(config=dict(LAB_PODMAN, podman=dict(LAB_PODMAN["podman"], gpus="none")))
    with pytest.raises(AgentError) as caught:
        driver.start("localhost/rt:2", str(tmp_path), {"command": ["/opt/engine"]}, {}, Out())
    assert caught.value.kind == "not_retryable"
    assert caught.value.message == ("The runtime container fadenstack-alpha stopped right after it started (exit "
                                    "status 3); its last lines: loading the engine | CUDA driver not found")
    assert recorder.calls[recorder.subcommands().index("run")][-1] == "/opt/engine"


def test_a_run_the_engine_refuses_is_told_in_its_words(monkeypatch, tmp_path):
    recorder = Recorder({"ps": (0, "[]", ""), "run": (126, "", "Error: setrlimit `RLIMIT_NOFILE`: Operation "
                                                                "not permitted"),
                         "logs": (1, "", "Error: no such container")})
    monkeypatch.setattr(engines, "run_engine", recorder)
    with pytest.raises(AgentError) as caught:
        podman_driver(config=dict(LAB_PODMAN, podman=dict(LAB_PODMAN["podman"], gpus="none"))).start(
            "localhost/rt:2", str(tmp_path), {}, {}, Out())
    assert caught.value.message == ("podman could not start the runtime container fadenstack-alpha: Error: "
                                    "setrlimit `RLIMIT_NOFILE`: Operation not permitted")


def test_stop_stops_then_removes_and_an_absent_container_is_a_no_op(monkeypatch):
    recorder = Recorder({"inspect": [(0, RUNNING, ""), (1, "", "Error: no such container fadenstack-alpha")]})
    monkeypatch.setattr(engines, "run_engine", recorder)
    driver = podman_driver()
    assert driver.stop(Out()) is True
    assert [argv[len(PODMAN):] for argv in recorder.calls] == [
        ["inspect", "--format", "{{json .State}}", "fadenstack-alpha"], ["stop", "-t", "10", "fadenstack-alpha"],
        ["rm", "-f", "fadenstack-alpha"]]
    assert driver.stop(Out()) is False and len(recorder.calls) == 4


def test_status_of_an_exited_container_carries_its_last_log_lines(monkeypatch):
    monkeypatch.setattr(engines, "run_engine", Recorder({"inspect": (0, EXITED, ""),
                                                         "logs": (0, "one\ntwo\n", "")}))
    assert podman_driver().status() == {"name": "fadenstack-alpha", "state": "exited", "exit_code": 3,
                                        "log": "one | two"}


def test_load_streams_the_image_file_to_the_engine(tmp_path, monkeypatch):
    path = str(tmp_path / "runtime.img")
    with open(path, "wb") as fh:
        fh.write(b"ARCHIVE" * 10)
    fake = tmp_path / "podman"
    fake.write_text("#!/bin/sh\necho \"$@\" > %s/argv\ncat > %s/stdin\necho 'Loaded image: localhost/rt:2'\n"
                    % (tmp_path, tmp_path))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", "%s:%s" % (tmp_path, os.environ["PATH"]))
    engine = Engine.from_config("podman", LAB_PODMAN)
    assert engines.load_image(engine, str(tmp_path / "store"), path, DIGEST, Out()) == "localhost/rt:2"
    assert (tmp_path / "argv").read_text().split() == PODMAN[1:] + ["load"]
    assert (tmp_path / "stdin").read_bytes() == b"ARCHIVE" * 10


# ---------------------------------------------------------------- which driver


@pytest.mark.parametrize("config, requested, expected", [
    ({"runtime_driver": "process"}, "podman", "process"),     # the machine config wins (the lab)
    ({}, "podman", "podman"),
    ({}, "docker", "docker"),
    ({"runtime_driver": ""}, "docker", "docker"),
    ({}, None, None),
])
def test_the_machine_config_comes_before_what_the_console_asks_for(config, requested, expected):
    assert engines.chosen_driver(config, requested) == expected


def test_an_unknown_driver_asked_for_is_bad_input():
    with pytest.raises(AgentError) as caught:
        engines.chosen_driver({}, "lxc")
    assert caught.value.kind == "bad_input"
    assert caught.value.message == "--driver must be one of process, docker, podman, got 'lxc'"


def test_load_driver_builds_the_engine_driver_for_the_cluster_with_the_images_executables():
    driver = runtime.load_driver(LAB_PODMAN, "podman", "c7", {"ray": "/opt/r/bin/ray"})
    assert (driver.name, driver.container, driver.ray, driver.python) == ("podman", "fadenstack-c7",
                                                                          "/opt/r/bin/ray", "python3")
    with pytest.raises(AgentError) as caught:
        runtime.load_driver({}, None)
    assert caught.value.message == "No container runtime on this machine: install Docker or Podman"
    with pytest.raises(AgentError) as caught:
        runtime.load_driver({}, "podman", "c7", {"ray": "--help"})
    assert "names ray '--help', which is not an executable's path" in caught.value.message


def test_a_machine_name_in_the_config_labels_the_containers():
    assert engines.machine_name({"machine_name": "gpu-07"}) == "gpu-07"
    assert engines.MACHINE_RE.match(engines.machine_name({}))
    with pytest.raises(AgentError):
        engines.machine_name({"machine_name": "a b"})


def run_cli(capsys, *argv):
    code = main(list(argv))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    return code, lines[-1]


@pytest.mark.parametrize("cluster", ["Alpha", "a-", "a_b", "x" * 64])
def test_a_bad_cluster_name_is_bad_input_in_words(tmp_path, monkeypatch, capsys, cluster):
    monkeypatch.setenv("FADEN_AGENT_CONFIG", str(tmp_path / "absent.json"))
    code, final = run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--cluster", cluster, "--driver",
                          "podman", "--store", str(tmp_path))
    assert code == 2 and final["kind"] == "bad_input"
    assert final["message"].startswith("--cluster must be 1 to 63 lowercase letters, digits and dashes")


def test_an_engine_that_is_not_installed_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FADEN_AGENT_CONFIG", str(tmp_path / "absent.json"))
    monkeypatch.setenv("PATH", str(tmp_path))
    code, final = run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--driver", "docker",
                          "--store", str(tmp_path))
    assert final == {"event": "error", "kind": "not_retryable",
                     "message": "The runtime driver is docker, but docker is not installed on this machine"}


def test_an_image_loaded_for_the_process_driver_must_be_loaded_into_the_engine(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FADEN_AGENT_CONFIG", str(tmp_path / "absent.json"))
    monkeypatch.setattr(engines.ContainerDriver, "check", lambda self: None)
    os.makedirs(str(tmp_path / "runtime"))
    (tmp_path / "runtime" / "loaded.json").write_text(json.dumps({"digest": DIGEST, "manifest": {}}))
    code, final = run_cli(capsys, "runtime", "start", "--digest", DIGEST, "--driver", "podman",
                          "--store", str(tmp_path))
    assert final["kind"] == "not_retryable" and final["message"] == (
        "The runtime image abababababab is not loaded into podman on this machine: run `image load --digest %s "
        "--driver podman` first" % DIGEST)

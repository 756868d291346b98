"""The docker and podman drivers' command lines and the engines' answers
(``containers``): pure, no engine is run here."""

import json

import pytest

from fadenstack_agent import containers, engineoutput
from fadenstack_agent.containers import Engine
from fadenstack_agent.protocol import BAD_INPUT, NOT_RETRYABLE, AgentError

STORE = "/var/lib/fadenstack"
IMAGE = "faden-runtime:2.0.1"
COMMAND = ["sleep", "infinity"]
LAB_PODMAN = {"podman": {"global_args": ["--runtime", "runc", "--cgroup-manager", "cgroupfs"],
                         "ulimits": {"nofile": 65536, "nproc": [4096, 8192]}}}


def run(engine, **kwargs):
    params = dict(cluster="alpha", machine="lab-a", image=IMAGE, command=COMMAND, store=STORE)
    params.update(kwargs)
    return engine.run_argv(**params)


def common(engine_name):
    return [engine_name, "run", "--detach", "--name", "fadenstack-alpha", "--restart", "no",
            "--network", "host", "--ipc", "host",
            "--label", "fadenstack.cluster=alpha", "--label", "fadenstack.machine=lab-a",
            "--cap-drop", "all", "--security-opt", "no-new-privileges",
            "-v", STORE + ":/var/lib/fadenstack:ro",
            "-v", STORE + "/ray:/var/lib/fadenstack/ray", "-v", STORE + "/cr:/var/lib/fadenstack/cr",
            "-v", STORE + "/copies/out:/var/lib/fadenstack/copies/out",
            "-v", STORE + "/allreduce:/var/lib/fadenstack/allreduce"]


# ---------------------------------------------------------------- run


def test_the_container_runs_with_least_privilege_the_store_read_only_and_the_secrets_read_only():
    argv = run(Engine("podman"), secrets_dir="/etc/fadenstack/clusters/alpha")
    assert argv[argv.index("--cap-drop") + 1] == "all"
    assert [argv[i + 1] for i, word in enumerate(argv) if word == "--cap-add"] == list(containers.CAPABILITIES)
    assert argv[argv.index("--security-opt") + 1] == "no-new-privileges"
    mounts = [argv[i + 1] for i, word in enumerate(argv) if word == "-v"]
    assert mounts[0] == STORE + ":/var/lib/fadenstack:ro"
    assert mounts[-1] == "/etc/fadenstack/clusters/alpha:/etc/fadenstack/cluster:ro"
    writable = [m for m in mounts if not m.endswith(":ro")]
    # Only what Ray and the engines write; never the agent's records (runtime/, copies/*.json).
    assert sorted(m.split(":")[0][len(STORE) + 1:] for m in writable) == sorted(containers.WRITABLE)
    assert not any(m.startswith(STORE + "/runtime") or m.split(":")[0] == STORE + "/copies" for m in writable)
    with pytest.raises(AgentError):
        run(Engine("podman"), secrets_dir="relative/dir")
    with pytest.raises(AgentError):
        run(Engine("podman"), secrets_dir="/etc/a:/etc")


def test_exec_gives_ray_s_token_mode_and_path_by_value_and_nothing_else():
    argv = Engine("podman").exec_argv("alpha", ["ray", "status"], ["RAY_X"], settings=containers.ray_auth_env())
    assert argv[argv.index("-e") + 1] == "RAY_X"
    assert "RAY_AUTH_MODE=token" in argv and "RAY_AUTH_TOKEN_PATH=/etc/fadenstack/cluster/ray-token" in argv
    with pytest.raises(AgentError):
        Engine("podman").exec_argv("alpha", ["ray"], settings={"HF_TOKEN": "secret"})
    with pytest.raises(AgentError):
        Engine("podman").exec_argv("alpha", ["ray"], settings={"RAY_AUTH_MODE": "token\n-e X=1"})


@pytest.mark.parametrize("engine_name", ["docker", "podman"])
def test_a_machine_without_gpus_runs_the_container_with_no_device_options(engine_name):
    assert run(Engine(engine_name)) == common(engine_name) + [IMAGE] + COMMAND


def test_docker_hands_nvidia_gpus_over_with_gpus_all():
    assert run(Engine("docker"), gpu="nvidia") == common("docker") + ["--gpus", "all", IMAGE] + COMMAND


def test_docker_hands_nvidia_gpus_over_through_cdi_when_the_machine_has_the_specs():
    argv = run(Engine("docker"), gpu="nvidia", cdi=True)
    assert argv == common("docker") + ["--device", "nvidia.com/gpu=all", IMAGE] + COMMAND
    assert "--gpus" not in argv


@pytest.mark.parametrize("cdi", [False, True])
def test_podman_always_hands_nvidia_gpus_over_through_cdi(cdi):
    argv = run(Engine("podman"), gpu="nvidia", cdi=cdi)
    assert argv == common("podman") + ["--device", "nvidia.com/gpu=all", IMAGE] + COMMAND


@pytest.mark.parametrize("engine_name", ["docker", "podman"])
def test_amd_gpus_are_the_kfd_and_dri_devices_with_the_video_group(engine_name):
    argv = run(Engine(engine_name), gpu="amd")
    assert argv == common(engine_name) + ["--device", "/dev/kfd", "--device", "/dev/dri",
                                          "--group-add", "video", IMAGE] + COMMAND
    assert "seccomp=unconfined" not in argv


def test_an_unknown_gpu_vendor_is_refused():
    with pytest.raises(AgentError) as exc:
        run(Engine("docker"), gpu="intel")
    assert exc.value.kind == BAD_INPUT and "intel" in exc.value.message


def test_the_command_follows_the_image_unchanged_even_when_it_looks_like_options():
    argv = run(Engine("docker"), command=["ray", "start", "--head", "--block", "; rm -rf /"])
    assert argv[-6:] == [IMAGE, "ray", "start", "--head", "--block", "; rm -rf /"]


@pytest.mark.parametrize("cluster", ["", "Alpha", "al_pha", "-alpha", "alpha-", "a" * 64, "a b",
                                     "alpha;rm", "../x", None, 7])
def test_bad_cluster_names_are_refused_as_bad_input(cluster):
    with pytest.raises(AgentError) as exc:
        run(Engine("podman"), cluster=cluster)
    assert exc.value.kind == BAD_INPUT


@pytest.mark.parametrize("cluster", ["a", "alpha-2", "x" * 63, "0"])
def test_cluster_slugs_of_up_to_63_characters_name_the_container(cluster):
    assert containers.container_name(cluster) == "fadenstack-" + cluster


@pytest.mark.parametrize("field,value", [("machine", ""), ("machine", "lab a"), ("machine", "-x"),
                                         ("image", ""), ("image", "--privileged"), ("image", "a b"),
                                         ("command", []), ("command", "sleep 1"), ("command", [""]),
                                         ("store", "relative/store"), ("store", "/a:/etc"),
                                         ("store", "/a,ro")])
def test_bad_machine_image_command_or_store_is_refused(field, value):
    with pytest.raises(AgentError) as exc:
        run(Engine("docker"), **{field: value})
    assert exc.value.kind == BAD_INPUT


def test_environment_variables_are_passed_by_name_and_their_values_only_in_the_engines_environment():
    secrets = {"HF_TOKEN": "hf_secret_value", "FADEN_JOIN_KEY": "s3cr3t"}
    argv = run(Engine("docker"), env_names=sorted(secrets))
    assert argv[argv.index("-e"):argv.index("-e") + 4] == ["-e", "FADEN_JOIN_KEY", "-e", "HF_TOKEN"]
    joined = " ".join(argv)
    assert all(value not in joined for value in secrets.values())
    env = containers.engine_environ(secrets, base={"PATH": "/usr/bin"})
    assert env == {"PATH": "/usr/bin", "HF_TOKEN": "hf_secret_value", "FADEN_JOIN_KEY": "s3cr3t"}


def test_a_name_with_a_value_is_refused_without_repeating_the_value():
    with pytest.raises(AgentError) as exc:
        run(Engine("docker"), env_names=["HF_TOKEN=hf_secret_value"])
    assert exc.value.kind == BAD_INPUT
    assert "hf_secret_value" not in exc.value.message and "HF_TOKEN" in exc.value.message


@pytest.mark.parametrize("name", ["1X", "A-B", "", "A B"])
def test_bad_environment_names_are_refused(name):
    with pytest.raises(AgentError):
        containers.engine_environ({name: "v"}, base={})


def test_host_ipc_takes_no_shared_memory_size_because_podman_refuses_both():
    with pytest.raises(AgentError) as exc:
        run(Engine("podman"), shm_size_mib=1024)
    assert exc.value.kind == BAD_INPUT and "/dev/shm" in exc.value.message


def test_private_ipc_carries_the_shared_memory_size_ray_advises():
    size = containers.ray_shm_size_mib(64 * 1024 ** 3)
    assert size == int(64 * 1024 * 0.3)
    argv = run(Engine("docker"), ipc="private", shm_size_mib=size)
    at = argv.index("--ipc")
    assert argv[at:at + 4] == ["--ipc", "private", "--shm-size", "%dm" % size]


@pytest.mark.parametrize("kwargs", [{"ipc": "private"}, {"ipc": "private", "shm_size_mib": 1},
                                    {"ipc": "none"}, {"ipc": "private", "shm_size_mib": True}])
def test_private_ipc_needs_a_sane_size_and_other_modes_are_refused(kwargs):
    with pytest.raises(AgentError):
        run(Engine("docker"), **kwargs)


def test_ray_shm_size_has_a_floor_and_refuses_nonsense():
    assert containers.ray_shm_size_mib(100 * 1024 ** 2) == 64
    for bad in (0, -1, True, "8G"):
        with pytest.raises(AgentError):
            containers.ray_shm_size_mib(bad)


# ---------------------------------------------------------------- engine settings


def test_the_labs_podman_puts_its_global_options_first_and_its_ulimits_on_run():
    engine = Engine.from_config("podman", LAB_PODMAN)
    argv = run(engine)
    assert argv[:6] == ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs", "run"]
    at = argv.index("--ulimit")
    assert argv[at:at + 4] == ["--ulimit", "nofile=65536:65536", "--ulimit", "nproc=4096:8192"]
    assert engine.stop_argv("alpha")[:6] == ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs",
                                             "stop"]
    assert engine.load_argv("/s/image.tar")[5:] == ["load", "-i", "/s/image.tar"]


def test_without_a_section_the_engine_runs_plain():
    engine = Engine.from_config("podman", {"podman": None})
    assert engine.global_args == [] and engine.ulimit_args == []
    assert Engine.from_config("docker", LAB_PODMAN).argv("ps") == ["docker", "ps"]


@pytest.mark.parametrize("global_args", [["run"], ["--runtime", "runc", "run"], ["--runtime=runc", "x"],
                                         "--runtime runc", [""], ["--log-level", 3], ["--a\nb"]])
def test_global_args_that_are_not_options_are_refused(global_args):
    with pytest.raises(AgentError) as exc:
        Engine.from_config("podman", {"podman": {"global_args": global_args}})
    assert exc.value.kind == NOT_RETRYABLE


def test_global_args_accept_both_option_spellings():
    engine = Engine("podman", ["--runtime=runc", "--cgroup-manager", "cgroupfs", "--log-level", "warn"])
    assert engine.argv("ps")[-1] == "ps"


@pytest.mark.parametrize("ulimits", [{"nofiles": 10}, {"nofile": "10"}, {"nofile": [20, 10]},
                                     {"nofile": [1, 2, 3]}, {"nofile": -2}, {"nofile": True},
                                     {"nofile": [-1, 10]}, [10]])
def test_bad_ulimits_are_refused_with_the_config_path(ulimits):
    with pytest.raises(AgentError) as exc:
        Engine.from_config("podman", {"podman": {"ulimits": ulimits}})
    assert exc.value.kind == NOT_RETRYABLE and "\"podman\"" in exc.value.message


def test_unlimited_is_minus_one():
    assert Engine("docker", ulimits={"memlock": -1}).ulimit_args == ["--ulimit", "memlock=-1:-1"]


def test_an_unknown_engine_is_refused():
    with pytest.raises(AgentError):
        Engine("lxc")


# ---------------------------------------------------------------- other commands


@pytest.mark.parametrize("engine_name", ["docker", "podman"])
def test_load_stop_rm_inspect_logs_and_ps(engine_name):
    engine = Engine(engine_name)
    assert engine.load_argv("/store/images/ab.tar") == [engine_name, "load", "-i", "/store/images/ab.tar"]
    assert engine.stop_argv("alpha", 20) == [engine_name, "stop", "-t", "20", "fadenstack-alpha"]
    assert engine.rm_argv("alpha") == [engine_name, "rm", "-f", "fadenstack-alpha"]
    assert engine.rm_argv(name="fadenstack-beta") == [engine_name, "rm", "-f", "fadenstack-beta"]
    assert engine.inspect_argv("alpha") == [engine_name, "inspect", "--format", "{{json .State}}",
                                            "fadenstack-alpha"]
    assert engine.logs_argv("alpha", 40) == [engine_name, "logs", "--tail", "40", "fadenstack-alpha"]
    fmt = "{{json .}}" if engine_name == "docker" else "json"
    assert engine.ps_argv() == [engine_name, "ps", "-a", "--filter", "label=fadenstack.cluster",
                                "--format", fmt]


def test_rm_by_name_removes_only_fadenstack_containers():
    for name in ("postgres", "fadenstack-", "fadenstack-Bad", "-f"):
        with pytest.raises(AgentError):
            Engine("docker").rm_argv(name=name)


@pytest.mark.parametrize("call", [lambda e: e.stop_argv("alpha", -1), lambda e: e.stop_argv("alpha", 1.5),
                                  lambda e: e.logs_argv("alpha", 0), lambda e: e.logs_argv("alpha", 10 ** 6),
                                  lambda e: e.load_argv("image.tar"), lambda e: e.inspect_argv("A")])
def test_bad_arguments_of_the_other_commands_are_refused(call):
    with pytest.raises(AgentError) as exc:
        call(Engine("podman"))
    assert exc.value.kind == BAD_INPUT


# ---------------------------------------------------------------- load output


@pytest.mark.parametrize("output,refs", [
    ("Loaded image: faden-runtime:2.0.1\n", ["faden-runtime:2.0.1"]),
    ("Loaded image ID: sha256:" + "ab" * 32 + "\n", ["sha256:" + "ab" * 32]),
    ("Loaded image: a:1\nLoaded image: a:latest\n", ["a:1", "a:latest"]),
    ("Getting image source signatures\nCopying blob 5f70bf18a086 done\nCopying config 1c2d done\n"
     "Writing manifest to image destination\nStoring signatures\n"
     "Loaded image: localhost/faden-runtime:2.0.1\n",
     ["localhost/faden-runtime:2.0.1"]),
    ("Loaded image(s): localhost/a:1,localhost/a:latest\n", ["localhost/a:1", "localhost/a:latest"]),
])
def test_the_loaded_image_is_read_from_either_engines_output(output, refs):
    assert engineoutput.parse_loaded(output) == refs


@pytest.mark.parametrize("output", ["", "open image.tar: no such file or directory\n",
                                    "Error: payload does not match any of the supported image formats"])
def test_load_output_without_an_image_is_an_error_in_the_engines_words(output):
    with pytest.raises(AgentError) as exc:
        engineoutput.parse_loaded(output)
    assert exc.value.kind == NOT_RETRYABLE
    assert output.strip() in exc.value.message and "load" in exc.value.message


# ---------------------------------------------------------------- inspect output

DOCKER_STATE = {"Status": "exited", "Running": False, "Paused": False, "Restarting": False,
                "OOMKilled": False, "Dead": False, "Pid": 0, "ExitCode": 137, "Error": "",
                "StartedAt": "2026-12-01T07:00:00.123456789Z", "FinishedAt": "2026-12-01T07:05:00.5Z"}
PODMAN_STATE = {"OciVersion": "1.0.2-dev", "Status": "running", "Running": True, "Paused": False,
                "Restarting": False, "OOMKilled": False, "Dead": False, "Pid": 4242, "ConmonPid": 4240,
                "ExitCode": 0, "Error": "", "StartedAt": "2026-12-01T07:00:00.123456789+00:00",
                "FinishedAt": "0001-01-01T00:00:00Z", "Health": {"Status": "", "FailingStreak": 0},
                "CgroupPath": "/libpod_parent/libpod-abc", "CheckpointedAt": "0001-01-01T00:00:00Z"}


def test_docker_state_of_a_killed_container():
    state = engineoutput.parse_state(json.dumps(DOCKER_STATE) + "\n")
    assert state == {"status": "exited", "running": False, "exit_code": 137,
                     "started_at": "2026-12-01T07:00:00.123456789Z", "finished_at": "2026-12-01T07:05:00.5Z",
                     "error": "", "oom_killed": False, "pid": None}


def test_podman_state_of_a_running_container():
    state = engineoutput.parse_state(json.dumps(PODMAN_STATE))
    assert state["status"] == "running" and state["running"] is True and state["exit_code"] == 0
    assert state["started_at"] == "2026-12-01T07:00:00.123456789+00:00"


@pytest.mark.parametrize("output", ["", "<no value>", "Error: no such container fadenstack-alpha", "[]",
                                    "{\"Running\": true}", "[1, 2]", "null"])
def test_inspect_garbage_is_an_error_in_the_engines_words(output):
    with pytest.raises(AgentError) as exc:
        engineoutput.parse_state(output)
    assert (output.strip() or "(nothing)") in exc.value.message


@pytest.mark.parametrize("output,missing", [
    ("Error: No such object: fadenstack-alpha", True),
    ("Error response from daemon: No such container: fadenstack-alpha", True),
    ("Error: no such container fadenstack-alpha", True),
    ("Error: inspecting object: no such container \"fadenstack-alpha\"", True),
    ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock", False),
])
def test_a_missing_container_is_told_apart_from_a_failing_engine(output, missing):
    assert engineoutput.is_no_such_container(output) is missing


# ---------------------------------------------------------------- ps output

DOCKER_PS = "\n".join(json.dumps(row) for row in [
    {"Command": "\"ray start\"", "ID": "1a2b", "Image": IMAGE, "Labels":
     "fadenstack.machine=lab-a,fadenstack.cluster=alpha", "Names": "fadenstack-alpha", "State": "running"},
    {"ID": "3c4d", "Labels": "fadenstack.cluster=beta,fadenstack.machine=lab-a", "Names": "fadenstack-beta",
     "State": "exited"},
]) + "\n"
PODMAN_PS = json.dumps([
    {"Id": "1a2b", "Names": ["fadenstack-alpha"], "State": "running",
     "Labels": {"fadenstack.cluster": "alpha", "fadenstack.machine": "lab-a"}},
    {"Id": "3c4d", "Names": ["fadenstack-beta"], "Labels": {"fadenstack.cluster": "beta"}, "State": "exited"},
    {"Id": "5e6f", "Names": ["someone-elses"], "Labels": {"fadenstack.cluster": "gamma"}, "State": "exited"},
], indent=4)


def test_docker_ps_lines_give_names_and_cluster_labels():
    assert engineoutput.parse_ps(DOCKER_PS) == [("fadenstack-alpha", "alpha"), ("fadenstack-beta", "beta")]


def test_podman_ps_array_gives_names_and_cluster_labels():
    found = engineoutput.parse_ps(PODMAN_PS)
    assert found == [("fadenstack-alpha", "alpha"), ("fadenstack-beta", "beta"), ("someone-elses", "gamma")]


@pytest.mark.parametrize("output", ["", "[]", "\n"])
def test_no_containers_is_an_empty_list(output):
    assert engineoutput.parse_ps(output) == []


def test_what_other_clusters_left_is_removed_and_foreign_names_are_left_alone():
    found = engineoutput.parse_ps(PODMAN_PS)
    assert engineoutput.left_by_others(found, "alpha") == ["fadenstack-beta"]
    assert [Engine("podman").rm_argv(name=n) for n in engineoutput.left_by_others(found, "alpha")] == [
        ["podman", "rm", "-f", "fadenstack-beta"]]
    assert engineoutput.left_by_others(found, "beta") == ["fadenstack-alpha"]


@pytest.mark.parametrize("output", ["CONTAINER ID  IMAGE  COMMAND\n1a2b  x  y", "{\"Names\": 3}",
                                    "[{\"Id\": \"x\"}]", "{\"Names\": []}", "Error: something broke",
                                    "null", "[1]", "5"])
def test_ps_garbage_is_an_error_in_the_engines_words(output):
    with pytest.raises(AgentError) as exc:
        engineoutput.parse_ps(output)
    assert "ps" in exc.value.message and output.strip()[:20] in exc.value.message

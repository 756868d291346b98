"""``copy start|stop|list|logs`` and the lab's engine (``lab/stubs/vllm``), without a lab: the spec's
refusals in words, the command lines for Docker and Podman, and the real agent starting the real
engine as a process on 127.0.0.1 (the ``process`` driver) on the lab hub's small model, generated on
first use under ~/.cache/fadenstack-lab/hub. The engine runs with /usr/bin/python3, as in the runtime
image. ``test_copies_real`` starts copies in containers of a real Podman and Docker."""

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from fadenstack_agent import copies, copyproc
from fadenstack_agent.containers import Engine
from fadenstack_agent.protocol import AgentError
from lab.hub_models import MODELS, ModelStore
from tests.agent.imagehelpers import Machine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = os.path.join(REPO, "lab", "stubs", "vllm")
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
TINY = "fadenstack-lab/tiny-chat"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model():
    """The lab hub's small model as a directory of its files (config.json, tokenizer, model.safetensors)."""
    files = ModelStore().files(MODELS[TINY])
    return str(files["config.json"].local_path.parent)


def argv_for(model_dir, port, *extra, host="127.0.0.1", name="tiny", tp=1):
    return ["vllm", "serve", model_dir, "--host", host, "--port", str(port), "--served-model-name", name,
            "--tensor-parallel-size", str(tp)] + list(extra)


def spec_for(model_dir, port=None, copy="d7-c3", gpus="0", **extra):
    port = port or free_port()
    return dict({"copy": copy, "cluster": "gpu-room", "argv": argv_for(model_dir, port, tp=len(gpus.split(","))),
                 "env": {"CUDA_VISIBLE_DEVICES": gpus}, "port": port, "address": "127.0.0.1"}, **extra)


# ------------------------------------------------------------------ the spec


GOOD = {"copy": "d7-c3", "cluster": "gpu-room", "argv": ["vllm", "serve", "/m", "--host", "198.18.1.11", "--port", "8100"],
        "env": {"CUDA_VISIBLE_DEVICES": "0,1"}, "port": 8100, "address": "198.18.1.11"}


def test_a_good_spec_passes_as_it_came():
    assert copies.check_spec(dict(GOOD)) == GOOD
    with_equals = dict(GOOD, argv=["vllm", "serve", "/m", "--host=198.18.1.11", "--port=8100"])
    assert copies.check_spec(with_equals)["argv"] == with_equals["argv"]


@pytest.mark.parametrize("change, words", [
    ({"copy": "D7_c3"}, "the copy id must be 1 to 64 lowercase letters, digits and dashes"),
    ({"copy": "-d7"}, "not starting or ending with a dash"),
    ({"copy": None}, "got null"),
    ({"cluster": "Gpu Room"}, "the cluster must be 1 to 63 lowercase letters"),
    ({"argv": "vllm serve /m"}, "argv must be a list of 2 to 512 strings"),
    ({"argv": ["vllm"]}, "argv must be a list of 2 to 512 strings"),
    ({"argv": ["python3", "-m", "vllm", "--host", "198.18.1.11", "--port", "8100"]},
     'argv[0] must be the engine vllm, got "python3"'),
    ({"argv": ["vllm", "serve", "/m\0", "--host", "198.18.1.11", "--port", "8100"]}, "argv[2] must be a string"),
    ({"argv": ["vllm", "serve", 7, "--host", "198.18.1.11", "--port", "8100"]}, "argv[2] must be a string"),
    ({"argv": ["vllm", "serve", "/m", "--host", "198.18.1.11", "--port", "8101"]},
     "argv must bind the engine where the spec says: --port 8100, not 8101"),
    ({"argv": ["vllm", "serve", "/m", "--port", "8100"]},
     "argv must bind the engine where the spec says: --host 198.18.1.11, not no --host"),
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, 'the variable "LD_PRELOAD" is not one a copy may be given'),
    ({"env": {"PATH": "/tmp"}}, 'the variable "PATH" is not one a copy may be given'),
    ({"env": {"VLLM_X": 1}}, "the value of VLLM_X must be a string"),
    ({"env": {"NCCL_DEBUG": "a\0b"}}, "the value of NCCL_DEBUG must be a string of at most 4096 characters without NUL"),
    ({"env": ["CUDA_VISIBLE_DEVICES=0"]}, "env must be an object"),
    ({"port": 80}, "port must be a whole number from 1024 to 65535, got 80"),
    ({"port": "8100"}, 'port must be a whole number from 1024 to 65535, got "8100"'),
    ({"port": True}, "port must be a whole number"),
    ({"address": "lab-a"}, 'address must be an IP address of this machine, got "lab-a"'),
    ({"token": "hf_x"}, "the copy spec has unknown keys: token"),
])
def test_each_refusal_of_a_spec_says_which_field_and_why(change, words):
    with pytest.raises(AgentError) as refused:
        copies.check_spec(dict(GOOD, **change))
    assert refused.value.kind == "bad_input"
    assert words in refused.value.message


@pytest.mark.parametrize("env, gpus", [({"CUDA_VISIBLE_DEVICES": "4,5"}, [4, 5]), ({"HIP_VISIBLE_DEVICES": "2"}, [2]),
                                        ({"NCCL_DEBUG": "INFO"}, None), ({"CUDA_VISIBLE_DEVICES": "GPU-1f2e"}, None)])
def test_copy_list_reports_the_gpus_a_copys_environment_shows_it_or_none(env, gpus):
    assert copies.visible_gpus(env) == gpus


def test_visible_device_and_engine_variables_are_allowed():
    allowed = {"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "1", "ROCR_VISIBLE_DEVICES": "1",
               "VLLM_ATTENTION_BACKEND": "FLASHINFER", "NCCL_SOCKET_IFNAME": "eth1", "HF_HUB_OFFLINE": "1"}
    assert copies.check_spec(dict(GOOD, env=allowed))["env"] == allowed


def test_a_spec_that_is_not_json_or_absent_is_bad_input_through_the_command_line(tmp_path):
    machine = Machine(tmp_path, "gpu-a")
    code, events = machine.run(["copy", "start"], stdin=b"{not json}")
    assert code == 2 and events[-1]["kind"] == "bad_input" and "not valid JSON" in events[-1]["message"]
    code, events = machine.run(["copy", "start"], stdin=b"[]")
    assert code == 2 and "must be one JSON object" in events[-1]["message"]


# ------------------------------------------------------------------ the command lines


def test_a_podman_copy_is_exec_detached_in_the_clusters_container_with_variables_by_name():
    engine = Engine("podman", ["--runtime", "runc", "--cgroup-manager", "cgroupfs"])
    argv = copyproc.launch_argv("/srv/store", "d7-c3", engine, "gpu-room", GOOD["argv"],
                                {"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1"})
    assert argv == ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs", "exec", "--detach",
                    "-e", "CUDA_VISIBLE_DEVICES", "-e", "NCCL_DEBUG", "fadenstack-gpu-room",
                    "sh", "-c", copyproc.LAUNCH, "fadenstack-copy", "/var/lib/fadenstack/copies/out/d7-c3.pid",
                    "/var/lib/fadenstack/copies/out/d7-c3.log"] + GOOD["argv"]
    assert not any("0,1" in word or "INFO" in word for word in argv)     # values never on a command line


def test_a_docker_copy_is_the_same_command_without_global_options():
    argv = copyproc.launch_argv("/var/lib/fadenstack", "c1", Engine("docker"), "alpha", ["vllm", "serve", "/m"],
                                {"CUDA_VISIBLE_DEVICES": "3"})
    assert argv[:6] == ["docker", "exec", "--detach", "-e", "CUDA_VISIBLE_DEVICES", "fadenstack-alpha"]
    assert argv[-3:] == ["vllm", "serve", "/m"]


def test_the_launch_script_writes_its_pid_and_becomes_the_engine_with_its_arguments_untouched(tmp_path):
    pidfile, log = str(tmp_path / "c.pid"), str(tmp_path / "c.log")
    weird = "$(touch %s) ; 'quoted' \"double\"" % (tmp_path / "pwned")
    proc = subprocess.run(["sh", "-c", copyproc.LAUNCH, "fadenstack-copy", pidfile, log, "sh", "-c",
                           'echo "pid $$"; printf "%s\\n" "$1"', "sh", weird], timeout=10)
    assert proc.returncode == 0
    pid = open(pidfile).read().strip()
    assert open(log).read().splitlines() == ["pid " + pid, weird]        # the same process, the word as given
    assert not (tmp_path / "pwned").exists()


# ------------------------------------------------------------------ the agent and the engine, as processes


@pytest.fixture
def machine(tmp_path):
    """A machine on the process driver with its runtime started, the lab's engine as its vllm, a fast pace."""
    machine = Machine(tmp_path, "gpu-a")
    config = {"runtime_driver": "process", "engine_env": {"FADEN_LAB_ENGINE_PACE": "2000"},
              "process": {"ray": sys.executable, "python": sys.executable, "vllm": ENGINE}}
    os.makedirs(os.path.join(machine.store, "runtime"))
    with open(machine.env["FADEN_AGENT_CONFIG"], "w") as fh:
        json.dump(config, fh)
    with open(os.path.join(machine.store, "runtime", "state.json"), "w") as fh:
        json.dump({"state": "started", "driver": "process", "cluster": "default"}, fh)
    yield machine
    for record in copyproc.read_records(machine.store):
        copyproc.stop_copy(record, config, 2.0)


def agent(machine, *args, stdin=b""):
    code, events = machine.run(list(args), stdin=stdin)
    return code, events[-1]


def cmdline(pid):
    with open("/proc/%d/cmdline" % pid, "rb") as fh:
        return [part.decode() for part in fh.read().split(b"\0") if part]


def test_a_copy_starts_detached_with_the_configured_engine_answers_and_stops(machine, tiny_model):
    spec = spec_for(tiny_model, gpus="0,1")
    code, started = agent(machine, "copy", "start", stdin=spec)
    assert code == 0, started
    assert (started["running"], started["already"], started["driver"], started["copy"]) == (True, False, "process", "d7-c3")
    assert started["pid"] == started["host_pid"] and started["argv"] == spec["argv"]
    assert started["env_names"] == ["CUDA_VISIBLE_DEVICES", "FADEN_LAB_ENGINE_PACE"]
    assert cmdline(started["pid"])[1:] == [ENGINE] + spec["argv"][1:]       # the machine's vllm for `vllm`
    assert os.getsid(started["pid"]) == started["pid"]                       # a session of its own
    with open(copyproc.record_path(machine.store, "d7-c3")) as fh:
        record = json.load(fh)
    assert "0,1" not in json.dumps(record) and os.stat(copyproc.record_path(machine.store, "d7-c3")).st_mode & 0o077 == 0
    assert record["gpus"] == [0, 1]  # the GPUs it was shown, as indices (no variable's value is kept)

    code, listed = agent(machine, "copy", "list")
    (shown,) = listed["copies"]
    assert (shown["running"], shown["healthy"], shown["log"], shown["port"]) == (True, True, None, spec["port"])
    assert (shown["gpus"], shown["cluster"], shown["argv"]) == ([0, 1], "gpu-room", spec["argv"])  # Look for them reads these
    code, logs = agent(machine, "copy", "logs", "--copy", "d7-c3", "--lines", "400")
    assert "INFO:     Application startup complete." in logs["lines"] and logs["running"] is True
    assert any("tokens come at 2000 tokens/s per request" in line for line in logs["lines"])   # engine_env reached it

    code, stopped = agent(machine, "copy", "stop", "--copy", "d7-c3")
    assert code == 0 and stopped["stopped"] is True and stopped["forced"] is False
    assert copyproc.read_proc(started["pid"]) is None
    assert agent(machine, "copy", "list")[1]["copies"] == []
    code, again = agent(machine, "copy", "stop", "--copy", "d7-c3")
    assert code == 0 and again["stopped"] is False
    assert agent(machine, "copy", "logs", "--copy", "d7-c3")[1]["lines"][-1].endswith("Finished server process [%d]"
                                                                                      % started["pid"])


def test_starting_the_same_spec_again_is_a_no_op_and_another_spec_is_refused(machine, tiny_model):
    spec = spec_for(tiny_model)
    code, first = agent(machine, "copy", "start", stdin=spec)
    assert code == 0, first
    code, second = agent(machine, "copy", "start", stdin=spec)
    assert code == 0 and second["already"] is True and second["pid"] == first["pid"]
    other = dict(spec, env={"CUDA_VISIBLE_DEVICES": "1"})
    code, refused = agent(machine, "copy", "start", stdin=other)
    assert (code, refused["kind"]) == (1, "not_retryable")
    assert refused["message"] == ("Copy d7-c3 already runs on this machine with another spec (pid %d, port %d): "
                                  "`copy stop --copy d7-c3` first" % (first["pid"], spec["port"]))
    assert agent(machine, "copy", "stop", "--copy", "d7-c3")[0] == 0
    code, restarted = agent(machine, "copy", "start", stdin=other)
    assert code == 0 and restarted["already"] is False and restarted["pid"] != first["pid"]
    assert os.path.exists(copyproc.log_path(machine.store, "d7-c3") + ".1")        # the first start's log, kept


def test_a_taken_port_is_address_in_use_before_anything_starts(machine, tiny_model):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        spec = spec_for(tiny_model, port=holder.getsockname()[1])
        code, refused = agent(machine, "copy", "start", stdin=spec)
        assert (code, refused["kind"]) == (1, "address_in_use")
        assert refused["message"].startswith("Port %d on 127.0.0.1 is in use: " % spec["port"])
        assert not os.path.exists(copyproc.record_path(machine.store, "d7-c3"))
    finally:
        holder.close()
    code, first = agent(machine, "copy", "start", stdin=spec)
    assert code == 0
    code, refused = agent(machine, "copy", "start", stdin=dict(spec, copy="d7-c4"))
    assert refused["kind"] == "address_in_use" and "(held by copy d7-c3)" in refused["message"]
    elsewhere = spec_for(tiny_model, copy="d7-c5")
    elsewhere.update(address="192.0.2.1", argv=argv_for(tiny_model, elsewhere["port"], host="192.0.2.1"))
    code, refused = agent(machine, "copy", "start", stdin=elsewhere)
    assert refused["kind"] == "not_retryable" and "192.0.2.1 is not an address of this machine" in refused["message"]


def test_an_engine_that_refuses_its_model_fails_the_start_in_its_own_words_and_lists_them(machine, tmp_path):
    spec = spec_for(str(tmp_path / "no-model"))
    code, refused = agent(machine, "copy", "start", stdin=spec)
    assert (code, refused["kind"]) == (1, "not_retryable")
    assert refused["message"].startswith("The engine of copy d7-c3 ended right after it started; its last lines: ")
    assert "is not a valid model: no such directory" in refused["message"]
    (shown,) = agent(machine, "copy", "list")[1]["copies"]
    assert shown["running"] is False and shown["healthy"] is False and "no such directory" in shown["log"]


def test_a_copy_that_died_is_listed_not_running_with_its_last_words_and_stops_quietly(machine, tiny_model):
    code, started = agent(machine, "copy", "start", stdin=spec_for(tiny_model))
    os.kill(started["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while copyproc.read_proc(started["pid"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    (shown,) = agent(machine, "copy", "list")[1]["copies"]
    assert (shown["running"], shown["healthy"]) == (False, False)
    assert "Application startup complete." in shown["log"]
    code, stopped = agent(machine, "copy", "stop", "--copy", "d7-c3")
    assert code == 0 and stopped["stopped"] is False


def test_an_engine_that_ignores_sigterm_is_killed_after_the_timeout(machine, tmp_path):
    stubborn = tmp_path / "vllm"
    stubborn.write_text("#!/bin/sh\ntrap '' TERM\necho ignoring TERM\nsleep 60 & wait $!\nsleep 60\n")
    stubborn.chmod(0o755)
    with open(machine.env["FADEN_AGENT_CONFIG"]) as fh:
        config = json.load(fh)
    config["process"]["vllm"] = str(stubborn)
    with open(machine.env["FADEN_AGENT_CONFIG"], "w") as fh:
        json.dump(config, fh)
    code, started = agent(machine, "copy", "start", stdin=spec_for("/m"))
    assert code == 0, started
    code, stopped = agent(machine, "copy", "stop", "--copy", "d7-c3", "--timeout", "0.5")
    assert code == 0 and stopped["stopped"] is True and stopped["forced"] is True
    assert copyproc.read_proc(started["pid"]) is None


def test_runtime_stop_ends_the_process_drivers_copies_and_clears_their_records(machine, tiny_model):
    code, started = agent(machine, "copy", "start", stdin=spec_for(tiny_model))
    assert code == 0, started
    code, stopped = agent(machine, "runtime", "stop")
    assert code == 0 and stopped["copies"] == ["d7-c3"], stopped
    assert copyproc.read_proc(started["pid"]) is None and copyproc.read_records(machine.store) == []
    code, refused = agent(machine, "copy", "start", stdin=spec_for(tiny_model))
    assert refused["kind"] == "not_retryable" and refused["message"].startswith("The runtime is not started")


def test_a_machine_without_the_engine_configured_says_so(machine, tiny_model):
    with open(machine.env["FADEN_AGENT_CONFIG"], "w") as fh:
        json.dump({"runtime_driver": "process", "process": {"ray": sys.executable, "python": sys.executable}}, fh)
    code, refused = agent(machine, "copy", "start", stdin=spec_for(tiny_model))
    assert refused["kind"] == "not_retryable" and '"process".vllm does not name the engine' in refused["message"]


# ------------------------------------------------------------------ the lab's engine on its own


class Running:
    """The engine as a process on 127.0.0.1, its output in a file."""

    def __init__(self, tmp_path, model_dir, *flags, env=None, name="tiny", tp=1):
        self.port = free_port()
        self.log = tmp_path / ("engine-%d.log" % self.port)
        environ = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(tp)),
                       FADEN_LAB_ENGINE_PACE="2000")
        environ.update(env or {})
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([PYTHON, ENGINE] + argv_for(model_dir, self.port, *flags, name=name, tp=tp)[1:],
                                         stdout=out, stderr=subprocess.STDOUT, env=environ)

    def output(self):
        return self.log.read_text()

    def wait_listening(self, timeout=20):
        deadline = time.monotonic() + timeout
        while "Application startup complete." not in self.output():
            assert self.proc.poll() is None, "the engine ended: %s" % self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.02)
        return self

    def ended(self, timeout=20):
        return self.proc.wait(timeout), self.output()

    def request(self, method, path, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        data = answer.read()
        conn.close()
        return answer.status, (json.loads(data) if data and answer.getheader("Content-Type", "").startswith("application/json")
                               else data.decode())

    def stream(self, path, body):
        """The ``data:`` events of a streamed answer, each with the seconds since the request was sent."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        sent = time.monotonic()
        conn.request("POST", path, body=json.dumps(dict(body, stream=True)), headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        assert answer.status == 200 and answer.getheader("Transfer-Encoding") == "chunked"
        assert answer.getheader("Content-Type").startswith("text/event-stream")
        events = []
        for line in answer:
            if line.startswith(b"data: "):
                payload = line[6:].strip()
                events.append((time.monotonic() - sent, payload.decode() if payload == b"[DONE]" else json.loads(payload)))
        conn.close()
        return events

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    running = Running(tmp_path_factory.mktemp("engine"), tiny_model, "--max-model-len", "1024", tp=2).wait_listening()
    yield running
    running.stop()


def metrics(engine) -> dict:
    status, text = engine.request("GET", "/metrics")
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.replace(',model_name="tiny"', "").replace('{model_name="tiny"}', "")] = float(value)
    return values


def test_the_engine_answers_health_and_lists_its_model(engine, tiny_model):
    assert engine.request("GET", "/health") == (200, "")
    status, models = engine.request("GET", "/v1/models")
    assert status == 200 and models["object"] == "list"
    (card,) = models["data"]
    assert (card["id"], card["root"], card["max_model_len"], card["owned_by"]) == ("tiny", tiny_model, 1024, "vllm")


def test_a_chat_answer_is_deterministic_in_openais_shape(engine):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Where does the river go?"}], "temperature": 0.7}
    status, first = engine.request("POST", "/v1/chat/completions", body)
    assert status == 200 and first["object"] == "chat.completion" and first["model"] == "tiny"
    (choice,) = first["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
    text = choice["message"]["content"]
    assert 24 <= first["usage"]["completion_tokens"] <= 120 and text.endswith(".")
    assert first["usage"]["total_tokens"] == first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert engine.request("POST", "/v1/chat/completions", body)[1]["choices"][0]["message"]["content"] == text
    other = dict(body, messages=[{"role": "user", "content": "And the stone?"}])
    assert engine.request("POST", "/v1/chat/completions", other)[1]["choices"][0]["message"]["content"] != text
    short = engine.request("POST", "/v1/chat/completions", dict(body, max_tokens=5))[1]
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 5
    assert text.startswith(short["choices"][0]["message"]["content"].rstrip("."))


def test_a_streamed_chat_sends_the_role_then_a_chunk_per_token_the_usage_and_done(engine):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Where does the river go?"}],
            "stream_options": {"include_usage": True}}
    events = engine.stream("/v1/chat/completions", body)
    whole = engine.request("POST", "/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"})[1]
    first, *tokens, usage, done = [event for _, event in events]
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(t["choices"][0]["delta"]["content"] for t in tokens) == whole["choices"][0]["message"]["content"]
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None] * (len(tokens) - 1) + ["stop"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"] and done == "[DONE]"
    assert len({e["id"] for e in [first, *tokens, usage]}) == 1


def test_completions_answer_plain_and_streamed_alike(engine):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True}
    status, plain = engine.request("POST", "/v1/completions", body)
    assert status == 200 and plain["object"] == "text_completion"
    assert plain["usage"]["completion_tokens"] == 12 and plain["choices"][0]["finish_reason"] == "length"
    events = [event for _, event in engine.stream("/v1/completions", body)]
    assert events[-1] == "[DONE]" and len(events) == 13
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == plain["choices"][0]["text"]
    status, two = engine.request("POST", "/v1/completions", dict(body, prompt=["one", "two"]))
    assert [c["index"] for c in two["choices"]] == [0, 1] and two["choices"][0]["text"] != two["choices"][1]["text"]


def test_the_pace_sets_the_first_token_at_one_tokens_time_and_the_rest_after_it(tiny_model, tmp_path):
    slow = Running(tmp_path, tiny_model, env={"FADEN_LAB_ENGINE_PACE": "50"}).wait_listening()
    try:
        body = {"prompt": "pace", "max_tokens": 10, "ignore_eos": True}
        events = slow.stream("/v1/completions", body)
        first, last = events[0][0], events[-2][0]
        assert 0.02 - 0.005 <= first < 0.02 + 0.1        # one token at 50 tokens/s
        assert 0.2 - 0.005 <= last < 0.2 + 0.15          # ten tokens
        assert "tokens come at 50 tokens/s per request" in slow.output()
    finally:
        slow.stop()


def test_answers_take_whole_words_from_the_tokenizers_vocabulary_when_it_has_them(tiny_model, tmp_path):
    model = model_copy(tiny_model, tmp_path)
    words = ["%s%s%s" % (a, b, c) for a in "bcdfg" for b in "aeiou" for c in "lmnrst"]      # 150 words
    vocab = {"<s>": 0, "\u0120the": 1, "##ing": 2, **{"\u0120" + word: i + 3 for i, word in enumerate(words)}}
    (model / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
    worded = Running(tmp_path, str(model)).wait_listening()
    try:
        status, body = worded.request("POST", "/v1/completions", {"prompt": "Speak", "max_tokens": 30})
        said = body["choices"][0]["text"].rstrip(".").lower().split()
        assert status == 200 and len(said) == 30 and set(said) <= set(words) | {"the"}
    finally:
        worded.stop()


def test_embeddings_are_a_unit_vector_of_the_hidden_size_the_same_for_the_same_input(engine):
    status, first = engine.request("POST", "/v1/embeddings", {"model": "tiny", "input": ["a river", "a stone"]})
    assert status == 200 and [d["index"] for d in first["data"]] == [0, 1]
    vector = first["data"][0]["embedding"]
    assert len(vector) == 512 and abs(sum(v * v for v in vector) - 1.0) < 1e-9
    again = engine.request("POST", "/v1/embeddings", {"model": "tiny", "input": "a river"})[1]
    assert again["data"][0]["embedding"] == vector and first["data"][1]["embedding"] != vector


def test_refusals_come_in_openais_error_shape(engine):
    status, answer = engine.request("POST", "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and answer == {"error": {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError",
                                                  "param": "model", "code": 404}}
    status, answer = engine.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 5000})
    assert status == 400 and answer["error"]["message"].startswith("This model's maximum context length is 1024 tokens. "
                                                                   "However, you requested 5001 tokens")
    status, answer = engine.request("POST", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}})
    assert status == 400 and "stream=True" in answer["error"]["message"]
    assert engine.request("POST", "/v1/chat/completions", {"messages": []})[0] == 400
    assert engine.request("GET", "/v1/nothing")[0] == 404


def test_metrics_count_requests_and_tokens_under_vllms_names(engine):
    before = metrics(engine)
    answers = [engine.request("POST", "/v1/completions", {"prompt": "count %d" % i, "max_tokens": 7, "ignore_eos": True})[1]
               for i in range(3)]
    answers.append(engine.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]})[1])
    after = metrics(engine)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == \
        sum(a["usage"]["completion_tokens"] for a in answers)
    success = 'vllm:request_success_total{finished_reason="%s"}'
    assert after[success % "length"] - before[success % "length"] == 3
    assert after[success % "stop"] - before[success % "stop"] == 1
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert after[histogram + "_count"] - before[histogram + "_count"] == 4
        assert after[histogram + '_bucket{le="+Inf"}'] == after[histogram + "_count"]


# ------------------------------------------------------------------ the engine's refusals to start


def model_copy(tiny_model, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_model, target)
    return target


def refused_start(tmp_path, model_dir, *flags, **kwargs):
    code, output = Running(tmp_path, str(model_dir), *flags, **kwargs).ended()
    assert "Application startup complete." not in output
    return code, output


def test_a_missing_config_is_refused_before_listening(tiny_model, tmp_path):
    model = model_copy(tiny_model, tmp_path)
    (model / "config.json").unlink()
    code, output = refused_start(tmp_path, model)
    assert code == 1 and "ValueError: %s is not a valid model: config.json is missing" % model in output


def test_truncated_weights_are_refused_naming_the_tensor(tiny_model, tmp_path):
    model = model_copy(tiny_model, tmp_path)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 4096)
    code, output = refused_start(tmp_path, model)
    assert code == 1 and "is not a valid model: model.safetensors: tensor lm_head.weight's data" in output
    assert "(truncated?)" in output


def test_a_broken_safetensors_header_and_a_missing_shard_are_refused(tiny_model, tmp_path):
    model = model_copy(tiny_model, tmp_path)
    with open(model / "model.safetensors", "r+b") as fh:
        fh.seek(8)
        fh.write(b"{nonsense")
    code, output = refused_start(tmp_path, model)
    assert code == 1 and "model.safetensors: its header is not valid JSON" in output
    shutil.copy(os.path.join(tiny_model, "model.safetensors"), model / "model.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    code, output = refused_start(tmp_path, model)
    assert "model-00002-of-00002.safetensors, named by model.safetensors.index.json, is missing" in output


def test_a_wrong_number_of_gpus_or_too_long_a_context_or_an_unknown_flag_is_refused(tiny_model, tmp_path):
    code, output = refused_start(tmp_path, tiny_model, "--pipeline-parallel-size", "2", tp=2)
    assert code == 1 and ("tensor parallel size 2 x pipeline parallel size 2 needs 4 GPUs, but "
                          "CUDA_VISIBLE_DEVICES=0,1 makes 2 visible") in output
    code, output = refused_start(tmp_path, tiny_model, env={"CUDA_VISIBLE_DEVICES": ""})
    assert "needs 1 GPU, but CUDA_VISIBLE_DEVICES= makes 0 visible" in output
    code, output = refused_start(tmp_path, tiny_model, "--max-model-len", "4096")
    assert code == 1 and "User-specified max_model_len (4096) is greater than the derived max_model_len" in output
    code, output = refused_start(tmp_path, tiny_model, "--api-key", "secret")
    assert code == 2 and "vllm: error: unrecognized arguments: --api-key secret" in output


def test_a_port_in_use_is_told_in_uvicorns_words(engine, tiny_model):
    environ = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    done = subprocess.run([PYTHON, ENGINE] + argv_for(tiny_model, engine.port)[1:], env=environ, capture_output=True,
                          text=True, timeout=20)
    assert done.returncode == 1 and "error while attempting to bind on address ('127.0.0.1', %d): address already in use" \
        % engine.port in done.stdout


# ------------------------------------------------------------------ the copy's own key


def _get(port, path, key=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers={"Authorization": "Bearer " + key} if key else {})
    answer = conn.getresponse()
    data = answer.read()
    conn.close()
    return answer.status, data


def test_the_copy_s_key_reaches_the_engine_by_its_environment_only_and_opens_v1_alone(machine, tiny_model):
    key = "k-" + "s3cr3t" * 6
    spec = dict(spec_for(tiny_model, gpus="0"), env={"CUDA_VISIBLE_DEVICES": "0", "VLLM_API_KEY": key})
    code, started = agent(machine, "copy", "start", stdin=spec)
    assert code == 0, started
    assert key not in " ".join(cmdline(started["pid"]))                       # never on its command line (ps)
    with open("/proc/%d/environ" % started["pid"], "rb") as fh:
        assert ("VLLM_API_KEY=" + key).encode() in fh.read().split(b"\0")
    with open(copyproc.record_path(machine.store, "d7-c3")) as fh:
        assert key not in fh.read()                                              # the record keeps names only
    port = spec["port"]
    assert _get(port, "/health")[0] == 200                                       # open, as in vLLM
    assert agent(machine, "copy", "list")[1]["copies"][0]["healthy"] is True
    assert _get(port, "/v1/models") == (401, b'{"error":"Unauthorized"}')
    assert _get(port, "/v1/models", "wrong")[0] == 401
    assert _get(port, "/v1/models", key)[0] == 200

"""The engine's command line: what a copy runs, built by one function."""
import pytest

from deployments.engine import memory_fraction, options_parse, options_problem, vllm_command

COMMON = dict(model_dir="/var/lib/fadenstack/models/org--chat/abc", name="chat", address="198.18.1.11", port=8100,
              vendor="nvidia", memory_per_gpu_mib=40960, gpu_memory_mib=81920, context_length=4096)


def test_a_copy_on_two_gpus_of_one_machine_is_tensor_parallel_on_exactly_those_gpus():
    command = vllm_command(gpu_indices=[2, 3], **COMMON)
    assert command.argv == ["vllm", "serve", "/var/lib/fadenstack/models/org--chat/abc", "--served-model-name", "chat",
                            "--host", "198.18.1.11", "--port", "8100", "--tensor-parallel-size", "2",
                            "--gpu-memory-utilization", "0.5000", "--max-model-len", "4096"]
    assert command.env == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_a_copy_over_two_machines_is_pipeline_parallel_through_ray():
    argv = vllm_command(gpu_indices=[0, 1, 2, 3, 4, 5, 6, 7], machines=2, **COMMON).argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8"
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"


def test_amd_gpus_are_named_by_hip_and_a_quarter_share_is_a_memory_fraction():
    command = vllm_command(gpu_indices=[5], **{**COMMON, "vendor": "amd", "memory_per_gpu_mib": 20480})
    assert command.env == {"HIP_VISIBLE_DEVICES": "5"}
    assert command.argv[command.argv.index("--gpu-memory-utilization") + 1] == "0.2500"
    assert memory_fraction(100, 0) == 0.9 and memory_fraction(200, 100) == 1.0


def test_options_a_person_adds_come_after_the_console_s_flags():
    argv = vllm_command(gpu_indices=[0], options=["--enable-prefix-caching", "--kv-cache-dtype=fp8"], **COMMON).argv
    assert argv[-2:] == ["--enable-prefix-caching", "--kv-cache-dtype=fp8"]


@pytest.mark.parametrize("options, words", [
    (["--port=9000"], "--port is set by the console"),
    (["--served-model-name=other"], "--served-model-name is set by the console"),
    (["--kv-cache-dtype", "fp8"], "'fp8' is not an engine option"),
    (["--flag;rm -rf /"], "is not an engine option"),
    (["-x"], "is not an engine option"),
    (["--ok=line\nbreak"], "is not an engine option"),
    ("--enable-prefix-caching", "a list of flags"),
    (["--a"] * 41, "At most 40"),
])
def test_engine_options_that_would_break_placement_or_parse_badly_are_refused_in_words(options, words):
    assert words in options_problem(options)
    if isinstance(options, list):
        with pytest.raises(ValueError):
            vllm_command(gpu_indices=[0], options=options, **COMMON)


def test_the_form_s_text_becomes_one_option_per_word_and_an_unknown_vendor_is_refused():
    assert options_parse(" --enable-prefix-caching\n --kv-cache-dtype=fp8 ") == ["--enable-prefix-caching", "--kv-cache-dtype=fp8"]
    assert options_problem([]) is None
    with pytest.raises(ValueError, match="No engine for GPUs"):
        vllm_command(gpu_indices=[0], **{**COMMON, "vendor": "intel"})


def test_a_copy_with_tls_serves_its_machine_s_certificate_and_requires_a_client_certificate():
    command = vllm_command(gpu_indices=[0], options=["--enable-prefix-caching"], api_key="k3y-of-the-copy", tls=True,
                           **COMMON)
    argv = command.argv
    assert argv[argv.index("--ssl-keyfile") + 1] == "/etc/fadenstack/cluster/tls/copy.key"
    assert argv[argv.index("--ssl-certfile") + 1] == "/etc/fadenstack/cluster/tls/copy.pem"
    assert argv[argv.index("--ssl-ca-certs") + 1] == "/etc/fadenstack/cluster/tls/ca.pem"
    assert argv[argv.index("--ssl-cert-reqs") + 1] == "2"  # CERT_REQUIRED: no certificate, no connection
    assert "--enable-ssl-refresh" in argv  # a renewed certificate is taken up without a restart
    assert argv[-1] == "--enable-prefix-caching"  # a person's options still come last
    # The copy's key stays in its environment, never on the command line; no key file's content either.
    assert command.env == {"CUDA_VISIBLE_DEVICES": "0", "VLLM_API_KEY": "k3y-of-the-copy"}
    assert not any("k3y" in word or "PRIVATE" in word for word in argv)
    assert "--ssl-keyfile" not in vllm_command(gpu_indices=[0], **COMMON).argv


@pytest.mark.parametrize("flag", ["--ssl-keyfile=/root/.ssh/id_rsa", "--ssl-cert-reqs=0", "--ssl-ca-certs=/tmp/ca.pem"])
def test_the_tls_flags_are_the_console_s_alone(flag):
    assert "is set by the console" in options_problem([flag])

"""The engine's command line: one function builds what a copy runs, on GPU machines and in the lab alike.

A copy runs vLLM's OpenAI-compatible server (``vllm serve``) inside the cluster's runtime container; the
lab's runtime image carries a stand-in under the same name that takes the same flags, so the console's
path is the same everywhere. The console decides every flag that placement and the gateway depend on
(where it listens, which name it serves, how many GPUs and how much of their memory); the options a
person adds go after them and may not set those again.

Pure: nothing here starts a process or reads the database.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ENGINE = "vllm"

# Flags the console sets for every copy: an engine option may not set them again (placement, the port
# the gateway reaches and the name it routes by would no longer hold).
CONSOLE_FLAGS = frozenset({
    "--host", "--port", "--served-model-name", "--model", "--tensor-parallel-size", "--pipeline-parallel-size",
    "--data-parallel-size", "--gpu-memory-utilization", "--max-model-len", "--distributed-executor-backend",
    "--api-key", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs", "--uds", "--root-path", "--headless",
    "--ssl-cert-reqs", "--enable-ssl-refresh", "--api-server-count", "--data-parallel-address",
    "--data-parallel-rpc-port", "--data-parallel-size-local", "--data-parallel-start-rank", "--tokenizer-pool-size",
})
# What an Operator may add: vLLM's flags that tune memory, batching, precision and decoding, and reach
# nothing on the machine (no file, no code, no other model). Matched whole: vLLM's parser takes
# abbreviations (``--hos`` for ``--host``), so only an exact flag passes. ``--gpu-memory-utilization`` and
# ``--max-model-len`` are the console's (from the form's memory and context fields).
OPERATOR_OPTIONS = frozenset({
    "--dtype", "--kv-cache-dtype", "--quantization", "--seed", "--block-size", "--swap-space", "--cpu-offload-gb",
    "--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
    "--enable-prefix-caching", "--no-enable-prefix-caching", "--prefix-caching-hash-algo", "--enforce-eager",
    "--max-seq-len-to-capture", "--num-gpu-blocks-override", "--kv-cache-memory-bytes", "--calculate-kv-scales",
    "--max-logprobs", "--disable-log-stats", "--enable-log-requests", "--disable-log-requests",
    "--max-log-len", "--scheduling-policy", "--long-prefill-token-threshold", "--max-num-partial-prefills",
    "--max-long-partial-prefills", "--disable-custom-all-reduce", "--enable-expert-parallel",
    "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser", "--guided-decoding-backend",
    "--chat-template-content-format", "--response-role", "--return-tokens-as-token-ids", "--tokenizer-mode",
    "--limit-mm-per-prompt", "--override-generation-config", "--enable-request-id-headers",
    "--enable-server-load-tracking", "--uvicorn-log-level", "--disable-uvicorn-access-log", "--disable-fastapi-docs",
})
# An Administrator's decision, recorded in the audit trail: each runs code or reads files on the machine
# (the model's own Python, plugins, a config file, local paths, another model or adapter).
ADMINISTRATOR_OPTIONS = frozenset({
    "--trust-remote-code", "--config", "--allowed-local-media-path", "--chat-template", "--tokenizer",
    "--tool-parser-plugin", "--logits-processors", "--logits-processor-pattern", "--middleware",
    "--worker-cls", "--worker-extension-cls", "--hf-overrides", "--hf-config-path", "--generation-config",
    "--load-format", "--model-loader-extra-config", "--download-dir", "--enable-lora", "--lora-modules",
    "--speculative-config", "--compilation-config", "--allowed-origins", "--allow-credentials",
})
OPTION_RE = re.compile(r"^(--[a-z0-9][a-z0-9-]{0,63})(=[^\x00-\x1f]{1,500})?$")
OPTIONS_MAX = 40

API_KEY_ENV = "VLLM_API_KEY"  # vLLM's --api-key, read from the environment
# A copy's TLS files, as the runtime container sees the cluster's directory (mounted read-only): the machine's
# copy certificate and its key (made on the machine, never sent anywhere), and the console's authority, the only
# one whose client certificates the engine accepts. The agent puts the machine's own paths in their place for
# the ``process`` runtime (no container).
TLS_DIR = "/etc/fadenstack/cluster/tls"
TLS_KEY, TLS_CERT, TLS_CA = f"{TLS_DIR}/copy.key", f"{TLS_DIR}/copy.pem", f"{TLS_DIR}/ca.pem"
CERT_REQUIRED = "2"  # ssl.CERT_REQUIRED: no client certificate of the authority's, no connection
VISIBLE_DEVICES = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str]  # the visible-device variable (the GPUs the plan gave the copy, and no others), its key


def visible_devices(vendor: str, gpu_indices) -> dict[str, str]:
    """The variable that shows a process exactly these GPUs of its machine, for its vendor."""
    return {VISIBLE_DEVICES[vendor]: ",".join(str(i) for i in gpu_indices)}


def options_flags(options) -> list[str]:
    """The flags of options (their values left out), in order."""
    return [option.split("=", 1)[0] for option in options]


def options_decided(options) -> list[str]:
    """The Administrator's flags among these options (an audit entry names them)."""
    return [flag for flag in dict.fromkeys(options_flags(options)) if flag in ADMINISTRATOR_OPTIONS]


def options_problem(options, *, administrator: bool = False, kept=()) -> str | None:
    """Why a person may not give these engine options, in words; None when they may.

    Only flags of the allowlist pass, each matched whole; an Administrator's flags pass for an Administrator,
    or when ``kept`` (the deployment's current options) has the same option already: an Operator changing
    something else keeps what an Administrator decided, but may not add to it."""
    if problem := options_shape_problem(options):
        return problem
    for option in options:
        flag = option.split("=", 1)[0]
        if flag in CONSOLE_FLAGS or flag in OPERATOR_OPTIONS:
            continue
        if flag in ADMINISTRATOR_OPTIONS:
            if administrator or option in kept:
                continue
            return (f"{flag} is an Administrator's decision (it runs code or reads files on the machine): ask an "
                    "Administrator to add it.")
        near = sorted(known for known in OPERATOR_OPTIONS | ADMINISTRATOR_OPTIONS | CONSOLE_FLAGS
                      if known.startswith(flag))
        if near:
            return f"{flag} is not a whole engine option: write it in full ({', '.join(near[:6])})."
        return (f"{flag} is not an engine option the console allows (such as --enable-prefix-caching, "
                "--kv-cache-dtype=fp8, --max-num-seqs=64); docs/deployments.md lists them.")
    return None


def options_shape_problem(options) -> str | None:
    """Why these options cannot go on a copy's command line at all, in words; None when they can.

    What the console checks at every start: a deployment recorded before the allowlist keeps running with its
    options (an edit must make them pass ``options_problem``).

    Each option is one flag, alone (``--enable-prefix-caching``) or with its value after ``=``
    (``--kv-cache-dtype=fp8``): a value in a separate item could be taken for a flag of its own."""
    if not isinstance(options, (list, tuple)):
        return "Engine options are a list of flags, such as --enable-prefix-caching or --kv-cache-dtype=fp8."
    if len(options) > OPTIONS_MAX:
        return f"At most {OPTIONS_MAX} engine options, got {len(options)}."
    for option in options:
        match = OPTION_RE.match(option) if isinstance(option, str) else None
        if match is None:
            return (f"{option!r} is not an engine option: write each as --flag or --flag=value "
                    "(lowercase letters, digits and dashes in the flag).")
        if match.group(1) in CONSOLE_FLAGS:
            return f"{match.group(1)} is set by the console for every copy (placement and the gateway rely on it)."
    return None


def options_parse(text: str) -> list[str]:
    """The options as a person types them in the form: separated by spaces or new lines."""
    return [part for part in re.split(r"\s+", text or "") if part]


def memory_fraction(memory_per_gpu_mib: int, gpu_memory_mib: int) -> float:
    """vLLM's --gpu-memory-utilization: the share of each GPU's whole memory the copy may use."""
    return min(1.0, memory_per_gpu_mib / gpu_memory_mib) if gpu_memory_mib else 0.9


def vllm_command(*, model_dir: str, name: str, address: str, port: int, vendor: str, gpu_indices: list[int],
                 machines: int = 1, memory_per_gpu_mib: int, gpu_memory_mib: int, context_length: int,
                 options=(), api_key: str | None = None, tls: bool = False) -> EngineCommand:
    """What a copy runs on its (first) machine.

    ``gpu_indices`` are this machine's GPUs for the copy; a copy over several machines has as many on each
    (tensor parallel within a machine, pipeline parallel across them, through Ray). A share of one GPU is
    one index with a memory fraction below that GPU's whole. ``api_key`` is the copy's own key: vLLM reads
    ``VLLM_API_KEY`` from its environment (as ``--api-key``), so the key never shows on a command line.
    ``tls``: the engine serves HTTPS with the machine's copy certificate and requires a client certificate
    of the console's authority (the gateway's and the checks'): mutual TLS. Only paths go on the command
    line; the key stays in its 0600 file.
    """
    if problem := options_shape_problem(list(options)):
        raise ValueError(problem)
    if vendor not in VISIBLE_DEVICES:
        raise ValueError(f"No engine for GPUs of {vendor!r} (known: {', '.join(VISIBLE_DEVICES)}).")
    if not gpu_indices or machines < 1:
        raise ValueError("A copy runs on at least one GPU of one machine.")
    argv = [ENGINE, "serve", model_dir,
            "--served-model-name", name,
            "--host", address,
            "--port", str(port),
            "--tensor-parallel-size", str(len(gpu_indices)),
            "--gpu-memory-utilization", f"{memory_fraction(memory_per_gpu_mib, gpu_memory_mib):.4f}",
            "--max-model-len", str(context_length)]
    if machines > 1:
        argv += ["--pipeline-parallel-size", str(machines), "--distributed-executor-backend", "ray"]
    if tls:
        # --enable-ssl-refresh: a renewed certificate (tls install) is taken up by the running engine.
        argv += ["--ssl-keyfile", TLS_KEY, "--ssl-certfile", TLS_CERT, "--ssl-ca-certs", TLS_CA,
                 "--ssl-cert-reqs", CERT_REQUIRED, "--enable-ssl-refresh"]
    argv += list(options)
    env = visible_devices(vendor, gpu_indices) | ({API_KEY_ENV: api_key} if api_key else {})
    return EngineCommand(argv=argv, env=env)

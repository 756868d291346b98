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
})
OPTION_RE = re.compile(r"^(--[a-z0-9][a-z0-9-]{0,63})(=[^\x00-\x1f]{1,500})?$")
OPTIONS_MAX = 40

VISIBLE_DEVICES = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class EngineCommand:
    argv: list[str]
    env: dict[str, str]  # the visible-device variable: the GPUs the plan gave the copy, and no others


def visible_devices(vendor: str, gpu_indices) -> dict[str, str]:
    """The variable that shows a process exactly these GPUs of its machine, for its vendor."""
    return {VISIBLE_DEVICES[vendor]: ",".join(str(i) for i in gpu_indices)}


def options_problem(options) -> str | None:
    """Why these engine options are refused, in words; None when they are fine.

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
                 options=()) -> EngineCommand:
    """What a copy runs on its (first) machine.

    ``gpu_indices`` are this machine's GPUs for the copy; a copy over several machines has as many on each
    (tensor parallel within a machine, pipeline parallel across them, through Ray). A share of one GPU is
    one index with a memory fraction below that GPU's whole.
    """
    if problem := options_problem(list(options)):
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
    argv += list(options)
    return EngineCommand(argv=argv, env=visible_devices(vendor, gpu_indices))

"""What a model's files say about it: its architecture from ``config.json``, its weights from the
safetensors headers, and from both the memory one copy needs on GPUs.

Pure: a directory in, a ``ModelFacts`` out, no database. Only headers are read (a file's first 8
bytes give the length of its JSON header, which names each tensor's dtype, shape and byte range),
never the weights themselves, so a 100 GB model is read in milliseconds. A sharded model's
``model.safetensors.index.json`` says which files hold it; otherwise every ``*.safetensors`` file
in the directory does. Parameters are counted from the tensors' shapes, never taken from the name.

A file that cannot be what it claims (a header longer than the file, a header that is not JSON, a
tensor whose bytes lie past the file's end, no config.json) raises ValueError with a sentence that
names the file and what is wrong with it.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

# The KV cache's share, on top of the weights, in the memory a copy is given: one rule for the pages
# and for placement, stated on the page in KV_CACHE_WORDS.
KV_CACHE_SHARE = 0.2
KV_CACHE_WORDS = f"weights + {round(KV_CACHE_SHARE * 100)} % for the KV cache"

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# The safetensors library refuses headers over 100 MB; so do we, before reading a byte of one.
HEADER_MAX_BYTES = 100_000_000

# Each safetensors dtype: the name people know it by, and its bits per number.
DTYPES = {
    "F64": ("float64", 64), "F32": ("float32", 32), "F16": ("float16", 16), "BF16": ("bfloat16", 16),
    "F8_E4M3": ("float8_e4m3", 8), "F8_E5M2": ("float8_e5m2", 8), "F8_E8M0": ("float8_e8m0", 8),
    "F6_E2M3": ("float6_e2m3", 6), "F6_E3M2": ("float6_e3m2", 6), "F4": ("float4", 4),
    "I64": ("int64", 64), "I32": ("int32", 32), "I16": ("int16", 16), "I8": ("int8", 8),
    "U64": ("uint64", 64), "U32": ("uint32", 32), "U16": ("uint16", 16), "U8": ("uint8", 8), "BOOL": ("bool", 8),
}
TORCH_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
DEFAULT_KV_BYTES = 2  # a 16-bit cache, as vLLM's "auto" gives a 16-bit model

# Where config.json keeps each number: models of other families name them differently.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", "max_seq_len", "n_ctx")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")


@dataclass(frozen=True)
class ModelFacts:
    """A model as its files describe it. A number config.json does not give is None."""

    architecture: str | None  # config's architectures[0]: LlamaForCausalLM
    model_type: str | None  # llama
    parameter_count: int  # numbers in the weights, summed from the tensors' shapes
    dtype: str  # the weights' dtype (float16, bfloat16, ...), or "mixed" when they hold several
    context_length: int | None  # the longest sequence, in tokens
    layers: int | None
    hidden_size: int | None
    attention_heads: int | None
    kv_heads: int | None  # num_key_value_heads; the attention heads when config.json names none
    head_dim: int | None
    weight_bytes: int  # the tensors' bytes, headers excluded
    kv_cache_bytes_per_token: int | None  # 2 (key, value) x layers x kv_heads x head_dim x the cache's bytes per number
    weight_files: tuple[str, ...]  # the safetensors files, relative to the model's directory

    def gpu_memory_bytes(self, kv_share: float = KV_CACHE_SHARE) -> int:
        """The memory one copy needs: its weights plus ``kv_share`` of them for the KV cache
        (``KV_CACHE_WORDS``). A fixed share rather than a context's worth of cache: the engine
        fits as many tokens as the memory left holds, so the share only has to leave it room."""
        if not 0 <= kv_share < 1:
            raise ValueError(f"The KV cache's share must be at least 0 and below 1, not {kv_share}.")
        return math.ceil(self.weight_bytes * (1 + kv_share))


def model_facts(directory: Path | str) -> ModelFacts:
    """Read the model in ``directory`` (config.json and the safetensors headers)."""
    directory = Path(directory)
    config = _read_config(directory)
    files = _weight_files(directory)
    dtypes: dict[str, int] = {}  # safetensors dtype -> bytes
    parameters = 0
    for path in files:
        for tensor in _read_header(path).values():
            parameters += tensor.elements
            dtypes[tensor.dtype] = dtypes.get(tensor.dtype, 0) + tensor.nbytes
    text = _text_config(config)
    heads = _number(text, HEAD_KEYS)
    hidden = _number(text, HIDDEN_KEYS)
    head_dim = _number(text, ("head_dim",)) or (hidden // heads if hidden and heads else None)
    kv_heads = _number(text, KV_HEAD_KEYS) or heads
    layers = _number(text, LAYER_KEYS)
    architectures = config.get("architectures")
    return ModelFacts(
        architecture=str(architectures[0]) if isinstance(architectures, list) and architectures else None,
        model_type=str(config["model_type"]) if isinstance(config.get("model_type"), str) else None,
        parameter_count=parameters,
        dtype=DTYPES[next(iter(dtypes))][0] if len(dtypes) == 1 else "mixed" if dtypes else "none",
        context_length=_number(text, CONTEXT_KEYS),
        layers=layers, hidden_size=hidden, attention_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        weight_bytes=sum(dtypes.values()),
        kv_cache_bytes_per_token=_kv_bytes_per_token(text, layers, kv_heads, head_dim, _kv_dtype_bytes(config, dtypes)),
        weight_files=tuple(str(path.relative_to(directory)) for path in files),
    )


@dataclass(frozen=True)
class Tensor:
    dtype: str
    elements: int
    nbytes: int


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{directory} has no config.json: a Hugging Face model keeps its architecture there.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} could not be read: {exc}.") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}.") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object of settings.")  # noqa: TRY004 (a bad file is a ValueError)
    return config


def _weight_files(directory: Path) -> list[Path]:
    """The files the index names (each once, in order), or else every *.safetensors file here."""
    index = directory / INDEX
    if not index.exists():
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{directory} holds no *.safetensors file: only safetensors weights are read.")
        return files
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"{index} is not a safetensors index (JSON with a weight_map): {exc}.") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index} has no weight_map naming the files of each tensor.")
    files = []
    for name in dict.fromkeys(weight_map.values()):
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"{index} names {name}, which is not a file of the model's directory.")
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{index} names {name}, which is missing from {directory}.")
        files.append(path)
    return files


def _read_header(path: Path) -> dict[str, Tensor]:
    """The tensors of one safetensors file, from its header alone, each checked against the file's size."""
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                raise ValueError(f"{path} is too short to be a safetensors file ({size} bytes).")
            (length,) = struct.unpack("<Q", prefix)
            if length > HEADER_MAX_BYTES:
                raise ValueError(f"{path} says its header is {length} bytes long: more than the {HEADER_MAX_BYTES} a "
                                 f"safetensors header may take.")
            if length > size - 8:
                raise ValueError(f"{path} says its header is {length} bytes long, but the file holds {size} bytes.")
            raw = file.read(length)
    except OSError as exc:
        raise ValueError(f"{path} could not be read: {exc.strerror or exc}.") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} does not start with a JSON header: {exc}.") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a header that is not a JSON object of tensors.")  # noqa: TRY004 (a bad file is a ValueError)
    data_bytes = size - 8 - length
    return {name: _tensor(path, name, entry, data_bytes) for name, entry in header.items() if name != "__metadata__"}


def _tensor(path: Path, name: str, entry, data_bytes: int) -> Tensor:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: the header's entry for {name} is not an object.")  # noqa: TRY004 (a bad file is a ValueError)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise ValueError(f"{path}: the tensor {name} has the dtype {dtype!r}, which safetensors does not define.")
    if not isinstance(shape, list) or not all(_whole(d) for d in shape):
        raise ValueError(f"{path}: the tensor {name} has no shape (a list of whole numbers).")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets) and offsets[0] <= offsets[1]):
        raise ValueError(f"{path}: the tensor {name} has no data_offsets (a start and an end).")
    if offsets[1] > data_bytes:
        raise ValueError(f"{path}: the tensor {name} ends at byte {offsets[1]} of the data, past the file's end "
                         f"({data_bytes} bytes of data).")
    elements = math.prod(shape)
    nbytes = offsets[1] - offsets[0]
    if nbytes != math.ceil(elements * DTYPES[dtype][1] / 8):
        raise ValueError(f"{path}: the tensor {name} takes {nbytes} bytes, not what {elements} numbers of {dtype} take.")
    return Tensor(dtype=dtype, elements=elements, nbytes=nbytes)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _text_config(config: dict) -> dict:
    """The language model's settings: the top level, or a multimodal model's text_config under it."""
    nested = config.get("text_config") or config.get("llm_config")
    return {**nested, **{k: v for k, v in config.items() if v is not None}} if isinstance(nested, dict) else config


def _number(config: dict, keys: tuple[str, ...]) -> int | None:
    """The first of ``keys`` config.json gives as a whole number above 0."""
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _kv_dtype_bytes(config: dict, dtypes: dict[str, int]) -> int:
    """The cache keeps numbers in the model's dtype: config.json's torch_dtype (dtype in newer ones),
    else the weights' one dtype; 16-bit when neither says (mixed weights, as quantized models have)."""
    named = config.get("torch_dtype") or config.get("dtype")
    if named in TORCH_DTYPE_BYTES:
        return TORCH_DTYPE_BYTES[named]
    if len(dtypes) == 1 and (dtype := next(iter(dtypes))).startswith(("F", "BF")) and DTYPES[dtype][1] >= 16:
        return DTYPES[dtype][1] // 8
    return DEFAULT_KV_BYTES


def _kv_bytes_per_token(config: dict, layers, kv_heads, head_dim, dtype_bytes: int) -> int | None:
    # Multi-head latent attention (DeepSeek V2/V3) caches one compressed vector per layer instead of
    # a key and a value per head: its rank plus the rotary part, as vLLM allocates it.
    latent, rope = _number(config, ("kv_lora_rank",)), _number(config, ("qk_rope_head_dim",))
    if layers and latent:
        return layers * (latent + (rope or 0)) * dtype_bytes
    if not (layers and kv_heads and head_dim):
        return None
    return 2 * layers * kv_heads * head_dim * dtype_bytes

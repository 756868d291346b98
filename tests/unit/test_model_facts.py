"""A model's facts come from config.json and the safetensors headers alone: parameters counted from the
tensors' shapes, bytes from their offsets, and a bad file named in a sentence that says what is wrong."""
import json
import math
import struct

import pytest

from deployments.store import modelfacts
from deployments.store.modelfacts import KV_CACHE_SHARE, KV_CACHE_WORDS, model_facts
from lab import hub_models

BITS = {"F32": 32, "F16": 16, "BF16": 16, "I32": 32, "I8": 8, "F4": 4}

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def header_bytes(tensors: dict[str, tuple[str, list[int]]]) -> tuple[bytes, int]:
    """A safetensors header (8-byte length, JSON padded to 8 bytes) for tensors laid end to end, and their bytes."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.ceil(math.prod(shape) * BITS[dtype] / 8)
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header, offset


def write_safetensors(path, tensors: dict[str, tuple[str, list[int]]]):
    """The header, then the data as a hole: the facts never read it, so it may be as large as a real model's."""
    header, data_bytes = header_bytes(tensors)
    path.write_bytes(header)
    with open(path, "r+b") as file:
        file.truncate(len(header) + data_bytes)
    return path


def write_model(directory, config=LLAMA, tensors=None, name="model.safetensors"):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    write_safetensors(directory / name, tensors or {"embed": ("BF16", [100, 64]), "layer.0.q": ("BF16", [64, 64])})
    return directory


def test_facts_of_a_llama_like_model_come_from_its_config_and_its_tensors(tmp_path):
    facts = model_facts(write_model(tmp_path / "llama-70b"))  # the name says 70b; the headers are believed

    assert facts.architecture == "LlamaForCausalLM" and facts.model_type == "llama"
    assert facts.parameter_count == 100 * 64 + 64 * 64
    assert (facts.dtype, facts.weight_bytes) == ("bfloat16", 2 * facts.parameter_count)
    assert (facts.context_length, facts.layers, facts.hidden_size) == (4096, 3, 64)
    assert (facts.attention_heads, facts.kv_heads, facts.head_dim) == (4, 2, 16)
    assert facts.kv_cache_bytes_per_token == 2 * 3 * 2 * 16 * 2
    assert facts.weight_files == ("model.safetensors",)


def test_a_copy_needs_its_weights_plus_the_stated_share_for_the_kv_cache(tmp_path):
    facts = model_facts(write_model(tmp_path / "m"))

    assert KV_CACHE_WORDS == "weights + 20 % for the KV cache" and KV_CACHE_SHARE == 0.2
    assert facts.gpu_memory_bytes() == math.ceil(facts.weight_bytes * 1.2)
    assert facts.gpu_memory_bytes(0) == facts.weight_bytes
    with pytest.raises(ValueError, match="below 1"):
        facts.gpu_memory_bytes(1)


@pytest.mark.parametrize("plan", list(hub_models.MODELS.values()), ids=lambda plan: plan.repo_id)
def test_facts_of_the_lab_hubs_models_match_the_plans_they_are_made_from(tmp_path, plan):
    for name, content in hub_models.small_files(plan).items():
        (tmp_path / name).write_bytes(content)
    header = hub_models.safetensors_header(plan)
    (tmp_path / "model.safetensors").write_bytes(header)
    with open(tmp_path / "model.safetensors", "r+b") as file:
        file.truncate(hub_models.safetensors_size(plan))

    facts = model_facts(tmp_path)

    assert facts.parameter_count == sum(hub_models.element_count(s) for s in plan.tensor_shapes().values())
    assert facts.weight_bytes == hub_models.safetensors_size(plan) - len(header)
    assert (facts.architecture, facts.dtype, facts.context_length) == ("LlamaForCausalLM", "float16", 2048)
    assert (facts.layers, facts.kv_heads, facts.head_dim) == (plan.num_hidden_layers, plan.num_key_value_heads, plan.head_dim)
    assert facts.kv_cache_bytes_per_token == 2 * plan.num_hidden_layers * plan.num_key_value_heads * plan.head_dim * 2


def test_a_sharded_model_is_the_files_its_index_names_each_counted_once(tmp_path):
    write_model(tmp_path, tensors={"a": ("F16", [10, 10])}, name="model-00001-of-00002.safetensors")
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": ("F16", [5]), "c": ("F16", [7])})
    write_safetensors(tmp_path / "stray.safetensors", {"d": ("F16", [1000])})  # not in the index: not the model's
    (tmp_path / modelfacts.INDEX).write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}))

    facts = model_facts(tmp_path)

    assert facts.parameter_count == 100 + 5 + 7
    assert facts.weight_files == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def test_weights_of_several_dtypes_read_as_mixed_and_the_cache_takes_the_configs_dtype(tmp_path):
    config = {**LLAMA, "torch_dtype": "float16"}
    facts = model_facts(write_model(tmp_path, config, {"qweight": ("I32", [64, 8]), "scales": ("F16", [64])}))

    assert facts.dtype == "mixed"
    assert facts.weight_bytes == 64 * 8 * 4 + 64 * 2
    assert facts.kv_cache_bytes_per_token == 2 * 3 * 2 * 16 * 2


def test_a_gpt2_style_config_gives_its_numbers_under_other_names_and_kv_heads_default_to_the_heads(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_positions": 1024, "n_layer": 2,
              "n_embd": 32, "n_head": 4}
    facts = model_facts(write_model(tmp_path, config, {"wte": ("F32", [50, 32])}))

    assert (facts.context_length, facts.layers, facts.hidden_size, facts.attention_heads) == (1024, 2, 32, 4)
    assert (facts.kv_heads, facts.head_dim) == (4, 8)
    assert facts.kv_cache_bytes_per_token == 2 * 2 * 4 * 8 * 4  # float32 weights, no torch_dtype: a 4-byte cache


def test_numbers_config_json_does_not_give_are_none(tmp_path):
    facts = model_facts(write_model(tmp_path, {"architectures": []}, {"w": ("F16", [3])}))

    assert (facts.architecture, facts.model_type, facts.context_length, facts.layers) == (None, None, None, None)
    assert facts.kv_cache_bytes_per_token is None
    assert facts.gpu_memory_bytes() == math.ceil(6 * 1.2)


def test_a_latent_attention_model_caches_one_compressed_vector_per_layer(tmp_path):
    config = {**LLAMA, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert model_facts(write_model(tmp_path, config)).kv_cache_bytes_per_token == 3 * (512 + 64) * 2


def test_only_the_headers_are_read_never_the_weights(tmp_path, monkeypatch):
    directory = write_model(tmp_path, tensors={"huge": ("BF16", [1 << 20, 1024])})  # 2 GiB of holes
    header, _ = header_bytes({"huge": ("BF16", [1 << 20, 1024])})
    read = []

    class Counting:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def read(self, size=-1):
            assert size >= 0, "a whole file was read"
            data = self.file.read(size)
            read.append(len(data))
            return data

    def counting_open(*args, **kwargs):
        return Counting(open(*args, **kwargs))  # Counting closes it

    monkeypatch.setattr(modelfacts, "open", counting_open, raising=False)

    assert model_facts(directory).weight_bytes == 2 << 30
    assert sum(read) == len(header)


def corrupt(tmp_path, raw: bytes):
    write_model(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(raw)
    return tmp_path


def out_of_file(tmp_path):
    header, data_bytes = header_bytes({"w": ("F16", [100])})
    return corrupt(tmp_path, header + bytes(data_bytes - 2))


def wrong_size(tmp_path):
    entries = json.dumps({"w": {"dtype": "F16", "shape": [10], "data_offsets": [0, 8]}}).encode()
    return corrupt(tmp_path, struct.pack("<Q", len(entries)) + entries + bytes(8))


def unknown_dtype(tmp_path):
    entries = json.dumps({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    return corrupt(tmp_path, struct.pack("<Q", len(entries)) + entries + bytes(1))


def missing_shard(tmp_path):
    write_model(tmp_path)
    (tmp_path / modelfacts.INDEX).write_text(json.dumps({"weight_map": {"w": "model-00002-of-00002.safetensors"}}))
    return tmp_path


def no_config(tmp_path):
    write_model(tmp_path)
    (tmp_path / "config.json").unlink()
    return tmp_path


def bad_config(tmp_path):
    write_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    return tmp_path


BAD = {
    "header too long": (lambda p: corrupt(p, struct.pack("<Q", 1 << 40) + b"{}"), "model.safetensors says its header is"),
    "header not JSON": (lambda p: corrupt(p, struct.pack("<Q", 4) + b"\xff{x]"), "model.safetensors does not start with a JSON header"),
    "too short": (lambda p: corrupt(p, b"\x01\x02"), "model.safetensors is too short to be a safetensors file"),
    "offsets out of the file": (out_of_file, "the tensor w ends at byte 200 of the data, past the file's end"),
    "bytes that do not fit the shape": (wrong_size, "the tensor w takes 8 bytes, not what 10 numbers of F16 take"),
    "unknown dtype": (unknown_dtype, "the tensor w has the dtype 'Q4', which safetensors does not define"),
    "missing shard": (missing_shard, "names model-00002-of-00002.safetensors, which is missing from"),
    "config.json missing": (no_config, "has no config.json"),
    "config.json not JSON": (bad_config, "config.json is not JSON"),
}


@pytest.mark.parametrize("case", BAD, ids=str)
def test_a_bad_file_is_a_value_error_that_names_the_file_and_what_is_wrong(tmp_path, case):
    make, words = BAD[case]
    directory = make(tmp_path / "model")
    with pytest.raises(ValueError) as refused:
        model_facts(directory)
    assert words in str(refused.value)
    assert str(directory) in str(refused.value)

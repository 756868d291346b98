"""The lab hub's models: small Llama-like repositories made from a seed, the same bytes every time.

Each model is a plan (its architecture) from which every file follows: ``config.json`` with the
numbers of the weights, a minimal byte-level BPE ``tokenizer.json``, ``tokenizer_config.json`` (with
a chat template), ``generation_config.json`` and ``model.safetensors`` (float16, a valid safetensors
file). The small files are made in memory; the weights are written once, lazily, into the cache
directory (``$FADEN_LAB_CACHE/hub``, default ``~/.cache/fadenstack-lab/hub``) and served from there.
A manifest (sizes, git blob ids, sha256) is written last, so a half-written model is made again.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

# Part of every seed: bump it when the files change, so caches and commit ids move with them.
GENERATOR_VERSION = 1
BLOCK_BYTES = 1 << 20
# float16 with the high byte's two top exponent bits cleared: every value finite, |x| < 2**-7
# (about the scale of a freshly initialised model). Applied to every byte with bytes.translate.
WEIGHT_BYTE_MASK = bytes(value & 0x9F for value in range(256))
FLOAT16_ONE = struct.pack("<e", 1.0)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class ModelPlan:
    """A model's architecture and who may download it; every file follows from it and the seed."""

    repo_id: str
    seed: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    gated: bool = False

    @property
    def commit_sha(self) -> str:
        return hashlib.sha1(f"{self.repo_id}\0{self.seed}\0{GENERATOR_VERSION}".encode()).hexdigest()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def tensor_shapes(self) -> dict[str, list[int]]:
        """Every weight of a LlamaForCausalLM with these numbers (no tied embeddings)."""
        hidden, inter, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads * self.head_dim
        shapes = {"model.embed_tokens.weight": [self.vocab_size, hidden]}
        for layer in range(self.num_hidden_layers):
            prefix = f"model.layers.{layer}"
            shapes |= {
                f"{prefix}.input_layernorm.weight": [hidden],
                f"{prefix}.self_attn.q_proj.weight": [hidden, hidden],
                f"{prefix}.self_attn.k_proj.weight": [kv, hidden],
                f"{prefix}.self_attn.v_proj.weight": [kv, hidden],
                f"{prefix}.self_attn.o_proj.weight": [hidden, hidden],
                f"{prefix}.post_attention_layernorm.weight": [hidden],
                f"{prefix}.mlp.gate_proj.weight": [inter, hidden],
                f"{prefix}.mlp.up_proj.weight": [inter, hidden],
                f"{prefix}.mlp.down_proj.weight": [hidden, inter],
            }
        shapes["model.norm.weight"] = [hidden]
        shapes["lm_head.weight"] = [self.vocab_size, hidden]
        return shapes


MODELS = {plan.repo_id: plan for plan in (
    # About 64 MiB of weights: the everyday model of the tests.
    ModelPlan("fadenstack-lab/tiny-chat", "tiny-chat", hidden_size=512, intermediate_size=1536,
              num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, vocab_size=8192),
    # About 512 MiB: for copies that take a while (progress, cancel, a link cut half way).
    ModelPlan("fadenstack-lab/medium-chat", "medium-chat", hidden_size=1024, intermediate_size=3072,
              num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000),
    # Small and gated: a download needs one of the hub's tokens.
    ModelPlan("fadenstack-lab/gated-chat", "gated-chat", hidden_size=256, intermediate_size=704,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, gated=True),
)}


def default_cache_dir() -> Path:
    base = os.environ.get("FADEN_LAB_CACHE") or Path.home() / ".cache" / "fadenstack-lab"
    return Path(base) / "hub"


# ---- the small files (made in memory, a few KiB) ----------------------------------------------

def small_files(plan: ModelPlan) -> dict[str, bytes]:
    """Every file but the weights, as bytes, in the order the hub lists them."""
    def as_json(value) -> bytes:
        return (json.dumps(value, indent=2) + "\n").encode()

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": plan.hidden_size, "intermediate_size": plan.intermediate_size,
        "num_hidden_layers": plan.num_hidden_layers, "num_attention_heads": plan.num_attention_heads,
        "num_key_value_heads": plan.num_key_value_heads, "head_dim": plan.head_dim,
        "vocab_size": plan.vocab_size, "max_position_embeddings": 2048, "hidden_act": "silu",
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16", "transformers_version": "4.46.0",
    }
    tokenizer_config = {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
        "add_eos_token": False, "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
    }
    generation_config = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7,
                         "top_p": 0.9, "transformers_version": "4.46.0"}
    readme = (f"---\nlicense: apache-2.0\npipeline_tag: text-generation\nlibrary_name: transformers\n"
              f"tags: [fadenstack-lab, llama]\n---\n\n# {plan.repo_id}\n\nGenerated by the Fadenstack lab hub "
              f"from the seed `{plan.seed}`: random weights, for moving and loading, not for answers.\n").encode()
    return {
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        "README.md": readme,
        "config.json": as_json(config),
        "generation_config.json": as_json(generation_config),
        "tokenizer.json": as_json(tokenizer(plan)),
        "tokenizer_config.json": as_json(tokenizer_config),
    }


def tokenizer(plan: ModelPlan) -> dict:
    """A byte-level BPE with no merges: three special tokens, then one token per byte."""
    alphabet = _byte_level_alphabet()
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab |= {alphabet[byte]: len(SPECIAL_TOKENS) + byte for byte in range(256)}
    assert len(vocab) <= plan.vocab_size
    added = [{"id": index, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for index, token in enumerate(SPECIAL_TOKENS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


def _byte_level_alphabet() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 bytes (what a ByteLevel pre-tokenizer produces).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {byte: chr(byte if byte in printable else next(extra)) for byte in range(256)}


# ---- the weights --------------------------------------------------------------------------------

def safetensors_header(plan: ModelPlan) -> bytes:
    """The 8-byte length and the JSON header (padded with spaces to 8 bytes, as safetensors writes it)."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in plan.tensor_shapes().items():
        size = 2 * element_count(shape)
        entries[name] = {"dtype": "F16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def safetensors_size(plan: ModelPlan) -> int:
    return len(safetensors_header(plan)) + sum(2 * element_count(shape) for shape in plan.tensor_shapes().values())


def safetensors_chunks(plan: ModelPlan):
    """The file's bytes in blocks of at most 1 MiB: norms are ones, the rest hashed from the seed."""
    yield safetensors_header(plan)
    for name, shape in plan.tensor_shapes().items():
        remaining = 2 * element_count(shape)
        if name.endswith("norm.weight"):
            yield FLOAT16_ONE * (remaining // 2)
            continue
        for counter in range(0, (remaining + BLOCK_BYTES - 1) // BLOCK_BYTES):
            seed = f"{plan.seed}\0{GENERATOR_VERSION}\0{name}\0{counter}".encode()
            block = hashlib.shake_256(seed).digest(min(BLOCK_BYTES, remaining))
            remaining -= len(block)
            yield block.translate(WEIGHT_BYTE_MASK)


def element_count(shape: list[int]) -> int:
    """How many numbers a tensor of this shape holds."""
    count = 1
    for dimension in shape:
        count *= dimension
    return count


# ---- on disk ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RepoFile:
    """One file as the hub describes it (``lfs_sha256`` for the weights, which git keeps in LFS)."""

    path: str
    size: int
    blob_id: str  # git's blob id: sha1 of "blob <size>\0" + the bytes (for LFS files: of the pointer)
    sha256: str
    lfs: bool
    local_path: Path


class ModelStore:
    """The models' files under one cache directory, made on first use; safe to share between threads."""

    def __init__(self, cache_dir: Path | None = None):
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self._locks = {repo_id: threading.Lock() for repo_id in MODELS}

    def model_dir(self, plan: ModelPlan) -> Path:
        return self.cache_dir / plan.repo_id.replace("/", "--") / plan.commit_sha

    def files(self, plan: ModelPlan) -> dict[str, RepoFile]:
        """The model's files by path, writing them first if the cache does not hold them yet."""
        directory = self.model_dir(plan)
        manifest_path = directory / "manifest.json"
        with self._locks[plan.repo_id]:
            if not manifest_path.exists():
                self._write(plan, directory, manifest_path)
            manifest = json.loads(manifest_path.read_text())
        return {path: RepoFile(path=path, local_path=directory / "files" / path, **entry)
                for path, entry in manifest.items()}

    def _write(self, plan: ModelPlan, directory: Path, manifest_path: Path) -> None:
        files_dir = directory / "files"
        files_dir.mkdir(parents=True, exist_ok=True)
        manifest = {}
        for path, content in small_files(plan).items():
            _write_atomically(files_dir / path, [content])
            manifest[path] = {"size": len(content), "blob_id": _git_blob_id(content),
                              "sha256": hashlib.sha256(content).hexdigest(), "lfs": False}
        digest = _write_atomically(files_dir / "model.safetensors", safetensors_chunks(plan))
        size = (files_dir / "model.safetensors").stat().st_size
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{digest}\nsize {size}\n".encode()
        manifest["model.safetensors"] = {"size": size, "blob_id": _git_blob_id(pointer), "sha256": digest,
                                         "lfs": True}
        _write_atomically(manifest_path, [json.dumps(manifest, indent=2).encode()])


def lfs_pointer_size(file: RepoFile) -> int:
    return len(f"version https://git-lfs.github.com/spec/v1\noid sha256:{file.sha256}\nsize {file.size}\n")


def _git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _write_atomically(path: Path, chunks) -> str:
    """Write the chunks to a temporary file renamed into place; return their sha256."""
    digest = hashlib.sha256()
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(temporary, "wb") as out:
        for chunk in chunks:
            digest.update(chunk)
            out.write(chunk)
    os.replace(temporary, path)
    return digest.hexdigest()

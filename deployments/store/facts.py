"""A model's facts as the store keeps them (a JSON dict on its row), read by ``modelfacts`` from its files."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from django.conf import settings

from deployments.store import modelfacts


def model_facts(directory: Path) -> dict:
    """What the files say, and the GPU memory a copy needs with the server's KV-cache share (stated with it)."""
    found = modelfacts.model_facts(directory)
    share = settings.FADEN_KV_CACHE_SHARE
    return dataclasses.asdict(found) | {
        "weight_files": list(found.weight_files),
        "gpu_memory_bytes": found.gpu_memory_bytes(share),
        "kv_cache_share": share,
        "gpu_memory_rule": f"weights + {round(share * 100)} % for the KV cache",
    }

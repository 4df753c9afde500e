"""Will it fit: the memory a model needs in a compute profile against what this machine has.

Contract: `memory_needed(config, weights, profile)` estimates (weight bytes once loaded, KV
bytes for the full context) from shapes alone; `memory_available()` is what Strata may use
(STRATA_MAX_MEMORY_MB caps it); `check_memory` raises LoadFailed with the numbers when the
model would push the machine into swap.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import psutil

from engine.errors import LoadFailed
from engine.platform import ComputeProfile


def memory_needed(config: dict[str, Any], weights: dict[str, Any], profile: ComputeProfile
                  ) -> tuple[int, int]:
    """(weight bytes once loaded in this profile, KV bytes for the full context), estimated
    from shapes only: nothing is read from disk."""
    quant = config.get("quantization") or {}
    width = 4 if profile.dtype == "float32" else 2
    weight_bytes = 0
    for key, arr in weights.items():
        module = key.rsplit(".", 1)[0]
        q = quant.get(module) if isinstance(quant.get(module), dict) else None
        if q is None and f"{module}.scales" in weights and key.endswith(".weight"):
            q = {"bits": quant.get("bits", 4)}
        if profile.dequantize and q is not None:
            if key.endswith(".weight"):
                weight_bytes += arr.size * (32 // int(q["bits"])) * width
            continue  # scales and biases go away with dequantization
        weight_bytes += arr.nbytes if q is not None else arr.size * width
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // heads)
    layers = int(config.get("num_hidden_layers", 0))
    context = int(config.get("max_position_embeddings") or 4096)
    kv_bytes = 2 * layers * kv_heads * head_dim * width * context
    return weight_bytes, kv_bytes


def memory_available() -> int:
    """Bytes Strata may use: what the system has available, capped by STRATA_MAX_MEMORY_MB."""
    available = int(psutil.virtual_memory().available)
    cap = os.environ.get("STRATA_MAX_MEMORY_MB")
    if cap:
        try:
            available = min(available, int(float(cap) * 2**20))
        except ValueError as exc:
            raise LoadFailed(f"STRATA_MAX_MEMORY_MB={cap!r} is not a number of megabytes"
                             ) from exc
    return available


def check_memory(folder: Path, config: dict[str, Any], weights: dict[str, Any],
                 profile: ComputeProfile) -> None:
    """Refuse, with the numbers, a model that would push the machine into swap."""
    weight_bytes, kv_bytes = memory_needed(config, weights, profile)
    available = memory_available()
    if weight_bytes + kv_bytes > available:
        context = int(config.get("max_position_embeddings") or 4096)
        raise LoadFailed(
            f"{folder.name}: needs about {(weight_bytes + kv_bytes) / 1e9:.2f} GB (weights "
            f"{weight_bytes / 1e9:.2f} GB as {profile.dtype}, KV {kv_bytes / 1e9:.2f} GB for "
            f"{context:,} tokens) but only {available / 1e9:.2f} GB is available; close other "
            "programs or choose a smaller model")

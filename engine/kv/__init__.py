"""The KV layer (floor 1): paged KV in a RAM tier and an SSD tier, exact and sparse attention
over the pages, and the SSD prefix cache.

What lives here: settings.py (KVSettings, KVGeometry), table.py (page metadata), codec.py
(page encodings: 16, 8, 4 bits), pagefile.py (the SSD tier's records), store.py (the tiers),
cache.py (the per-layer cache mlx-lm's models take, and the LayerCache protocol),
attention.py (the hook that reads pages), prefix.py (prompt prefixes on the SSD).
May import only the leaves (errors, telemetry, platform), MLX and numpy: it receives a
geometry and the model's key bytes, never a LoadedModel. No measurement here (engine/bench).

Contract of this face: `make_paged_cache(model, settings, geometry)` returns one cache per
layer over a fresh store and installs the attention hook in the mlx-lm model's modules, so
that their `scaled_dot_product_attention` reads the pages.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine.errors import StrataError
from engine.kv.attention import install_hook
from engine.kv.cache import LayerCache, PagedLayerCache, close_caches, ssd_bytes
from engine.kv.settings import (
    BITS,
    DEFAULT_GROUP,
    GROUP_SIZES,
    MODES,
    KVGeometry,
    KVSettings,
    settings_from_env,
)
from engine.kv.store import KVStore

__all__ = ["BITS", "DEFAULT_GROUP", "GROUP_SIZES", "MODES", "KVGeometry", "KVSettings",
           "KVStore", "LayerCache", "PagedLayerCache", "close_caches", "geometry_of",
           "make_paged_cache", "settings_from_env", "ssd_bytes"]


def geometry_of(model: Any, dtype: str | None = None) -> KVGeometry:
    """The KV geometry of an mlx-lm model; `dtype` (the compute dtype) unless read from the
    key projection's weights."""
    layers = list(model.layers)
    attn = layers[0].self_attn
    kv_heads = int(attn.n_kv_heads)
    head_dim = int(getattr(attn, "head_dim", 0) or attn.k_proj.weight.shape[0] // kv_heads)
    return KVGeometry(len(layers), kv_heads, head_dim, dtype or _dtype_name(model))


def make_paged_cache(model: Any, settings: KVSettings, geometry: KVGeometry | None = None
                     ) -> list[PagedLayerCache]:
    """One PagedLayerCache per layer over a fresh store; installs the attention hook."""
    args = getattr(model, "args", None)  # an mlx-lm module's ModelArgs, where it has one
    if args is not None and any(t != "full_attention"
                                for t in (getattr(args, "layer_types", None) or [])):
        raise StrataError("paged KV cache: sliding-window layers are not supported; "
                          "use --kv-mode mlx")
    g = geometry or geometry_of(model)
    store = KVStore(settings, n_layers=g.layers, kv_heads=g.kv_heads, head_dim=g.head_dim,
                    dtype=g.dtype)
    install_hook(model)
    return [PagedLayerCache(store, i) for i in range(g.layers)]


def _dtype_name(model: Any) -> str:
    w = model.layers[0].self_attn.k_proj.weight
    return "float16" if w.dtype == mx.float16 else "float32"

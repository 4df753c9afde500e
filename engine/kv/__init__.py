"""The KV layer (floor 1): paged KV in a RAM tier and an SSD tier, exact and sparse attention
over the pages, and the SSD prefix cache.

What lives here: settings.py (KVSettings, KVGeometry), table.py (page metadata), codec.py
(page encodings: 16, 8, 4 bits), pagefile.py (the SSD tier's records), store.py (the tiers),
cache.py (the per-layer cache mlx-lm's models take, and the LayerCache protocol),
attention.py (the hook that reads pages), prefix.py (prompt prefixes on the SSD).
May import only the leaves (errors, telemetry, platform), MLX and numpy: it receives a
geometry and the model's key bytes, never a LoadedModel. No measurement here (engine/bench).

Contract of this face: `geometry_of(model, dtype, caches)` reads an mlx-lm model's KV layout
from the caches mlx-lm makes for it (KVCache: full attention, pages; RotatingKVCache: a
sliding window, kept in RAM; anything else, recurrent or hybrid state: the model cannot be
paged, said in one line) and from one lazy probe step (heads and head dims per layer, never
evaluated). `make_paged_cache(model, settings, geometry)` returns one cache per layer, paged
(PagedLayerCache over a fresh store) or windowed (WindowLayerCache, in RAM), and installs the
attention hook in the mlx-lm model's modules, so that their `scaled_dot_product_attention`
reads the pages; it raises KVUnpageable (the geometry's one line) for a model it cannot hold.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx

from engine.kv.attention import (
    QUESTION_L,
    SPARSE_CHUNK_L,
    SPARSE_MAX_L,
    SPARSE_PREFILL_PAST,
    ask,
    install_hook,
    question_steps,
)
from engine.kv.cache import (
    LayerCache,
    PagedLayerCache,
    WindowLayerCache,
    close_caches,
    shared_bytes,
    ssd_bytes,
    trimmable,
)
from engine.kv.remap import attach as attach_remap
from engine.kv.remap import rope_fields
from engine.kv.settings import (
    BITS,
    DEFAULT_GROUP,
    GROUP_SIZES,
    MODES,
    KVGeometry,
    KVSettings,
    KVUnpageable,
    settings_from_env,
)
from engine.kv.store import KVStore

__all__ = ["BITS", "SPARSE_CHUNK_L", "SPARSE_MAX_L", "SPARSE_PREFILL_PAST", "DEFAULT_GROUP",
           "QUESTION_L", "question_steps", "ask",
           "GROUP_SIZES", "MODES", "KVGeometry", "KVSettings",
           "KVStore", "KVUnpageable", "LayerCache", "PagedLayerCache", "WindowLayerCache",
           "close_caches", "geometry_of", "make_paged_cache", "settings_from_env",
           "shared_bytes", "ssd_bytes", "trimmable"]


def geometry_of(model: Any, dtype: str | None = None, caches: list[Any] | None = None
                ) -> KVGeometry:
    """The KV geometry of an mlx-lm model (see the face's contract). `caches`: fresh caches
    of mlx-lm's for it (make_prompt_cache), which the probe step uses up; None: the model's
    own `make_cache()`, or plain KV caches where it has none. `dtype`: the compute dtype,
    unless read from the probe's keys."""
    layers = list(model.layers)
    n = len(layers)
    if caches is None:
        make = getattr(model, "make_cache", None)  # mlx-lm's models that mix cache kinds
        caches = list(make()) if callable(make) else None
    kind = type(model).__module__.rsplit(".", 1)[-1]
    windows, unpaged, no_prefix = [0] * n, None, None
    if caches is not None:
        if len(caches) != n:
            unpaged = (f"{kind}: {len(caches)} layer caches for {n} layers; the paged KV "
                       "cache and the prefix cache cannot map them, so it runs in mlx-lm's "
                       "cache")
        for i, c in enumerate(caches[:n]):
            name = type(c).__name__
            if name == "RotatingKVCache" and not getattr(c, "keep", 0):
                windows[i] = int(c.max_size)
            elif name != "KVCache" and unpaged is None:
                unpaged = (f"{kind}: layer {i} holds a recurrent state (mlx-lm's {name}: "
                           "recurrent or hybrid layers), which cannot be paged or stored as a "
                           "prefix; it runs in mlx-lm's own cache")
        no_prefix = unpaged
    shapes, probed_dtype = _probe(model, caches, n)
    if shapes is None:
        shapes = [_attr_shape(layer) for layer in layers]
    full = [shapes[i] for i in range(n) if windows[i] == 0]
    head = full[0] if full else shapes[0]
    if unpaged is None and any(s != head for s in full):
        unpaged = no_prefix = (f"{kind}: full-attention layers of different KV shapes "
                               f"({sorted(set(full))}); it runs in mlx-lm's cache")
    if unpaged is None and head[1] != head[2]:
        unpaged = no_prefix = (f"{kind}: key and value head dims differ ({head[1]} and "
                               f"{head[2]}, multi-latent attention); the paged KV cache and "
                               "the prefix cache hold equal ones only, so it runs in mlx-lm's "
                               "cache")
    if unpaged is None:
        outside = _attention_outside_hook(layers)
        if outside:
            unpaged = (f"{kind}: attention is computed in the model's own code (in "
                       f"{outside}, e.g. with logit soft-capping), not through the "
                       "scaled_dot_product_attention the paged KV cache hooks; it runs in "
                       "mlx-lm's cache")
    return KVGeometry(n, head[0], head[1], dtype or probed_dtype or _dtype_name(model),
                      tuple(windows) if any(windows) else (), tuple(shapes), unpaged,
                      no_prefix, **rope_fields(model))


def _probe(model: Any, caches: list[Any] | None, n: int
           ) -> tuple[list[tuple[int, int, int]] | None, str | None]:
    """Per layer (kv_heads, key dim, value dim) from one lazy step of one token into mlx-lm's
    caches: the graph is built, never evaluated, so it costs no compute. (None, None) when the
    model has no such caches or the step fails (the attributes are read instead)."""
    if caches is None or len(caches) != n:
        return None, None
    try:
        model(mx.array([[0]]), cache=caches)
    except Exception:  # noqa: BLE001  (any model code: the attributes are the fallback)
        return None, None
    shapes: list[tuple[int, int, int]] = []
    dtype = None
    for c in caches:
        k, v = getattr(c, "keys", None), getattr(c, "values", None)
        if k is None or v is None or getattr(k, "ndim", 0) != 4:
            shapes.append((0, 0, 0))  # recurrent state: no KV to size
            continue
        shapes.append((int(k.shape[1]), int(k.shape[3]), int(v.shape[3])))
        dtype = dtype or _name(k.dtype)
    return shapes, dtype


def _attr_shape(layer: Any) -> tuple[int, int, int]:
    attn = getattr(layer, "self_attn", layer)
    heads = int(getattr(attn, "n_kv_heads", 0) or getattr(attn, "num_key_value_heads", 0) or 1)
    head_dim = int(getattr(attn, "head_dim", 0) or attn.k_proj.weight.shape[0] // heads)
    return heads, head_dim, head_dim


def _attention_outside_hook(layers: list[Any]) -> str | None:
    """The module of a layer's attention that never calls scaled_dot_product_attention (so
    the hook cannot route it to the pages), or None."""
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue
        name = type(attn).__module__
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "scaled_dot_product_attention", None) is None:
            return name.rsplit(".", 1)[-1]
    return None


def make_paged_cache(model: Any, settings: KVSettings, geometry: KVGeometry | None = None
                     ) -> list[PagedLayerCache | WindowLayerCache]:
    """One cache per layer: full-attention layers page through one fresh store, sliding
    layers keep their window in RAM; installs the attention hook."""
    g = geometry or geometry_of(model)
    if g.unpaged is not None:
        raise KVUnpageable(g.unpaged)
    paged = g.paged_layers
    store = KVStore(settings, n_layers=len(paged), kv_heads=g.kv_heads, head_dim=g.head_dim,
                    dtype=g.dtype)
    attach_remap(store, g)  # sparse mode past the trained length remaps positions
    install_hook(model)
    out: list[PagedLayerCache | WindowLayerCache] = []
    for i in range(g.layers):
        w = g.window(i)
        out.append(WindowLayerCache(store, w) if w else PagedLayerCache(store, len(
            [p for p in paged if p < i])))
    return out


def _name(dtype: Any) -> str:
    return {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(dtype, "float32")


def _dtype_name(model: Any) -> str:
    w = model.layers[0].self_attn.k_proj.weight
    return "float16" if w.dtype == mx.float16 else "float32"

"""Positions past the trained length, InfLLM-style: in sparse mode the tokens attention reads
get positions inside the model's trained window.

Contract: `rope_fields(model)` reads an mlx-lm model's plain RoPE (dims, traditional, base,
scale) and trained length into KVGeometry's rope fields, or leaves them empty (rope_dims 0)
when the config scales its own positions (llama3, YaRN, linear, longrope, ...): those models
keep their scaling and are never remapped. `attach(store, geometry)` makes a store remap;
`spec_for(store, end)` is the RopeSpec to remap with when a sparse chunk ending at token `end`
reaches past the trained length (None otherwise, or with STRATA_SPARSE_REMAP=0).
`block_deltas(...)` gives each attended block its re-rotation: by default every token keeps
its position unless the trained length does not reach it from the query, and those move
just inside it, in order (LAYOUT "reach", and "auto" up to REACH_PAST past the trained
length); LAYOUT "infllm" (and "auto" further on): sinks and the local window keep
their offsets (the sinks from the start, the window from the query), the chosen blocks are
placed contiguously, in their order, between them; `rerotate(k, delta, spec)` applies it.

Why re-rotate rather than store keys unrotated: attention scores under RoPE depend only on
the distance between query and key, and rotations compose (R(a) R(b) = R(a + b)), so a key
cached rotated at p_k and rotated again by delta = (k' - p_k) - (q' - p_q) scores against the
query as at positions (k', q'). The pages, the prefix store and the exact path stay as they
are; a step rotates only the blocks it gathers (budget x KV heads rows).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine.kv import cpu_kernels
from engine.kv.settings import KVGeometry

# STRATA_SPARSE_REMAP=0 turns remapping off (sparse then reads past-trained positions as they
# are); on by default.
ENABLED = (os.environ.get("STRATA_SPARSE_REMAP") or "1") != "0"
# Where the attended blocks go (`block_deltas`): "reach" (positions kept where the trained
# length reaches them), "infllm" (every chosen block packed before the window) or "auto"
# (the default): "reach" while the step's end is at most REACH_PAST past the trained length,
# "infllm" further on. Just past 8k "reach" kept a fact the InfLLM layout lost (the tenth
# pass); at 16k the InfLLM layout with candidates scored where it reads them found the fact
# at 50% that "reach" never did (docs/benchmarks.md, issue 19, 2026-12-07).
# STRATA_SPARSE_REMAP_LAYOUT picks.
LAYOUT = os.environ.get("STRATA_SPARSE_REMAP_LAYOUT") or "auto"
REACH_PAST = 1024


def reach(end: int, trained: int) -> bool:
    """Whether a step ending at token `end` lays its blocks out as "reach" (see LAYOUT)."""
    return LAYOUT == "reach" or (LAYOUT == "auto" and end - trained <= REACH_PAST)


@dataclass(frozen=True)
class RopeSpec:
    """A model's plain RoPE as mx.fast.rope takes it, and the length it was trained at."""

    dims: int
    traditional: bool
    base: float
    scale: float
    trained: int


def rope_fields(model: Any) -> dict[str, Any]:
    """KVGeometry's rope fields for an mlx-lm model: its attention's `rope` if that is MLX's
    plain nn.RoPE, the config has no rope_scaling of its own and a trained length is known;
    else {} (not remapped)."""
    args = getattr(model, "args", None)
    trained = int(getattr(args, "max_position_embeddings", 0) or 0)
    if args is None or not trained or getattr(args, "rope_scaling", None):
        return {}
    layers = getattr(model, "layers", None) or []
    attn = getattr(layers[0], "self_attn", None) if len(layers) else None
    rope: Any = getattr(attn, "rope", None)
    # YaRN, llama3, SuScaled...: their own scaling stays (`plain_class`: the class before
    # engine.runtime.model gave it a compiled one-position path)
    if getattr(type(rope), "plain_class", type(rope)) is not nn.RoPE:
        return {}
    return {"rope_dims": int(rope.dims), "rope_traditional": bool(rope.traditional),
            "rope_base": float(rope.base), "rope_scale": float(rope.scale),
            "trained_context": trained}


def spec_of(geometry: KVGeometry) -> RopeSpec | None:
    if not geometry.rope_dims or not geometry.trained_context:
        return None
    return RopeSpec(geometry.rope_dims, geometry.rope_traditional, geometry.rope_base,
                    geometry.rope_scale, geometry.trained_context)


# The store each spec belongs to: kept beside the store (whose module another part owns)
# rather than in it; dies with it.
_specs: weakref.WeakKeyDictionary[Any, RopeSpec] = weakref.WeakKeyDictionary()


def attach(store: Any, geometry: KVGeometry | RopeSpec | None) -> None:
    """Let `store`'s sparse attention remap with the geometry's RoPE (None: never)."""
    spec = geometry if isinstance(geometry, RopeSpec) or geometry is None else spec_of(geometry)
    if spec is None:
        _specs.pop(store, None)
    else:
        _specs[store] = spec


def attached(store: Any) -> RopeSpec | None:
    return _specs.get(store)


def spec_for(store: Any, end: int) -> RopeSpec | None:
    """The spec to remap a sparse chunk whose last token is token `end` - 1, or None: remap
    off, not sparse, no plain RoPE, or the whole context inside the trained window (there
    positions are what the model was trained on, and remapping would only move them)."""
    if not ENABLED or store.settings.mode != "sparse":
        return None
    spec = _specs.get(store)
    return spec if spec is not None and end > spec.trained else None


def block_deltas(top: Any, sink: int, hi: int, n_pages: int, P: int, b: int, end: int = 0,
                 trained: int = 0) -> tuple[Any, Any]:
    """The chosen blocks `top` (H, k) sorted per head, and each attended block's rotation
    (H, sink blocks + window blocks + k), in `_sparse`'s order: sinks (pages [0, sink)),
    window (pages [hi, n_pages)), then the chosen ones. S = sink * P, K = k * b, W0 = hi * P
    the window's first position.

    LAYOUT "reach" (and "auto" near the trained length; needs `end`, the chunk's end, and
    `trained`): every attended token keeps its own position unless it is out of the trained
    reach of the chunk's last query (distance >= trained): with E = end - trained, the sinks move to
    [E, E + S) and chosen block j (in position order, starting at s_j) to max(s_j, E + S +
    j b), the queries and the window stay, so delta = sinks E, window 0, block j max(0, E +
    S + j b - s_j). Just past the trained length (an 8,192-token prompt's answer on a model
    trained at 8,192) that moves almost nothing, where the InfLLM layout below moved the
    blocks thousands of positions and lost the fact exact mode found (docs/benchmarks.md,
    issue 19). It needs E <= W0 - S - K (a budget within the trained length); otherwise, or
    with LAYOUT "infllm":

    InfLLM frame: sinks at [0, S), the chosen blocks at [S, S + K) in position order, the
    window and the queries after them at their own distances. The queries move by S + K -
    W0, so delta = (k' - p_k) - (S + K - W0): sinks W0 - S - K, window 0, chosen block j:
    W0 - K + j b - s_j (the block just before the window, if chosen last, stays put)."""
    xp = _xp(top)
    h, k = top.shape
    nb = P // b
    top = xp.sort(top, axis=-1)
    S, K, W0 = sink * P, k * b, hi * P
    E = end - trained
    steps = xp.arange(k, dtype=xp.int32)[None] * b - top.astype(xp.int32) * b   # j b - s_j
    if reach(end, trained) and trained > 0 and 0 <= E <= W0 - S - K:
        shift, chosen = E, xp.maximum(steps + (E + S), 0)
    else:
        shift, chosen = W0 - S - K, steps + (W0 - K)
    fixed = xp.concatenate([xp.full((sink * nb,), shift, xp.int32),
                            xp.zeros(((n_pages - hi) * nb,), xp.int32)])
    delta = xp.concatenate([xp.broadcast_to(fixed[None], (h, fixed.shape[0])), chosen], axis=1)
    return top, delta


# Rotations by |delta| < SPLIT**2 positions come from two tables of SPLIT angles each (cos
# and sin of lo and of hi * SPLIT positions, |delta| = hi * SPLIT + lo, joined by the angle
# sum formulas), computed once per spec in float64: MLX's CPU cos and sin of each block's
# angles cost 0.36 ms a layer (3 heads x 144 blocks x 32 frequencies, 32k tokens, budget
# 2,048, load 7), the tables' lookups a few hundredths.
SPLIT = 4096
_tables: dict[RopeSpec, tuple[Any, Any, Any, Any]] = {}
_np_tables: dict[RopeSpec, tuple[np.ndarray, ...]] = {}


def _split_tables(spec: RopeSpec) -> tuple[np.ndarray, ...]:
    """cos and sin of lo and of hi * SPLIT positions (SPLIT, dims / 2) each, float32 from
    float64: the angle tables `_cos_sin` looks up (as MLX or numpy arrays)."""
    t = _np_tables.get(spec)
    if t is None:
        inv = spec.base ** (-np.arange(0, spec.dims, 2, dtype=np.float64) / spec.dims)
        n = np.arange(SPLIT, dtype=np.float64)[:, None] * spec.scale * inv    # (SPLIT, half)
        t = tuple(f(a).astype(np.float32) for a in (n, n * SPLIT) for f in (np.cos, np.sin))
        _np_tables[spec] = t
    return t


def _xp(a: Any) -> Any:
    """numpy for numpy arrays (the CPU's sparse path, engine.kv.cpu_select), else MLX."""
    return np if isinstance(a, np.ndarray) else mx


def _cos_sin(delta: Any, spec: RopeSpec) -> tuple[Any, Any]:
    """cos and sin (H, n, dims / 2), float32, of each delta (H, n) times the frequencies
    mx.fast.rope uses (base^(-2i/dims), positions times scale); numpy for a numpy delta."""
    xp = _xp(delta)
    if xp is np:
        cl, sl, ch, sh = _split_tables(spec)
    else:
        t = _tables.get(spec)
        if t is None:
            t = tuple(mx.array(a) for a in _split_tables(spec))  # type: ignore[assignment]
            _tables[spec] = t  # type: ignore[assignment]
        cl, sl, ch, sh = t  # type: ignore[misc]
    d = delta.astype(xp.int32)
    a = xp.abs(d)
    hi, lo = a // SPLIT, a % SPLIT
    c_lo, s_lo, c_hi, s_hi = cl[lo], sl[lo], ch[hi], sh[hi]
    c = c_hi * c_lo - s_hi * s_lo
    s = s_hi * c_lo + c_hi * s_lo
    return c, xp.where((d < 0)[..., None], -s, s)


def rerotate(k: Any, delta: Any, spec: RopeSpec) -> Any:
    """Keys k (H, n, b, D), cached rotated at their own positions, rotated further by delta
    (H, n) positions each block (every token of a block alike), with the frequencies
    mx.fast.rope uses (base^(-2i/dims), positions times scale). The angles are computed once
    per block, not per token: mx.fast.rope with one offset per row (each token its own
    batch entry) cost 5-18 ms a layer for a 2,048 budget at load 11, this about 1 ms
    (now ~0.5: the angles come from `_cos_sin`'s tables). |delta| < SPLIT**2 (16.7M).
    k and delta broadcast: k (H, 1, R, D) and delta (1, n) rotate H x R rows n ways (the
    query rotated back per far page) with the angles computed once, not H times. numpy keys
    go through engine.kv.cpu_kernels' loop when it is available (the same values)."""
    xp = _xp(k)
    half = spec.dims // 2
    if xp is np and not spec.traditional:  # one compiled loop where numba is at hand
        out = cpu_kernels.rotate(k, delta, _split_tables(spec), SPLIT)
        if out is not None:
            return out
    c, s = _cos_sin(delta, spec)                                          # (H, n, half)
    if xp is np and not spec.traditional and k.dtype == np.float32:
        return _rerotate_np(k, c[..., None, :], s[..., None, :], spec)
    c, s = c[..., None, :].astype(k.dtype), s[..., None, :].astype(k.dtype)
    rot, rest = k[..., :spec.dims], k[..., spec.dims:]
    if spec.traditional:  # pairs (2i, 2i + 1)
        x = rot.reshape(*rot.shape[:-1], half, 2)
        x1, x2 = x[..., 0], x[..., 1]
        out = xp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
        out = out.reshape(*out.shape[:-2], spec.dims)
    else:  # halves (i, i + dims / 2)
        x1, x2 = rot[..., :half], rot[..., half:]
        out = xp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
    if rest.shape[-1] == 0:
        return out
    return xp.concatenate([out, xp.broadcast_to(rest, (*out.shape[:-1], rest.shape[-1]))],
                          axis=-1)



def _rerotate_np(k: np.ndarray, c: np.ndarray, s: np.ndarray, spec: RopeSpec) -> np.ndarray:
    """`rerotate`'s halves layout in numpy, written into one output: the concatenations and
    dtype copies of the generic form were half of its time (2 ms a layer at 32k)."""
    half = spec.dims // 2
    x1, x2 = k[..., :half], k[..., half:spec.dims]
    shape = np.broadcast_shapes(x1.shape, c.shape)
    out = np.empty((*shape[:-1], k.shape[-1]), np.float32)
    o1, o2 = out[..., :half], out[..., half:spec.dims]
    np.multiply(x1, c, out=o1)
    o1 -= x2 * s
    np.multiply(x1, s, out=o2)
    o2 += x2 * c
    if k.shape[-1] > spec.dims:
        out[..., spec.dims:] = k[..., spec.dims:]
    return out

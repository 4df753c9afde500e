"""Round-to-nearest affine quantization in MLX's storage format, choosing the grid per group.

Contract: `affine_quantize(w, bits, group_size)` returns (packed uint32 weight, float16 scales,
float16 biases) that `mx.dequantize` and MLX's quantized layers read. For each group it keeps
whichever of two grids reconstructs the group with less squared error: MLX's own (which keeps
zero exactly representable) or the plain min-max grid (bias = min, scale = range / levels).
Weights that came from a min-max format (GGUF Q4_1, Q8_0-like blocks) lie exactly on the
second grid at the same width and group, so requantizing them there is lossless, where MLX's
grid alone is not. Below 4 bits only MLX's grid is used (measured better in KL there). Scales
and biases are rounded to float16 before the codes are chosen.

With `importance` (one non-negative weight per input column, the mean squared activation that
column sees on calibration text: `engine.quant.importance`), the error of a group is weighted
by it, sum(a_j * (w_j - q_j)**2), which is what a rounding error costs the layer's output, and
each group's grid is searched rather than picked: besides the two grids above, SEARCH_STEPS
grids of L-1 to L+1 levels over the group's range, each refitted by weighted least squares
(scale and bias given the codes), then two refits of the best. The best by weighted error wins,
at every width (the search only ever replaces a grid by one with lower weighted error).
"""

from __future__ import annotations

from typing import Any

import numpy as np

MIN_MAX_FROM_BITS = 4  # narrower widths keep MLX's grid
SEARCH_STEPS = 16  # candidate grids per group in the importance-weighted search


def _codes(wg: Any, scales: Any, biases: Any, levels: int) -> tuple[Any, Any]:
    """Codes and per-group squared error for a grid (scales and biases per group)."""
    import mlx.core as mx  # heavy: MLX loads only when weights are touched

    s = scales.astype(mx.float16).astype(mx.float32)[..., None]
    b = biases.astype(mx.float16).astype(mx.float32)[..., None]
    safe = mx.where(s == 0, 1.0, s)
    q = mx.clip(mx.round((wg - b) / safe), 0, levels)
    err = ((q * s + b - wg) ** 2).sum(-1)
    return q, err


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(R, C) integer codes < 2**bits to MLX's packing: a little-endian bit stream in uint32."""
    rows = q.shape[0]
    if bits == 8:
        return np.ascontiguousarray(q.astype(np.uint8)).view(np.uint32)
    if bits in (2, 4):
        per = 8 // bits
        q8 = q.astype(np.uint8).reshape(rows, -1, per)
        packed = np.zeros(q8.shape[:2], dtype=np.uint8)
        for k in range(per):
            packed |= q8[..., k] << (bits * k)
        return np.ascontiguousarray(packed).view(np.uint32)
    stream = ((q.astype(np.uint8)[..., None] >> np.arange(bits, dtype=np.uint8)) & 1)
    return np.packbits(stream.reshape(rows, -1), axis=-1, bitorder="little").view(np.uint32)


def _choose(w: Any, bits: int, group_size: int) -> tuple[Any, Any, Any]:
    """Per-group best grid: (codes as (R, C/g, g) float, float16 scales, float16 biases)."""
    import mlx.core as mx  # heavy: MLX loads only when weights are touched

    w = w.astype(mx.float32)
    rows, cols = w.shape
    levels = 2 ** bits - 1
    wg = w.reshape(rows, cols // group_size, group_size)
    _, s_mlx, b_mlx = mx.quantize(w, group_size=group_size, bits=bits)
    lo, hi = wg.min(-1), wg.max(-1)
    q1, e1 = _codes(wg, s_mlx, b_mlx, levels)
    q2, e2 = _codes(wg, (hi - lo) / levels, lo, levels)
    # Below 4 bits the min-max grid, though closer in squared error, measured worse in KL on
    # the starter (q3-g64: 2.25 against 1.82): losing an exact zero costs more there.
    use_mm = (e2 < e1) if bits >= MIN_MAX_FROM_BITS else mx.zeros(e1.shape, dtype=mx.bool_)
    q = mx.where(use_mm[..., None], q2, q1)
    scales = mx.where(use_mm, (hi - lo) / levels, s_mlx).astype(mx.float16)
    biases = mx.where(use_mm, lo, b_mlx).astype(mx.float16)
    return q, scales, biases


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def _weighted_codes(x: np.ndarray, a: np.ndarray, s: np.ndarray, b: np.ndarray, levels: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Weighted error per group, codes, and the float16-rounded scales and biases of a grid."""
    s16, b16 = _f16(s), _f16(b)
    safe = np.where(s16 == 0, np.float32(1.0), s16)
    q = np.clip(np.rint((x - b16[..., None]) / safe[..., None]), 0, levels)
    d = q * s16[..., None] + b16[..., None] - x
    return (a * d * d).sum(-1), q, s16, b16


def _least_squares(x: np.ndarray, a: np.ndarray, q: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Scale and bias minimising sum(a * (s*q + b - x)**2) per group, codes fixed."""
    sw, sx = a.sum(-1), (a * x).sum(-1)
    sq, sqq, sxq = (a * q).sum(-1), (a * q * q).sum(-1), (a * q * x).sum(-1)
    det = sw * sqq - sq * sq
    ok = det > 1e-20 * np.maximum(sw * sqq, 1e-30)  # all codes equal: keep a flat group
    det = np.where(ok, det, 1.0)
    s = np.where(ok, (sw * sxq - sx * sq) / det, 0.0)
    b = np.where(ok, (sqq * sx - sq * sxq) / det, sx / np.maximum(sw, 1e-30))
    return s.astype(np.float32), b.astype(np.float32)


def weighted_search(x: np.ndarray, importance: np.ndarray, bits: int, group_size: int,
                    s_mlx: np.ndarray, b_mlx: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The importance-weighted grid search of the module docstring, in NumPy only (so that
    several can run in threads: NumPy releases the GIL): `x` the (rows, cols) float32 weight,
    `s_mlx`/`b_mlx` MLX's own grid for it. Returns codes (rows, cols/g, g) as float32 and the
    float16-rounded scales and biases (rows, cols/g) as float32."""
    levels = 2 ** bits - 1
    rows, cols = x.shape
    if importance.shape != (cols,):
        raise ValueError(f"importance has shape {importance.shape}, the weight {x.shape}")
    xg = x.reshape(rows, cols // group_size, group_size)
    imp = np.maximum(importance.astype(np.float32), 0)
    # A column no calibration token reached still counts a little: its weight is not free.
    imp = imp + np.float32(1e-6) * max(float(imp.mean()), 1e-30)
    a = np.broadcast_to(imp.reshape(1, cols // group_size, group_size), xg.shape)
    lo, hi = xg.min(-1), xg.max(-1)
    span = np.maximum(hi - lo, np.float32(1e-12))
    best = _weighted_codes(xg, a, s_mlx, b_mlx, levels)
    grids = [((hi - lo) / levels, lo)]
    for k in range(SEARCH_STEPS):
        stretch = levels - 1.0 + 2.0 * k / (SEARCH_STEPS - 1)
        codes = np.clip(np.rint((stretch / span)[..., None] * (xg - lo[..., None])), 0, levels)
        grids.append(_least_squares(xg, a, codes))

    def keep(s: np.ndarray, b: np.ndarray) -> None:
        nonlocal best
        cand = _weighted_codes(xg, a, s, b, levels)
        better = cand[0] < best[0]
        best = (np.where(better, cand[0], best[0]), np.where(better[..., None], cand[1], best[1]),
                np.where(better, cand[2], best[2]), np.where(better, cand[3], best[3]))

    for s, b in grids:
        keep(s, b)
    for _ in range(2):  # refit to the best codes found so far
        keep(*_least_squares(xg, a, best[1]))
    return best[1], best[2], best[3]


def mlx_grid(w: Any, bits: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """MLX's own scales and biases for a weight, as float32 NumPy arrays."""
    import mlx.core as mx  # heavy: MLX loads only when weights are touched

    _, s, b = mx.quantize(w.astype(mx.float32), group_size=group_size, bits=bits)
    return np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32))


def _choose_weighted(w: Any, bits: int, group_size: int, importance: np.ndarray
                     ) -> tuple[Any, Any, Any]:
    """`_choose` with the importance-weighted grid search of the module docstring."""
    import mlx.core as mx  # heavy: MLX loads only when weights are touched

    q, s, b = weighted_search(np.array(w.astype(mx.float32)), importance, bits, group_size,
                              *mlx_grid(w, bits, group_size))
    return mx.array(q), mx.array(s).astype(mx.float16), mx.array(b).astype(mx.float16)


def _pick(w: Any, bits: int, group_size: int, importance: np.ndarray | None
          ) -> tuple[Any, Any, Any]:
    if importance is None:
        return _choose(w, bits, group_size)
    return _choose_weighted(w, bits, group_size, importance)


def affine_quantize(w: Any, bits: int, group_size: int, importance: np.ndarray | None = None
                    ) -> tuple[Any, Any, Any]:
    """(packed weight, scales, biases) for a 2-D float array. See the module docstring."""
    import mlx.core as mx  # heavy: MLX loads only when weights are touched

    q, scales, biases = _pick(w, bits, group_size, importance)
    q = q.astype(mx.uint8).reshape(w.shape)
    mx.eval(q, scales, biases)
    return mx.array(pack(np.array(q), bits)), scales, biases


def quantize_dequantize(w: Any, bits: int, group_size: int,
                        importance: np.ndarray | None = None) -> Any:
    """What `affine_quantize` stores, expanded back to float32 (for error estimates)."""
    import mlx.core as mx  # heavy: MLX loads only when weights are touched

    q, scales, biases = _pick(w, bits, group_size, importance)
    out = q * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return out.reshape(w.shape)

"""Packed weights: a decode step's products read the quantized codes, not the float32 copy.

Contract: on Linux CPU's float32 profile, `apply_profile(..., keep_codes=True)`
(engine.runtime.model; LoadedModel.load asks it) dequantizes each affine-quantized Linear and
Embedding and records where it came from (`PackSource`, via `remember`).
`pack_weights(model)` then registers every such float32 weight with engine.matvec together
with its codes (4 or 8 bits), scales and biases, and returns a `PackedWeights` whose
`close()`, or its collection (with the LoadedModel that holds it), forgets them. A
product of up to 8 rows (every projection of a decode step and its output head, a
speculative verify pass, a small batch) over a registered weight then reads the codes: the
same products up to float rounding (summed per group as scale * sum(q x) + bias * sum(x)),
each row's the same bit for bit whatever rows are beside it. Products of more rows (prompt
chunks) keep OpenBLAS's sgemm on the float32 weights. Weights that cannot be served
(another bit width, a group size not a multiple of 32, no AVX2 on this CPU, the shim off)
stay sgemv's. `PackedWeights.nbytes` is what the codes add to the weights in memory (the
Memory panel counts it).
STRATA_PACKED_MATVEC=0 leaves every weight unregistered (to measure without it).

Why: a starter decode step reads all 540 MB of its float32 weights, and that read was most of
the step (16 of ~24 ms at depth 0); the 4-bit codes are an eighth of it, and the kernel
over them ran the starter's 210 layer products in ~4 ms on one core against ~9 for OpenBLAS's
sgemv on two (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import matvec

ENABLED = (os.environ.get("STRATA_PACKED_MATVEC") or "1") != "0"
SOURCE_ATTR = "_strata_packed_source"


@dataclass(frozen=True)
class PackSource:
    """The affine codes a float32 weight was dequantized from: MLX's packed uint32 codes
    (rows, k * bits / 32), float32 scales and biases (rows, k / group)."""

    codes: Any
    scales: Any
    biases: Any
    bits: int
    group: int


def applies(dtype: str) -> bool:
    """Whether weights dequantized to `dtype` get packed here (float32, on, a kernel)."""
    return ENABLED and dtype == "float32" and matvec.packs(4)


def remember(module: Any, source: PackSource) -> None:
    """Record on a dequantized module (a plain attribute: never a parameter) what its weight
    came from, where a kernel could read it."""
    if ENABLED and source.bits in (4, 8) and source.group % 32 == 0 and matvec.packs(
            source.bits):
        setattr(module, SOURCE_ATTR, source)


def _forget(held: list[tuple[np.ndarray, ...]]) -> None:
    for weight, *_ in held:
        matvec.unpack(weight)
    held.clear()  # the arrays go after their registrations


class PackedWeights:
    """One model's registered weights (see the module docstring); forgotten by `close()` or
    when the object is collected, whichever comes first."""

    def __init__(self) -> None:
        self._held: list[tuple[np.ndarray, ...]] = []
        self.nbytes = 0
        weakref.finalize(self, _forget, self._held)

    def __len__(self) -> int:
        return len(self._held)

    def add(self, weight: np.ndarray, codes: np.ndarray, scales: np.ndarray,
            biases: np.ndarray, bits: int, group: int) -> bool:
        if not matvec.pack(weight, codes, scales, biases, bits, group):
            return False
        self._held.append((weight, codes, scales, biases))
        self.nbytes += codes.nbytes + scales.nbytes + biases.nbytes
        return True

    def close(self) -> None:
        """Forget every registration (idempotent); the codes are released after it."""
        _forget(self._held)
        self.nbytes = 0


def pack_weights(model: Any) -> PackedWeights:
    """Register the model's remembered weights (see the module docstring); call once its
    parameters are evaluated and final. The sources are dropped from the modules: the
    returned object holds what stays registered."""
    import mlx.core as mx  # here: fit.py reads `applies` without loading MLX

    packed = PackedWeights()
    for _, mod in model.named_modules():
        src = getattr(mod, SOURCE_ATTR, None)
        if src is None:
            continue
        delattr(mod, SOURCE_ATTR)
        w = getattr(mod, "weight", None)
        if mx.default_device() != mx.cpu or w is None or w.dtype != mx.float32:
            continue
        mx.eval(w, src.codes, src.scales, src.biases)
        codes = np.asarray(src.codes)
        packed.add(np.asarray(w), codes.view(np.uint8).reshape(codes.shape[0], -1),
                   np.asarray(src.scales), np.asarray(src.biases), src.bits, src.group)
    return packed

"""GGUF tensor types to MLX arrays: one tensor's stored bytes in, MLX's arrays for it out.

Contract: `convert_tensor(name, data, qtype, shape)` takes one tensor as the `gguf` reader
gives it (`data`: float rows for F32/F16, else uint8 block rows, already in the row order the
architecture wants), its parameter path in the MLX model (`name`) and its Hugging Face shape,
and returns a `Converted`: the arrays to save by parameter path (`name` itself, plus the
module's `.scales` and `.biases` when quantized), the per-module quantization
entry for config.json (None when stored as floats), and what the manifest says of it: the
source type, the stored format and whether the conversion was exact. Q4_0, Q4_1 and Q8_0 are
repacked exactly into MLX affine triples (group 32); other quantized types are dequantized with
the `gguf` package and requantized at `REQUANT_TYPES`' width; F32/F16 stay as they are, BF16
stays bfloat16. ImportFailed names the tensor when the stored numbers are not finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import ImportFailed

EXACT_TYPES = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4}
REQUANT_TYPES = {"Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6}
FLOAT_TYPES = {"F32", "F16", "BF16"}
SUPPORTED_TYPES = FLOAT_TYPES | set(EXACT_TYPES) | set(REQUANT_TYPES)
GROUP = 32


@dataclass
class Converted:
    """One tensor as MLX stores it, and what the manifest says of the conversion."""

    arrays: dict[str, Any]  # parameter path -> mx.array
    quant: dict[str, Any] | None  # config.json's entry for the module ({group_size, bits...})
    source: str  # the GGUF type: "Q4_K", "F32", ...
    stored: str  # "affine 4-bit g32", "float16", ...
    exact: bool  # True when the stored values equal the source's dequantized ones
    bits: int  # stored bits per weight of the values (not counting scales)

    @property
    def label(self) -> str:
        """The manifest's line for it: stored format (from source, exact or requantized)."""
        if self.quant is None and self.source.lower() == self.stored:
            return self.stored
        how = "exact" if self.exact else "requantized"
        return f"{self.stored} (from {self.source}, {how})"


def _f16_field(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _pack4(values: np.ndarray) -> np.ndarray:
    """(R, N) uint8 values < 16 to MLX's 4-bit packing: 8 per uint32, low nibble first."""
    packed = (values[:, 0::2] | (values[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(packed).view(np.uint32)


def exact_triple(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Repack Q8_0/Q4_0/Q4_1 block rows (R, bytes) into MLX (weight, scales, biases), exactly."""
    rows = raw.shape[0]
    if qtype == "Q8_0":
        blocks = raw.reshape(rows, -1, 34)
        d = _f16_field(blocks, 0)
        q = blocks[..., 2:].view(np.int8).astype(np.int16) + 128
        weight = np.ascontiguousarray(q.astype(np.uint8).reshape(rows, -1)).view(np.uint32)
        return weight, d, (d * np.float16(-128)).astype(np.float16)
    if qtype in ("Q4_0", "Q4_1"):
        width = 18 if qtype == "Q4_0" else 20
        blocks = raw.reshape(rows, -1, width)
        d = _f16_field(blocks, 0)
        qs = blocks[..., width - 16 :]
        values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
        bias = (d * np.float16(-8)).astype(np.float16) if qtype == "Q4_0" else _f16_field(blocks, 2)
        return _pack4(values), d, bias
    raise ValueError(qtype)


def convert_tensor(name: str, data: np.ndarray, qtype: str, shape: tuple[int, ...]
                   ) -> Converted:
    """One GGUF tensor to MLX arrays; see the module docstring. `shape` is the Hugging Face
    shape ((out, in), or (experts, out, in) for stacked experts)."""
    import gguf  # heavy: the dequantizers, only while converting
    import mlx.core as mx  # heavy: only while converting

    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    module = name.rsplit(".", 1)[0]
    if qtype in EXACT_TYPES:
        raw = data.reshape(rows, -1)
        with np.errstate(over="ignore", invalid="ignore"):
            w, s, b = exact_triple(raw, qtype)
        if not (np.isfinite(s).all() and np.isfinite(b).all()):
            # d * -128 past float16's range: the file's scales are corrupt.
            raise ImportFailed(f"tensor {name} has scales that are not finite numbers "
                               "(corrupt file)")
        bits = EXACT_TYPES[qtype]
        lead = shape[:-1]
        return Converted(
            {name: mx.array(w.reshape(*lead, -1)),
             f"{module}.scales": mx.array(s.reshape(*lead, -1)),
             f"{module}.biases": mx.array(b.reshape(*lead, -1))},
            {"group_size": GROUP, "bits": bits}, qtype, f"affine {bits}-bit g{GROUP}", True, bits)
    if qtype in REQUANT_TYPES:
        dense = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
        bits = REQUANT_TYPES[qtype]
        qw, qs, qb = mx.quantize(mx.array(dense.astype(np.float32).reshape(shape)),
                                 group_size=GROUP, bits=bits)
        return Converted(
            {name: qw, f"{module}.scales": qs.astype(mx.float16),
             f"{module}.biases": qb.astype(mx.float16)},
            {"group_size": GROUP, "bits": bits}, qtype, f"affine {bits}-bit g{GROUP}", False,
            bits)
    if qtype == "BF16":
        dense = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.BF16).astype(np.float32)
        arr = mx.array(dense).astype(mx.bfloat16)
    else:
        arr = mx.array(np.ascontiguousarray(data))
    bits = {"F32": 32, "F16": 16, "BF16": 16}[qtype]
    return Converted({name: arr.reshape(shape)}, None, qtype, qtype.lower(), True, bits)

"""GGUF tensor types to MLX arrays: one tensor's stored bytes in, MLX's arrays for it out.

Contract: `convert_tensor(name, data, qtype, shape)` takes one tensor as the `gguf` reader
gives it (`data`: float rows for F32/F16, else uint8 block rows, already in the row order the
architecture wants), its parameter path in the MLX model (`name`) and its Hugging Face shape,
and returns a `Converted`: the arrays to save by parameter path (`name` itself, plus the
module's `.scales` and `.biases` when quantized), the per-module quantization entry for
config.json (None when stored as floats; it carries "mode" when that is not affine), and what
the manifest says of it: the source type, the stored format, how it got there (`how`: "exact",
"same grid" or "requantized") and the largest difference from the source's values.

Every type the `gguf` package dequantizes is accepted (`SUPPORTED_TYPES`); `PLANS` says where
each goes. Where MLX holds the same numbers, the codes are carried over and the block scales
become MLX's (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, TQ1_0, TQ2_0 onto affine group 32; MXFP4 onto mode
"mxfp4", NVFP4 onto "nvfp4"); for Q4_K, Q5_K and IQ1_S the codes carry over too, but their
per-32 scales (products of a float16 and a small integer) are rounded to float16. Exactness is
never assumed: every tensor's stored values are compared with the `gguf` package's
dequantization of the source, and only equal ones are called exact. Types whose grids MLX has
no counterpart for (sub-blocks of 16, lattice codebooks, non-uniform levels) are dequantized
and requantized at the width in `PLANS` (one above the source's code width, see there),
group 32. A quantized tensor that is not a matrix's
weight (a norm, a bias) is stored as float32, its dequantized values exactly. ImportFailed
names the tensor when the stored numbers are not finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import ImportFailed

GROUP = 32
# A tensor is converted this many values at a time: its float32 copies (the source's values,
# MLX's, the check between them) stay about 16 MB each however large the tensor is.
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Plan:
    """Where one GGUF type goes in MLX."""

    mode: str  # "float", "affine", "mxfp4" or "nvfp4"
    bits: int
    group: int
    way: str  # "float": kept as floats; "repack": codes carried over; "requantize"
    why: str = ""  # for requantized types: why this width

    @property
    def stored(self) -> str:
        if self.mode == "float":
            return {16: "float16", 32: "float32"}[self.bits]
        if self.mode == "affine":
            return f"affine {self.bits}-bit g{self.group}"
        return f"{self.mode} g{self.group}"


def _repack(bits: int, mode: str = "affine", group: int = GROUP) -> Plan:
    return Plan(mode, bits, group, "repack")


def _requant(bits: int, why: str) -> Plan:
    return Plan("affine", bits, GROUP, "requantize", why)


PLANS: dict[str, Plan] = {
    "F32": Plan("float", 32, 0, "float"),
    "F16": Plan("float", 16, 0, "float"),
    "BF16": Plan("float", 16, 0, "float"),  # stored as bfloat16 (see convert_tensor)
    "Q8_0": _repack(8),
    "Q4_0": _repack(4),
    "Q4_1": _repack(4),
    "Q5_0": _repack(5),
    "Q5_1": _repack(5),
    "Q4_K": _repack(4),
    "Q5_K": _repack(5),
    "TQ1_0": _repack(2),  # ternary codes, one scale per 256: a 2-bit affine grid
    "TQ2_0": _repack(2),
    "IQ1_S": _repack(2),  # three levels (-1, 0, 1 plus a shift) per 32: a 2-bit affine grid
    "MXFP4": _repack(4, "mxfp4", 32),
    "NVFP4": _repack(4, "nvfp4", 16),
    # Requantized one MLX width above the source's own code width: re-rounding onto another
    # grid at the same width adds about as much error again as the file's own quantization
    # (measured on llama.cpp's files: 0.7 to 1.2 times its logit error), one width up a
    # quarter to two thirds of it (tests/engine/importers/test_gguf_types.py, MATRIX).
    "Q6_K": _requant(8, "6-bit codes with scales per 16 (MLX groups are 32); no 7-bit"),
    "Q3_K": _requant(4, "3-bit codes with scales per 16"),
    "Q2_K": _requant(3, "2-bit codes with scales and mins per 16"),
    "IQ4_NL": _requant(5, "16 non-uniform levels per 32"),
    "IQ4_XS": _requant(5, "16 non-uniform levels per 32"),
    "IQ3_S": _requant(4, "lattice codebook, about 3.4 bits per weight"),
    "IQ3_XXS": _requant(4, "lattice codebook, about 3.1 bits per weight"),
    "IQ2_S": _requant(3, "lattice codebook, about 2.5 bits per weight"),
    "IQ2_XS": _requant(3, "lattice codebook, about 2.3 bits per weight"),
    "IQ2_XXS": _requant(3, "lattice codebook, about 2.1 bits per weight"),
    "IQ1_M": _requant(3, "three levels with shifts per 8 and scales per 16"),
}
SUPPORTED_TYPES = set(PLANS)
FLOAT_TYPES = {k for k, p in PLANS.items() if p.way == "float"}


@dataclass
class Converted:
    """One tensor as MLX stores it, and what the manifest says of the conversion."""

    arrays: dict[str, Any]  # parameter path -> mx.array
    quant: dict[str, Any] | None  # config.json's entry for the module ({group_size, bits...})
    source: str  # the GGUF type: "Q4_K", "F32", ...
    stored: str  # "affine 4-bit g32", "mxfp4 g32", "float16", ...
    exact: bool  # True when the stored values equal the source's dequantized ones
    bits: int  # stored bits per weight of the values (not counting scales)
    how: str = ""  # "exact", "same grid" (codes kept, scales rounded) or "requantized"
    max_error: float = 0.0  # largest |stored - source| over the tensor
    max_abs: float = 0.0  # largest |source|, to read max_error against

    def __post_init__(self) -> None:
        if not self.how:
            self.how = "exact" if self.exact else "requantized"

    @property
    def label(self) -> str:
        """The manifest's line for it: 'stored (from source, how)', or just 'float32'."""
        if self.quant is None and self.source.lower() == self.stored:
            return self.stored
        how = "same grid, float16 scales" if self.how == "same grid" else self.how
        return f"{self.stored} (from {self.source}, {how})"


# -- bit fields -----------------------------------------------------------------------------
def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte `start` of every block, as float32."""
    return (np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]
            .astype(np.float32))


def _affine_fields(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Per group of 32: (scale, bias) in float32, such that value = scale * code + bias with
    integer codes, as the type's own dequantization computes them."""
    import gguf  # heavy: the type tables, only while converting

    rows = raw.shape[0]
    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = raw.reshape(rows, -1, size)
    if qtype in ("Q4_0", "Q5_0", "Q8_0"):
        d = _f16(blocks, 0)
        return d, d * np.float32({"Q4_0": -8, "Q5_0": -16, "Q8_0": -128}[qtype])
    if qtype in ("Q4_1", "Q5_1"):
        return _f16(blocks, 0), _f16(blocks, 2)
    if qtype in ("Q4_K", "Q5_K"):
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16])
                                                .reshape(-1, 12))
        d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
        scale = d * sc.reshape(rows, -1, 8).astype(np.float32)
        bias = -(dmin * mn.reshape(rows, -1, 8).astype(np.float32))
        return scale.reshape(rows, -1), bias.reshape(rows, -1)
    if qtype in ("TQ1_0", "TQ2_0"):
        d = np.repeat(_f16(blocks, size - 2), 8, axis=-1)  # one scale per 256: 8 groups
        return d, -d
    if qtype == "IQ1_S":
        d = _f16(blocks, 0)[..., None]
        qh = np.ascontiguousarray(blocks[..., 34:50]).view(np.uint16)  # one per 32
        dl = d * (2 * ((qh >> 12) & 7) + 1).astype(np.float32)
        delta = np.where(qh & 0x8000, -gguf.quants.IQ1_S.delta, gguf.quants.IQ1_S.delta)
        return dl.reshape(rows, -1), (dl * (delta - 1).astype(np.float32)).reshape(rows, -1)
    raise ValueError(qtype)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """(R, N) integer codes < 2**bits to MLX's packing: a little-endian bit stream in uint32
    words (element i at bit i * bits), for any width MLX has."""
    rows, n = codes.shape
    groups = codes.reshape(rows, -1, 32).astype(np.uint64)
    out = np.zeros((rows, groups.shape[1], bits), dtype=np.uint64)
    for i in range(32):  # 32 codes fill exactly `bits` words
        word, shift = divmod(i * bits, 32)
        out[..., word] |= (groups[..., i] << np.uint64(shift)) & np.uint64(0xFFFFFFFF)
        if shift + bits > 32:
            out[..., word + 1] |= groups[..., i] >> np.uint64(32 - shift)
    return out.astype(np.uint32).reshape(rows, -1)


def _fp4_codes(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4/NVFP4 blocks to (MLX-packed codes, uint8 scales).

    ggml keeps E2M1 codes with doubled magnitudes (0, 1, 2, 3, 4, 6, 8, 12) and halves the
    scale to match, so code and scale bits are MLX's own: MXFP4's E8M0 byte is MLX's mxfp4
    scale, NVFP4's UE4M3 byte MLX's nvfp4 E4M3 scale (sign clear). Only the nibble order
    differs: ggml puts element j of a block (16 or 32 values) in the low nibble and j + half
    in the high one, MLX packs neighbours.
    """
    rows = raw.shape[0]
    if qtype == "MXFP4":
        blocks = raw.reshape(rows, -1, 17)
        scales, qs = blocks[..., 0], blocks[..., 1:]
    else:
        blocks = raw.reshape(rows, -1, 36)
        scales = blocks[..., :4].reshape(rows, -1)
        qs = blocks[..., 4:].reshape(rows, -1, 4, 8)
        # ggml reads 0x7F as zero and ignores the sign bit; MLX reads 0x7F as NaN.
        scales = scales & np.uint8(0x7F)
        scales = np.where(scales == 0x7F, np.uint8(0), scales)
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, -1)
    packed = np.ascontiguousarray(values[:, 0::2] | (values[:, 1::2] << 4)).astype(np.uint8)
    return (np.ascontiguousarray(packed).view(np.uint32),
            np.ascontiguousarray(scales.reshape(rows, -1)).astype(np.uint8))


# -- conversion -----------------------------------------------------------------------------
def _not_finite(name: str) -> ImportFailed:
    return ImportFailed(f"tensor {name} has values or scales that are not finite numbers "
                        "(corrupt file)")


def _dequantize(name: str, data: np.ndarray, qtype: str, rows: int) -> np.ndarray:
    import gguf  # heavy: the dequantizers, only while converting

    with np.errstate(over="ignore", invalid="ignore"):
        dense = gguf.quants.dequantize(data.reshape(rows, -1), gguf.GGMLQuantizationType[qtype])
    dense = np.asarray(dense, dtype=np.float32).reshape(rows, -1)
    if not np.isfinite(dense).all():
        raise _not_finite(name)
    return dense


def _affine_repack(name: str, raw: np.ndarray, dense: np.ndarray, qtype: str, bits: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Codes and scales carried over; None when the codes do not fit (then requantize)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        scale, bias = _affine_fields(raw, qtype)
        s16, b16 = scale.astype(np.float16), bias.astype(np.float16)
    if not (np.isfinite(s16).all() and np.isfinite(b16).all()):
        raise _not_finite(name)
    rows = dense.shape[0]
    g = dense.reshape(rows, -1, GROUP)
    s, b = scale[..., None], bias[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(s == 0, 0.0, np.rint((g - b) / np.where(s == 0, 1, s)))
    codes = np.clip(codes, 0, 2**bits - 1)
    # The codes must rebuild the source's values from its own scales: else the fields were
    # not what this type's layout says (a file we misread), and requantizing is safe.
    if (np.abs(codes * s + b - g) > 1e-3 * np.abs(s) + 1e-30).any():
        return None
    q = pack_codes(codes.astype(np.uint32).reshape(rows, -1), bits)
    return q, s16, b16


def _stored_error(parts: tuple[Any, ...], plan: Plan, dense: np.ndarray) -> float:
    """Largest |MLX's dequantization of `parts` - the source's values| over one chunk."""
    import mlx.core as mx  # heavy: only while converting

    w, s, *b = parts
    stored = np.array(mx.dequantize(w, s if plan.mode != "affine" else s.astype(mx.float32),
                                    b[0].astype(mx.float32) if b else None,
                                    group_size=plan.group, bits=plan.bits, mode=plan.mode,
                                    dtype=mx.float32))
    return float(np.abs(stored - dense).max(initial=0.0))


def _repack_rows(name: str, raw: np.ndarray, qtype: str, plan: Plan
                 ) -> tuple[tuple[Any, ...], float, float] | None:
    """One chunk of rows with its codes carried over: (arrays, max error, max |value|), or
    None when they do not carry over (then the whole tensor is requantized)."""
    import mlx.core as mx  # heavy: only while converting

    dense = _dequantize(name, raw, qtype, raw.shape[0])
    if plan.mode == "affine":
        triple = _affine_repack(name, raw, dense, qtype, plan.bits)
        if triple is None:
            return None
        parts: tuple[Any, ...] = tuple(mx.array(a) for a in triple)
    else:
        parts = tuple(mx.array(a) for a in _fp4_codes(raw, qtype))
    err = _stored_error(parts, plan, dense)
    if plan.mode != "affine" and err != 0.0:
        return None  # a scale MLX cannot hold (NVFP4 with its sign bit set)
    return parts, err, float(np.abs(dense).max(initial=0.0))


def _requant_rows(name: str, raw: np.ndarray, qtype: str, plan: Plan
                  ) -> tuple[tuple[Any, ...], float, float]:
    import mlx.core as mx  # heavy: only while converting

    dense = _dequantize(name, raw, qtype, raw.shape[0])
    qw, qs, qb = mx.quantize(mx.array(dense), group_size=plan.group, bits=plan.bits)
    parts = (qw, qs.astype(mx.float16), qb.astype(mx.float16))
    return parts, _stored_error(parts, plan, dense), float(np.abs(dense).max(initial=0.0))


def _matrix(name: str, raw: np.ndarray, qtype: str, plan: Plan
            ) -> tuple[Plan, tuple[Any, ...], str, float, float]:
    """A quantized matrix, CHUNK_ELEMENTS values at a time (so that no float32 copy of a
    whole large tensor is ever held): (plan used, arrays, how, max error, max |value|)."""
    import mlx.core as mx  # heavy: only while converting

    rows = raw.shape[0]
    cols = raw.shape[1] * _values_per_byte(qtype)
    step = max(1, int(CHUNK_ELEMENTS // max(cols, 1)))
    spans = [(a, min(a + step, rows)) for a in range(0, rows, step)]
    done: list[tuple[tuple[Any, ...], float, float]] = []
    how = "requantized"
    if plan.way == "repack":
        for a, b in spans:
            part = _repack_rows(name, raw[a:b], qtype, plan)
            if part is None:
                done = []
                break
            mx.eval(*part[0])  # materialize now: the chunk's numpy buffers go away
            done.append(part)
        if done:
            err = max(p[1] for p in done)
            how = "exact" if err == 0.0 else "same grid"
    if not done:
        plan = Plan("affine", plan.bits, GROUP, "requantize")
        for a, b in spans:
            part = _requant_rows(name, raw[a:b], qtype, plan)
            mx.eval(*part[0])
            done.append(part)
    arrays = tuple(mx.concatenate([p[0][i] for p in done], axis=0) if len(done) > 1
                   else done[0][0][i] for i in range(len(done[0][0])))
    return (plan, arrays, how, max(p[1] for p in done), max(p[2] for p in done))


def _values_per_byte(qtype: str) -> float:
    import gguf  # heavy: the type tables, only while converting

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return block / size


def convert_tensor(name: str, data: np.ndarray, qtype: str, shape: tuple[int, ...]
                   ) -> Converted:
    """One GGUF tensor to MLX arrays; see the module docstring. `shape` is the Hugging Face
    shape ((out, in), or (experts, out, in) for stacked experts)."""
    import mlx.core as mx  # heavy: only while converting

    plan = PLANS[qtype]
    if plan.way == "float":
        if qtype == "BF16":
            # The stored bits as they are (no float32 copy of the tensor on the way).
            bits16 = np.ascontiguousarray(data).view(np.uint16)
            arr = mx.view(mx.array(bits16), mx.bfloat16)
            if not bool(mx.all(mx.isfinite(arr)).item()):
                raise _not_finite(name)
        else:
            arr = mx.array(np.ascontiguousarray(data))
        return Converted({name: arr.reshape(shape)}, None, qtype, qtype.lower(), True,
                         plan.bits, "exact")

    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    module = name.rsplit(".", 1)[0]
    if len(shape) < 2 or not name.endswith(".weight") or shape[-1] % plan.group:
        dense = _dequantize(name, data, qtype, rows)
        # Not a matrix MLX quantizes (a norm, a bias): its values exactly, as float32.
        return Converted({name: mx.array(dense.reshape(shape))}, None, qtype, "float32", True,
                         32, "exact", 0.0, float(np.abs(dense).max(initial=0.0)))
    raw = np.asarray(data).reshape(rows, -1)
    plan, (w, sc, *b), how, err, top = _matrix(name, raw, qtype, plan)
    lead = shape[:-1]
    out = {name: w.reshape(*lead, -1), f"{module}.scales": sc.reshape(*lead, -1)}
    if b:
        out[f"{module}.biases"] = b[0].reshape(*lead, -1)
    quant: dict[str, Any] = {"group_size": plan.group, "bits": plan.bits}
    if plan.mode != "affine":
        quant["mode"] = plan.mode
    return Converted(out, quant, qtype, plan.stored, how == "exact", plan.bits, how, err, top)

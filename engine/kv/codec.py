"""How one page's keys or values are held in RAM and in page records: as computed (16 bits),
or quantized group-wise along head_dim at 8 or 4 bits (MLX's affine format).

Contract: `PageCodec.encode(x)` turns a (..., head_dim) array into a tuple of parts; at 16 bits
the one part is `x` itself, at 8 and 4 bits it is `mx.quantize`'s triple (codes packed in
uint32, scales, biases in the compute dtype). `decode(parts)` returns (..., head_dim) arrays
in the compute dtype, equal to `mx.dequantize`'s. Every part keeps the leading axes, so
slicing or gathering each part alike slices or gathers pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.errors import StrataError
from engine.kv.settings import BITS

Parts = tuple[Any, ...]  # one page's (or many pages') encoded tensor: MLX or numpy arrays


@dataclass(frozen=True)
class PageCodec:
    """bits: 16 (kept as computed), 8 or 4; group: values sharing one scale and bias;
    dtype: the compute dtype's name (also the dtype of scales and biases)."""

    bits: int = 16
    group: int = 64
    dtype: str = "float32"

    @property
    def quantized(self) -> bool:
        return self.bits != 16

    def part_dims(self, head_dim: int) -> tuple[tuple[int, np.dtype], ...]:
        """Per part: the size of its last axis and its numpy dtype."""
        dt = np.dtype(self.dtype)
        if not self.quantized:
            return ((head_dim, dt),)
        groups = head_dim // self.group
        return ((head_dim * self.bits // 32, np.dtype(np.uint32)), (groups, dt), (groups, dt))

    def vector_bytes(self, head_dim: int) -> int:
        """Bytes one head_dim vector (one key or one value of one head) takes encoded."""
        return sum(n * dt.itemsize for n, dt in self.part_dims(head_dim))

    def describe(self) -> str:
        return f"{self.bits}-bit" + (f" (group {self.group})" if self.quantized else "")

    def encode(self, x: Any) -> Parts:
        if not self.quantized:
            return (x,)
        return tuple(mx.quantize(x, group_size=self.group, bits=self.bits))

    def decode(self, parts: Parts) -> Any:
        """Parts back to values. Reading the codes as bytes and scaling them with plain
        element-wise ops is 1.8-3.6x faster than mx.dequantize on MLX's CPU backend (4k
        tokens of starter-model-shaped pages, docs/benchmarks.md) and gives the same
        numbers."""
        if not self.quantized:
            return parts[0]
        codes, scales, biases = parts
        u = codes.view(mx.uint8)  # little-endian: value i of a word sits at byte i
        if self.bits == 4:
            u = mx.stack([u & 15, u >> 4], axis=-1)  # low nibble first, as mx.quantize packs
        lead = scales.shape
        x = u.reshape(*lead, self.group).astype(scales.dtype)
        x = x * scales[..., None] + biases[..., None]
        return x.reshape(*lead[:-1], lead[-1] * self.group)


def codec_for(bits: int, group: int, dtype: str, head_dim: int) -> PageCodec:
    """The codec a store uses; `group` falls back to 32 when it does not divide head_dim."""
    if bits not in BITS:
        raise StrataError(f"KV bits {bits} are not supported: use 16, 8 or 4")
    if bits != 16 and head_dim % group:
        if head_dim % 32:
            raise StrataError(f"KV bits {bits}: head dim {head_dim} is not a multiple of 32, "
                              "the smallest quantization group; use --kv-bits 16")
        group = 32
    return PageCodec(bits, group, dtype)

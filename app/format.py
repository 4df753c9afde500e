"""Plain-text formatting shared by the screens: byte sizes, reply statistics. No Qt.

Contract: every function returns a short human string; a missing figure (None) reads
"unavailable", never "0".
"""

from __future__ import annotations

from typing import Any

from engine.library.manifest import class_formats

UNAVAILABLE = "unavailable"
_FLOATS = ("f32", "f16", "bf16", "float32", "float16", "bfloat16")


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return UNAVAILABLE
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def reply_stats_line(stats: dict[str, Any], status: str = "complete") -> str:
    """'first token 0.23 s · 18.1 tok/s · 36 prompt tokens (20 cached) · 40 tokens'."""
    parts: list[str] = []
    if "ttft_s" in stats:
        first = f"first token {stats['ttft_s']:.2f} s"
        load = stats.get("phases", {}).get("load")
        if load:
            first += f" (+{load:.1f} s loading)"
        parts.append(first)
    if stats.get("generated_tokens", 0) > 1:
        parts.append(f"{stats.get('decode_tps', 0.0):.1f} tok/s")
    if "prompt_tokens" in stats:
        parts.append(f"{stats['prompt_tokens']} prompt tokens "
                     f"({stats.get('cached_tokens', 0)} cached)")
    if "generated_tokens" in stats:
        parts.append(f"{stats['generated_tokens']} tokens")
    if status == "interrupted":
        parts.append("interrupted")
    elif stats.get("finish_reason") == "length":
        parts.append("stopped at the token limit")
    return " · ".join(parts)


def _short(stored: str) -> str:
    """'affine 4-bit g32' -> '4-bit'; 'mxfp4 g32' -> 'mxfp4'; 'f16' -> 'f16'."""
    return stored.replace("affine ", "").split(" g")[0]


def quantization_summary(manifest: dict[str, Any]) -> str:
    """A short label for a manifest's quantization: '4-bit, 8-bit embedding'."""
    by_format: dict[str, list[str]] = {}
    for group, formats in class_formats(manifest).items():
        for fmt in formats:
            by_format.setdefault(_short(fmt["stored"]), []).append(group)
    if not by_format:
        return UNAVAILABLE
    weights = {k: v for k, v in by_format.items() if k not in _FLOATS or len(by_format) == 1}
    if not weights:
        weights = by_format
    main = max(weights, key=lambda k: len(weights[k]))
    rest = [f"{k} {', '.join(sorted(v))}" for k, v in sorted(weights.items()) if k != main]
    return ", ".join([main, *rest])


def quantization_details(manifest: dict[str, Any]) -> str:
    """One line per tensor class: its stored formats and, for converted ones, the source type
    and whether the values are exactly the source's ('mlp: Q4_K -> affine 4-bit g32, same
    grid, float16 scales')."""
    quant = manifest.get("quantization") or {}
    if not isinstance(quant, dict):
        return str(quant)
    lines = []
    for group, formats in class_formats(manifest).items():
        parts = [fmt["stored"] if fmt["source"] is None
                 else f"{fmt['source']} -> {fmt['stored']}, {fmt['how']}" for fmt in formats]
        lines.append(f"{group}: {'; '.join(parts)}")
    return "\n".join(lines)

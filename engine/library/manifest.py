"""What a manifest says about a model's weights: the fields every import and quantization writes.

Contract: `weight_stats(arrays, config)` reads per-class formats, bits per weight and the
parameter count from the arrays as saved (MLX affine triples counted at their bits, anything
else at its dtype); `manifest_fields(...)` is the dict an importer or the quantizer returns
from its Library.install builder (the library adds name, aliases, bytes, fingerprint, dates).
A manifest's "quantization" maps each tensor class to its format labels; an importer that
converted from another format writes 'stored (from SOURCE, how)' ("affine 4-bit g32 (from
Q4_K, same grid, float16 scales)"), and `parse_format(label)` / `class_formats(manifest)` read
them back as (source, stored, how, exact) for the library's display.
Plain data only: no MLX import (the arrays' nbytes, size and dtype are all it reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.library.store import Manifest

# Substring of a parameter path (Hugging Face / mlx-lm names) -> its class in the manifest.
_CLASSES = (
    ("embed_tokens", "embedding"),
    ("lm_head", "output"),
    ("self_attn", "attention"),
    ("mlp", "mlp"),
    ("norm", "norm"),
)


def weight_class(name: str) -> str:
    """The manifest's class of a parameter path: embedding, output, attention, mlp, norm, other."""
    for key, cls in _CLASSES:
        if key in name:
            return cls
    return "other"


def weight_stats(arrays: Mapping[str, Any], config: Mapping[str, Any]
                 ) -> tuple[dict[str, list[str]], float, int]:
    """(formats per class, bits per weight, parameter count) of arrays as saved with `config`."""
    quant = config.get("quantization") or {}
    default = {"bits": quant.get("bits", 4), "group_size": quant.get("group_size", 64)}
    formats: dict[str, set[str]] = {}
    params = 0
    bits_total = 0
    for key, arr in arrays.items():
        bits_total += arr.nbytes * 8
        if key.endswith((".scales", ".biases")):
            continue
        module = key.rsplit(".", 1)[0]
        q = quant.get(module)
        if not isinstance(q, dict) and f"{module}.scales" in arrays:
            q = default  # quantized with the folder-wide settings (uniform MLX models)
        if isinstance(q, dict) and key.endswith(".weight"):
            mode = q.get("mode", quant.get("mode", "affine"))
            bits = int(q.get("bits", 4))
            group = q.get("group_size", {"mxfp4": 32, "nvfp4": 16, "mxfp8": 32}.get(mode, 64))
            params += arr.size * 32 // bits
            # The same words as the GGUF importer's labels: "affine 4-bit g32", "mxfp4 g32".
            fmt = f"affine {bits}-bit g{group}" if mode == "affine" else f"{mode} g{group}"
        else:
            params += arr.size
            fmt = str(arr.dtype).split(".")[-1]
        formats.setdefault(weight_class(key), set()).add(fmt)
    return {k: sorted(v) for k, v in sorted(formats.items())}, bits_total / max(params, 1), params


def parse_format(label: str) -> dict[str, Any]:
    """One format label as {"stored", "source", "how", "exact"}.

    'affine 4-bit g32 (from Q4_0, exact)' -> source Q4_0, stored 'affine 4-bit g32', how
    'exact', exact True; a bare label ('f16', 'affine 4-bit g64') was stored as it came:
    source None, how 'as stored', exact True (nothing was converted)."""
    text = str(label)
    if text.endswith(")") and " (from " in text:
        stored, rest = text[:-1].split(" (from ", 1)
        source, _, how = rest.partition(", ")
        how = how or "exact"
        return {"stored": stored, "source": source, "how": how, "exact": how == "exact"}
    return {"stored": text, "source": None, "how": "as stored", "exact": True}


def class_formats(manifest: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per tensor class, its formats parsed (`parse_format`), in the manifest's order."""
    quant = manifest.get("quantization") or {}
    if not isinstance(quant, Mapping):
        return {}
    return {str(cls): [parse_format(f) for f in (fmts if isinstance(fmts, list) else [fmts])]
            for cls, fmts in sorted(quant.items())}


def manifest_fields(
    config: Mapping[str, Any],
    fmt: str,
    source: str,
    formats: dict[str, list[str]],
    bpw: float,
    params: int,
    tokenizer: dict[str, Any],
) -> Manifest:
    """The manifest entries every import and quantization writes (the library adds the rest)."""
    return {
        "source": source,
        "source_format": fmt,
        "architecture": config.get("model_type"),
        "quantization": formats,
        "bits_per_weight": round(bpw, 3),
        "params": params,
        "context_length": config.get("max_position_embeddings"),
        "tokenizer": tokenizer,
    }

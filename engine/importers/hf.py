"""Hugging Face and MLX folders to a library folder.

Contract: `import_folder(src, dest, kind, ...)`: for kind 'mlx' the folder is validated (the
weights load strictly into mlx-lm's architecture) and copied as is; for kind 'hf' the float
weights are converted with mlx-lm's model class and quantized with the default recipe (8-bit
embeddings and output head, 4-bit elsewhere, group 64). Tokenizer files are copied.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.errors import Cancelled, ImportFailed, LoadFailed

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
DEFAULT_RECIPE = {"group_size": 64, "bits": 4, "high_bits": 8}


def _check_tokenizer(src: Path) -> dict[str, Any]:
    if (src / "tokenizer.json").is_file():
        return {"tokenizer": "tokenizers"}
    if (src / "tokenizer.model").is_file():
        return {"tokenizer": "sentencepiece"}
    raise ImportFailed(f"{src}: no tokenizer (tokenizer.json or tokenizer.model)")


def _stats(weights: dict[str, Any], config: dict[str, Any]) -> tuple[dict[str, list[str]], float, int]:
    """Per-class formats, bits per weight and parameter count from saved arrays."""
    from engine.importers.gguf import _tensor_class

    quant = config.get("quantization") or {}
    formats: dict[str, set[str]] = {}
    params = 0
    bits_total = 0
    for key, arr in weights.items():
        bits_total += arr.nbytes * 8
        if key.endswith((".scales", ".biases")):
            continue
        module = key.rsplit(".", 1)[0]
        q = quant.get(module)
        if isinstance(q, dict) and key.endswith(".weight"):
            params += arr.size * 32 // q["bits"]
            fmt = f"affine {q['bits']}-bit g{q['group_size']}"
        else:
            params += arr.size
            fmt = str(arr.dtype).split(".")[-1]
        formats.setdefault(_tensor_class(key), set()).add(fmt)
    return {k: sorted(v) for k, v in sorted(formats.items())}, bits_total / max(params, 1), params


def import_folder(
    src: Path,
    dest: Path,
    kind: str,
    progress: Callable[[int, int], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from engine.runtime.model import build_model, read_config

    try:
        config = read_config(src)
    except LoadFailed as exc:
        raise ImportFailed(str(exc)) from exc
    tokenizer = _check_tokenizer(src)
    files = sorted(src.glob("*.safetensors"))
    weights: dict[str, Any] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as exc:
            raise ImportFailed(f"{f}: unreadable safetensors ({exc})") from exc
    try:
        model = build_model(config, weights if kind == "mlx" else None)
    except (LoadFailed, TypeError, KeyError, ValueError) as exc:
        raise ImportFailed(f"{src}: unsupported model ({exc})") from exc
    if kind == "hf":
        weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ImportFailed(f"{src}: weights do not match config.json ({exc})") from exc
    if cancel is not None and cancel():
        raise Cancelled("import")
    total = len(files) + 2
    if progress is not None:
        progress(1, total)

    if kind == "mlx":
        for i, f in enumerate(files):
            shutil.copy2(f, dest / f.name)
            if cancel is not None and cancel():
                raise Cancelled("import")
            if progress is not None:
                progress(2 + i, total)
        shutil.copy2(src / "config.json", dest / "config.json")
        saved = weights
    else:
        gs, bits, high = (DEFAULT_RECIPE[k] for k in ("group_size", "bits", "high_bits"))
        per_path: dict[str, Any] = {}

        def predicate(path: str, module: Any) -> bool | dict[str, Any]:
            if not hasattr(module, "to_quantized") or module.weight.shape[-1] % gs:
                return False
            b = high if ("embed" in path or "lm_head" in path) else bits
            per_path[path] = {"group_size": gs, "bits": b}
            return per_path[path]

        nn.quantize(model, group_size=gs, bits=bits, class_predicate=predicate)
        saved = dict(tree_flatten(model.parameters()))
        mx.eval(saved)
        config = dict(config)
        config["quantization"] = {"group_size": gs, "bits": bits, **per_path}
        config["quantization_config"] = config["quantization"]
        mx.save_safetensors(str(dest / "model.safetensors"), saved, metadata={"format": "mlx"})
        (dest / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dest / name)
    if progress is not None:
        progress(total, total)
    formats, bpw, params = _stats(saved, config)
    return {"config": config, "formats": formats, "bits_per_weight": bpw, "params": params,
            "tokenizer": tokenizer}

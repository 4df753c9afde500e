"""Hugging Face and MLX folders to a library folder.

Contract: `import_folder(src, dest, kind, ...)`: for kind 'mlx' the folder is validated (the
weights load strictly into mlx-lm's architecture) and copied as is; for kind 'hf' the float
weights are converted with mlx-lm's model class and quantized with the default recipe (8-bit
embeddings and output head, 4-bit elsewhere, group 64); the recipe yields to the architecture's
own choices where mlx-lm's model class states them (`quant_predicate`: gpt-oss and Qwen3-MoE keep
their routers at 8 bits). Weights a checkpoint already stores in a format MLX holds as is
(`NATIVE_FORMATS`: gpt-oss's MXFP4 experts) are kept, each such layer named in
config["quantization"] with its mode; tensors transformers saves in a layout mlx-lm's sanitize
does not read (`TRANSFORMERS_LAYOUTS`: gpt-oss's float experts, saved input-major) are laid out
as its model holds them first. Tokenizer files are copied. The weight files are those
the loaders read (`select_weight_files`): the shards named by model.safetensors.index.json,
else model*.safetensors, so that stray checkpoints in the same folder (Mistral's
consolidated.safetensors) are ignored. `read_folder(src, kind)` is the
checked read both the import and engine.importers.source (float weights for quantization) use:
config, tokenizer and weight files checked, the weights loaded strictly into the model class.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from engine.errors import Cancelled, ImportFailed, LoadFailed
from engine.library.manifest import weight_stats
from engine.runtime.model import build_model, model_module, read_config

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
INDEX_FILE = "model.safetensors.index.json"
# Pre-quantized checkpoints whose packed weights MLX holds as they are: quant_method -> the MLX
# settings of the layers whose scales the checkpoint carries (after mlx-lm's sanitize, which
# turns gpt-oss's `*_blocks`/`*_scales` into weight/scales pairs).
NATIVE_FORMATS: dict[str, dict[str, Any]] = {
    "mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"},
}


def _gpt_oss_float_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's float experts (a BF16 checkpoint) under the names and layout of mlx-lm's model.

    transformers saves them input-major, gate and up interleaved on the last axis: gate_up_proj
    (experts, hidden, 2 x inter), down_proj (experts, inter, hidden), with *_bias beside them.
    mlx-lm's sanitize reads only the MXFP4 checkpoint's output-major blocks (its float path
    names no `.weight`), so the split is made here; sanitize then leaves the folder as it is.
    """
    import mlx.core as mx  # heavy: MLX loads only when weights are read

    out: dict[str, Any] = {}
    for k, v in weights.items():
        base, _, name = k.rpartition(".")
        if not base.endswith(".mlp.experts"):
            out[k] = v
        elif name == "gate_up_proj":
            rows = mx.swapaxes(v, -1, -2)  # (experts, 2 x inter, hidden)
            out[f"{base}.gate_proj.weight"] = mx.contiguous(rows[:, ::2])
            out[f"{base}.up_proj.weight"] = mx.contiguous(rows[:, 1::2])
        elif name == "gate_up_proj_bias":
            out[f"{base}.gate_proj.bias"] = mx.contiguous(v[..., ::2])
            out[f"{base}.up_proj.bias"] = mx.contiguous(v[..., 1::2])
        elif name == "down_proj":
            out[f"{base}.down_proj.weight"] = mx.contiguous(mx.swapaxes(v, -1, -2))
        elif name == "down_proj_bias":
            out[f"{base}.down_proj.bias"] = v
        else:
            out[k] = v
    return out


# model_type -> the change that turns transformers' saved tensors into what mlx-lm's model
# reads, where its sanitize does not (applied before it, to Hugging Face folders only).
TRANSFORMERS_LAYOUTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "gpt_oss": _gpt_oss_float_experts,
}


def select_weight_files(names: Iterable[str], index_text: str | None = None) -> list[str]:
    """The weight files a loader reads among top-level file `names`.

    The shards named by the index when there is one, else model*.safetensors (what mlx-lm and
    engine.runtime.model load), else any *.safetensors (Hugging Face folders named otherwise).
    """
    names = sorted({n for n in names if "/" not in n and n.endswith(".safetensors")})
    if index_text is not None:
        try:
            weight_map = json.loads(index_text).get("weight_map")
        except (ValueError, AttributeError):
            weight_map = None
        if isinstance(weight_map, dict) and weight_map:
            return sorted({str(v) for v in weight_map.values()})
    preferred = [n for n in names if n.startswith("model")]
    return preferred or names


def check_config(config: dict[str, Any], where: str) -> str:
    """'mlx' or 'hf' for a model config; ImportFailed when no import can succeed.

    Cheap (no weights read): the hub download runs it before fetching any weights.
    """
    kind = "mlx" if "quantization" in config else "hf"
    method = (config.get("quantization_config") or {}).get("quant_method")
    if kind == "hf" and method and method not in NATIVE_FORMATS:
        raise ImportFailed(f"{where}: pre-quantized checkpoints ({method}) are not supported; "
                           "use the float (or an MLX) version of the model")
    model_type = config.get("model_type")
    if not model_type:
        raise ImportFailed(f"{where}: config.json names no model_type")
    try:
        model_module(str(model_type))
    except LoadFailed as exc:
        raise ImportFailed(f"{where}: {exc}") from exc
    return kind


def _one_line(text: object, limit: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _mismatch(model: Any, weights: dict[str, Any]) -> str | None:
    """Why `weights` do not fit `model` exactly, in one line; None when they do."""
    from mlx.utils import tree_flatten  # heavy: MLX loads only when weights are read

    flat: Any = tree_flatten(model.parameters())
    expected = {k: tuple(v.shape) for k, v in flat}
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    shapes = sorted(k for k in set(expected) & set(weights)
                    if tuple(weights[k].shape) != expected[k])

    def some(keys: list[str]) -> str:
        more = f", and {len(keys) - 3} more" if len(keys) > 3 else ""
        return ", ".join(keys[:3]) + more

    def n(keys: list[str]) -> str:
        return f"{len(keys)} tensor{'s' if len(keys) != 1 else ''}"

    parts = []
    if missing:
        parts.append(f"{n(missing)} missing ({some(missing)})")
    if extra:
        parts.append(f"{n(extra)} not in the model ({some(extra)})")
    if shapes:
        k = shapes[0]
        parts.append(f"{n(shapes)} of the wrong shape ({k}: "
                     f"{tuple(weights[k].shape)} in the file, {expected[k]} from the config)")
    return "; ".join(parts) or None


def check_tokenizer(src: Path) -> dict[str, Any]:
    """The manifest's tokenizer entry for a folder; ImportFailed when it has no tokenizer."""
    if (src / "tokenizer.json").is_file():
        return {"tokenizer": "tokenizers"}
    if (src / "tokenizer.model").is_file():
        return {"tokenizer": "sentencepiece"}
    raise ImportFailed(f"{src}: no tokenizer (tokenizer.json or tokenizer.model)")


def read_folder(src: Path, kind: str) -> tuple[dict[str, Any], Any, dict[str, Any], list[Path]]:
    """(config, model, weights, weight files) of an 'hf' or 'mlx' folder, every check made.

    The weights are loaded strictly into mlx-lm's model class (quantized layers where an MLX
    config says so, or where a checkpoint of NATIVE_FORMATS stores them packed); for 'hf'
    `weights` are the sanitized names the model holds.
    """
    import mlx.core as mx  # heavy: MLX loads only when weights are read

    try:
        config = read_config(src)
    except LoadFailed as exc:
        raise ImportFailed(str(exc)) from exc
    check_config(config, str(src))
    check_tokenizer(src)
    index = src / INDEX_FILE
    chosen = select_weight_files([f.name for f in src.glob("*.safetensors")],
                                 index.read_text() if index.is_file() else None)
    outside = [n for n in chosen if Path(n).name != n or n in (".", "..")]
    if outside:
        # An index may name only files of this folder: never ../x or /abs/x.
        raise ImportFailed(f"{src}: {INDEX_FILE} names weight files outside the folder "
                           f"({', '.join(outside[:3])})")
    files = [src / n for n in chosen]
    missing_files = [f.name for f in files if not f.is_file()]
    if missing_files:
        raise ImportFailed(f"{src}: weight files named in {INDEX_FILE} are missing "
                           f"({', '.join(missing_files[:3])})")
    if kind == "mlx" and not all(n.startswith("model") for n in chosen):
        raise ImportFailed(f"{src}: MLX weights must be named model*.safetensors "
                           f"(found {', '.join(chosen[:3])})")
    weights: dict[str, Any] = {}
    for f in files:
        try:
            loaded: Any = mx.load(str(f))
        except (RuntimeError, ValueError) as exc:
            raise ImportFailed(f"{f}: unreadable safetensors ({_one_line(exc)})") from exc
        weights.update(loaded)
    try:
        model = build_model(config, weights if kind == "mlx" else None)
    except (LoadFailed, TypeError, KeyError, ValueError) as exc:
        raise ImportFailed(f"{src}: unsupported model ({_one_line(exc)})") from exc
    layout = TRANSFORMERS_LAYOUTS.get(str(config.get("model_type")))
    if kind == "hf" and layout is not None:
        weights = layout(weights)
    # As mlx-lm's loader does for every folder; for MLX folders it only affects the check.
    checked = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    if kind == "hf":
        weights = checked
        method = (config.get("quantization_config") or {}).get("quant_method")
        native = NATIVE_FORMATS.get(str(method))
        if native is not None:
            _quantize_stored(model, checked, native)
    why = _mismatch(model, checked)
    if why is not None:
        raise ImportFailed(f"{src}: weights do not match config.json: {why}")
    try:
        model.load_weights(list(checked.items()), strict=True)
    except ValueError as exc:
        raise ImportFailed(f"{src}: weights do not match config.json ({_one_line(exc)})") from exc
    return config, model, weights, files


def _quantize_stored(model: Any, weights: dict[str, Any], settings: dict[str, Any]) -> None:
    """Make the layers whose scales `weights` carry quantized layers of `settings`, in place
    (as mlx-lm's loader does for such checkpoints: after sanitize, by the names it gives)."""
    import mlx.nn as nn  # heavy: MLX loads only when weights are read

    nn.quantize(model, group_size=settings["group_size"], bits=settings["bits"],
                mode=settings["mode"],
                class_predicate=lambda p, m: hasattr(m, "to_quantized")
                and f"{p}.scales" in weights)


def _quantized(model: Any) -> dict[str, dict[str, Any]]:
    """Path -> settings of every layer of `model` that is quantized already."""
    return {path: {"group_size": m.group_size, "bits": m.bits,
                   "mode": getattr(m, "mode", "affine")}
            for path, m in model.named_modules()
            if "scales" in m and isinstance(getattr(m, "bits", None), int)}


def import_folder(
    src: Path,
    dest: Path,
    kind: str,
    progress: Callable[[int, int], None] | None = None,
    cancel: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Import folder `src` of `kind` into `dest`; the facts for the manifest (see the module)."""
    import mlx.core as mx  # heavy: MLX loads only when weights are read
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    config, model, weights, files = read_folder(src, kind)
    tokenizer = check_tokenizer(src)  # checked by read_folder, in its order: here the entry
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
        per_path: dict[str, Any] = _quantized(model)  # stored packed: kept (NATIVE_FORMATS)
        own = getattr(model, "quant_predicate", None)  # mlx-lm's choices for the architecture

        def predicate(path: str, module: Any) -> bool | dict[str, Any]:
            if not hasattr(module, "to_quantized") or module.weight.shape[-1] % gs:
                return False
            if "embed" in path or "lm_head" in path:
                per_path[path] = {"group_size": gs, "bits": high}
                return per_path[path]
            choice = own(path, module) if own is not None else True
            if not choice:
                return False
            per_path[path] = (dict(choice) if isinstance(choice, dict)
                              else {"group_size": gs, "bits": bits})
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
    formats, bpw, params = weight_stats(saved, config)
    return {"config": config, "formats": formats, "bits_per_weight": bpw, "params": params,
            "tokenizer": tokenizer}

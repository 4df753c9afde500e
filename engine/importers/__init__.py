"""Anything in, one MLX folder out: detect what a path holds and import it into the library.

Contract: `import_path(library, path, name=None, ...)` returns the new manifest or raises
ImportFailed with one line naming the path and the reason; the library is unchanged on failure.
With `recipe` the weights are requantized by that recipe (and `method`) through the same code
as `strata quantize` (engine.quant.quantize); without it they are kept as stored (GGUF, MLX) or
quantized with the importer's default (Hugging Face folders).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.errors import ImportFailed
from engine.library.store import Library, Manifest, clean_name

Progress = Callable[[int, int], None]
CancelFlag = Callable[[], bool]


def detect(path: Path) -> str:
    """'gguf', 'mlx' or 'hf' for a path that holds a model; ImportFailed otherwise."""
    if not path.exists():
        raise ImportFailed(f"{path}: no such file or folder")
    if path.is_file():
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic == b"GGUF":
            return "gguf"
        raise ImportFailed(f"{path}: not a model file (expected GGUF, found {magic!r})")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf"
        raise ImportFailed(f"{path}: not a model folder (no config.json)")
    if not list(path.glob("*.safetensors")):
        raise ImportFailed(f"{path}: folder has no weights (*.safetensors)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ImportFailed(f"{path / 'config.json'}: unreadable ({exc})") from exc
    if not isinstance(config, dict):
        raise ImportFailed(f"{path / 'config.json'}: not a JSON object")
    return "mlx" if "quantization" in config else "hf"


def summarize_formats(formats: dict[str, set[str]]) -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in sorted(formats.items())}


def import_path(
    library: Library,
    path: Path,
    name: str | None = None,
    aliases: list[str] | None = None,
    source: str | None = None,
    progress: Progress | None = None,
    cancel: CancelFlag | None = None,
    replace: bool = False,
    recipe: str | None = None,
    method: str = "rtn",
    calibration: Path | None = None,
    calibration_tokens: int = 2048,
    target_bpw: float | None = None,
) -> Manifest:
    """Import a GGUF file, an MLX folder or a Hugging Face folder into the library."""
    path = Path(path).expanduser()
    kind = detect(path)
    if kind == "gguf" and path.is_dir():
        path = sorted(path.glob("*.gguf"))[0]
    if recipe is not None:
        from engine.quant.quantize import quantize

        return quantize(library, str(path), recipe,
                        name or clean_name(path.stem if kind == "gguf" else path.resolve().name),
                        target_bpw=target_bpw, calibration=calibration,
                        calibration_tokens=calibration_tokens, method=method,
                        progress=progress, cancel=cancel, replace=replace)
    if method != "rtn" or target_bpw is not None:
        raise ImportFailed("--method and --bpw need --recipe (the weights are kept as stored)")
    if kind == "gguf":
        from engine.importers.gguf import import_gguf, read_metadata

        read_metadata(path)  # fail before touching the library
        default = clean_name(path.stem)

        def build(tmp: Path) -> Manifest:
            result = import_gguf(path, tmp, progress, cancel)
            (tmp / "config.json").write_text(json.dumps(result.config, indent=2))
            return manifest_fields(result.config, "gguf", source or str(path.resolve()),
                             summarize_formats(result.tensor_formats),
                             result.stored_bits / max(result.params, 1), result.params,
                             result.tokenizer)
    else:
        from engine.importers.hf import import_folder

        default = clean_name(path.resolve().name)

        def build(tmp: Path) -> Manifest:
            info = import_folder(path, tmp, kind, progress, cancel)
            return manifest_fields(info["config"], kind, source or str(path.resolve()),
                             info["formats"], info["bits_per_weight"], info["params"],
                             info["tokenizer"])

    return library.install(name or default, build, aliases=aliases, replace=replace)


def manifest_fields(
    config: dict[str, Any],
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

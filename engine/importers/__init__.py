"""Sources in: open any model source, import it into the library as one MLX folder.

What lives here, and only here: reading sources. engine.importers.source opens a .gguf file, a
Hugging Face or MLX folder, or a library model as a typed `Source` (config without weights,
float weights on demand); gguf.py, hf.py and vocab.py read GGUF files, folders and GGUF
vocabularies; hub.py and starter.py fetch a model and end in `import_path`.

Contract: `import_path(library, path, name=None, ...)` returns the new manifest or raises
ImportFailed (or Cancelled) with one line naming the path and the reason; the library is
unchanged on failure or cancel (Library.install). Without `requantize` the weights are kept as
stored (GGUF repacked, MLX copied) or quantized with the importer's default (Hugging Face
folders). With `requantize`, a `Requantizer` (engine.quant.quantize.Requantize is one: the caller
composes the two), the opened source is handed to it, which installs the model it makes under
the same name, progress, cancel and replace.

Floor 3: imports engine.runtime, engine.kv, engine.library and the leaves (engine.errors,
engine.telemetry, engine.platform); never engine.quant or engine.server (the same floor), never
the app.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from engine.importers.gguf import import_gguf
from engine.importers.hf import import_folder
from engine.importers.source import FloatWeights, Source, detect, open_source
from engine.library.manifest import manifest_fields
from engine.library.store import Library, Manifest
from engine.telemetry import CancelFlag, Progress

__all__ = ["FloatWeights", "Requantizer", "Source", "detect", "import_path", "open_source",
           "summarize_formats"]



class Requantizer(Protocol):
    """What `import_path(..., requantize=...)` hands the opened source to, in place of keeping
    its weights: it installs the model it makes from them, atomically, and returns the manifest."""

    def install(self, library: Library, source: Source, name: str, *,
                progress: Progress | None = None, cancel: CancelFlag | None = None,
                replace: bool = False) -> Manifest: ...


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
    requantize: Requantizer | None = None,
    context: int | None = None,
) -> Manifest:
    """Import a GGUF file, an MLX folder or a Hugging Face folder into the library.

    `source` is what the manifest names as the origin (default: the resolved path); `context`
    (tokens), when given, is recorded as the context the model runs at (what the fit was
    counted at; engine.runtime.fit.chosen_context reads it back)."""
    manifest = _import(library, path, name, aliases, source, progress, cancel, replace,
                       requantize)
    if context:
        manifest = library.update(manifest["name"], context=int(context))
    return manifest


def _import(library: Library, path: Path, name: str | None, aliases: list[str] | None,
            source: str | None, progress: Progress | None, cancel: CancelFlag | None,
            replace: bool, requantize: Requantizer | None) -> Manifest:
    opened = open_source(path)  # fails before touching the library
    if requantize is not None:
        return requantize.install(library, opened, name or opened.default_name,
                                  progress=progress, cancel=cancel, replace=replace)
    origin = source or str(opened.path.resolve())
    if opened.kind == "gguf":

        def build(tmp: Path) -> Manifest:
            result = import_gguf(opened.path, tmp, progress, cancel)
            (tmp / "config.json").write_text(json.dumps(result.config, indent=2))
            return manifest_fields(result.config, "gguf", origin,
                                   summarize_formats(result.tensor_formats),
                                   result.stored_bits / max(result.params, 1), result.params,
                                   result.tokenizer)
    else:

        def build(tmp: Path) -> Manifest:
            info = import_folder(opened.path, tmp, opened.kind, progress, cancel)
            return manifest_fields(info["config"], opened.kind, origin, info["formats"],
                                   info["bits_per_weight"], info["params"], info["tokenizer"])

    return library.install(name or opened.default_name, build, aliases=aliases, replace=replace)

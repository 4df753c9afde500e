"""What quantization needs of a model source, as Protocols: it never imports the importers.

Contract: a `QuantSource` says what it is (kind, path, label), gives its model config without
reading weights, the bytes of its tokenizer files, what an import without a recipe would do
(`default_option`, for the import dialog) and, on demand, its weights in float32
(`float_weights` -> `FloatWeights`, open until `close()`). A calibrated method reopens it in a
child process (engine.quant.methods.run_child) from `to_job()`: plain JSON data and the name
of the function that reopens it. engine.importers.source.Source
is one, structurally; the caller opens the source and hands it over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from engine.telemetry import CancelFlag, Progress


class FloatWeights(Protocol):
    """A source's weights expanded to float32, and where its tokenizer files are."""

    @property
    def arrays(self) -> dict[str, Any]:
        """Parameter path (as mlx-lm's model class names it) -> MLX array, floats in float32."""
        ...

    @property
    def config(self) -> dict[str, Any]: ...

    @property
    def folder(self) -> Path:
        """A folder holding the tokenizer files (engine.runtime.tokenizer.Tokenizer.load)."""
        ...

    @property
    def tokenizer(self) -> dict[str, Any]:
        """The manifest's tokenizer entry."""
        ...

    def tokenizer_files(self) -> list[Path]:
        """The files a model made from these weights needs besides them and its config."""
        ...

    def close(self) -> None: ...


class QuantSource(Protocol):
    """A model source opened by the caller (engine.importers.open_source makes them)."""

    @property
    def kind(self) -> str:
        """'gguf', 'hf', 'mlx' or 'library'."""
        ...

    @property
    def path(self) -> Path: ...

    @property
    def label(self) -> str:
        """How a quantized model's manifest names its origin ("quantize:<label>")."""
        ...

    @property
    def config(self) -> dict[str, Any]:
        """The model config, read without the weights."""
        ...

    def tokenizer_bytes(self) -> int: ...

    def to_job(self) -> dict[str, Any]:
        """JSON data, with "reopen": "module:function" that turns it back into a source."""
        ...

    def default_option(self) -> dict[str, Any]:
        """What an import without a recipe does: {"label", "description", "bits_per_weight",
        "bytes"}, for the import dialog."""
        ...

    def float_weights(self, progress: Progress | None = None,
                      cancel: CancelFlag | None = None) -> FloatWeights: ...

"""Activation importance for weighted rounding: what each input column of a tensor sees.

Contract: `activation_importance(model, tokens, ...)` runs the float model over calibration
tokens (never the evaluation text) and returns, for every quantizable tensor path, a float32
vector with one entry per input column: the mean over tokens of the squared activation that
enters that column. A rounding error e_j in column j of a row costs that row's output about
a_j * e_j**2 on average, so `engine.quant.rounding` weighs a group's errors by it (the idea of
llama.cpp's importance matrix, written here for MLX's affine format). For a tied embedding the
entry measures its use as the output head (the final hidden state); an untied embedding, a
lookup table, gets none and is rounded unweighted. The model is left exactly as it was: the
recording wrappers are removed even on error or cancel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.errors import Cancelled
from engine.quant.recipes import quantizable
from engine.telemetry import CancelFlag, Progress

Importance = dict[str, np.ndarray]


def _recorder(inner: Any, sums: dict[str, Any], path: str) -> Any:
    """A module that behaves as `inner` and adds up the squared inputs of its matrix product."""
    import mlx.core as mx  # heavy: MLX loads only when weights are touched
    import mlx.nn as nn

    def record(x: Any) -> None:
        sq = (x.astype(mx.float32) ** 2).reshape(-1, x.shape[-1]).sum(0)
        sums[path] = sums[path] + sq if path in sums else sq

    class Recorder(nn.Module):
        def __call__(self, x: Any) -> Any:
            if isinstance(inner, nn.Linear):
                record(x)
            return inner(x)

        def as_linear(self, x: Any) -> Any:  # a tied embedding used as the output head
            record(x)
            return inner.as_linear(x)

    return Recorder()


def activation_importance(model: Any, tokens: list[int], chunk: int = 512,
                          progress: Progress | None = None, cancel: CancelFlag | None = None
                          ) -> Importance:
    """Path -> mean squared input per column over `tokens`. See the module docstring."""
    import mlx.core as mx  # heavy: MLX loads only when weights are touched

    modules = dict(model.named_modules())
    sums: dict[str, Any] = {}
    swapped: list[tuple[Any, str, Any]] = []
    try:
        for path in quantizable(model):
            parent_path, _, attr = path.rpartition(".")
            parent = modules[parent_path] if parent_path else model
            inner = getattr(parent, attr)
            setattr(parent, attr, _recorder(inner, sums, path))
            swapped.append((parent, attr, inner))
        chunks = [tokens[i: i + chunk] for i in range(0, len(tokens), chunk)]
        for i, c in enumerate(chunks):
            if cancel is not None and cancel():
                raise Cancelled("importance measurement")
            out = model(mx.array(c)[None])
            mx.eval(out, sums)
            if progress is not None:
                progress(i + 1, len(chunks))
    finally:
        for parent, attr, inner in reversed(swapped):
            setattr(parent, attr, inner)
    n = max(len(tokens), 1)
    return {p: np.array(v, dtype=np.float32) / n for p, v in sums.items()}

"""Calibrated quantization through mlx-lm's own quant module (GPTQ, AWQ, DWQ), in a child process.

Contract: `python -m engine.quant.calibrated JOB_JSON` is the child that
engine.quant.methods.run_child starts: it imports the real mlx-lm first, reopens the job's source
(engine.quant.methods.decode_source), runs engine.quant.quantize.quantize with `calibrate` below,
and writes one JSON line per message on stdout (progress, then the manifest or an error).
`calibrate(...)` feeds mlx-lm's `gptq_quantize`, `awq_quantize` or `dwq_quantize` with
calibration tokens from a local text (their own loaders download text) and leaves the model
quantized as the plan says. Which method can apply which plan is engine.quant.methods's
`check_method`, checked in the parent before the child starts. Only the child imports this
module.

Why a child process: mlx-lm's quant modules import the real `mlx_lm` package (and with it
transformers), where the engine registers a bare `mlx_lm` package to keep transformers off the
path to the first token (engine/runtime/model.py). The child imports the real package first.

What mlx-lm's methods allow, and what Strata adds around them:
- gptq: `gptq_quantize` quantizes every `nn.Linear` at one format. Strata calls it once per
  distinct format of the plan, hiding the other layers from it, so any recipe works; Hessians
  always come from the float model. Its packer handles 2, 4 and 8 bits; Strata passes its own
  packer (same MLX layout) for 3, 5 and 6. Embeddings are not `nn.Linear`: rounded to nearest.
- awq: `awq_quantize` gives every transformer block one format, so the recipe must too
  (embeddings and head may differ; Strata rounds them itself, AWQ does not change them).
  Model types: mlx-lm's AWQ_MODEL_CONFIGS.
- dwq: `dwq_quantize` distils the scales and biases of every layer under 8 bits from the
  round-to-nearest model against the float model's logits; any recipe works.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.errors import Cancelled, StrataError
from engine.library.store import Library
from engine.quant.methods import decode_source
from engine.quant.quantize import AWQ_GRID, apply_plan, quantize
from engine.quant.recipes import Format, RecipeError
from engine.quant.rounding import pack as pack_codes
from engine.quant.sensitivity import calibration_tokens
from engine.telemetry import CancelFlag, Progress

SEQUENCE_LENGTH = 512  # calibration sequence length (mlx-lm's default for gptq and awq)
DWQ_LEARNING_RATE = 1e-5
DWQ_BATCH = 2
DWQ_SEQUENCE_LENGTH = 256


# -- the child side -------------------------------------------------------------------------
class _Steps:
    """Steps counted across mlx-lm's loops; reports progress and stops when cancelled."""

    def __init__(self, total: int, progress: Progress | None, cancel: CancelFlag | None
                 ) -> None:
        self.done, self.total = 0, max(total, 1)
        self.progress, self.cancel = progress, cancel

    def check(self) -> None:
        if self.cancel is not None and self.cancel():
            raise Cancelled("quantize")

    def advance(self) -> None:
        self.done += 1
        self.total = max(self.total, self.done + 1)  # the finishing step is the caller's
        if self.progress is not None:
            self.progress(self.done, self.total)

    def bar(self) -> type:
        """A stand-in for tqdm in mlx-lm's modules: every iteration is a step; no output."""
        steps = self

        class Bar:
            def __init__(self, iterable: Any = None, *args: Any, **kwargs: Any) -> None:
                self.iterable = iterable if iterable is not None else []

            def __iter__(self) -> Iterator[Any]:
                for item in self.iterable:
                    steps.check()
                    yield item
                    steps.advance()

            def set_description(self, *args: Any, **kwargs: Any) -> None:
                pass

            def close(self) -> None:
                pass

            @staticmethod
            def write(*args: Any, **kwargs: Any) -> None:
                pass

        return Bar


@contextlib.contextmanager
def _patched(module: Any, **attrs: Any) -> Iterator[None]:
    """Replace module globals for the duration (the child process runs one job)."""
    old = {k: getattr(module, k) for k in attrs}
    for k, v in attrs.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def calibration_batches(tokenizer: Any, text: Path, n_tokens: int, method: str) -> Any:
    """(samples, length) token ids from a local text, in place of mlx-lm's downloaders."""
    import mlx.core as mx  # heavy: MLX loads only when calibrating

    ids = calibration_tokens(tokenizer, text, n_tokens)
    # DWQ trains on batches and keeps one for validation: shorter sequences, more of them.
    longest = DWQ_SEQUENCE_LENGTH if method == "dwq" else SEQUENCE_LENGTH
    length = min(longest, len(ids) // (2 * DWQ_BATCH if method == "dwq" else 2))
    n = len(ids) // length
    return mx.array(ids[: n * length]).reshape(n, length)


def apply_method(method: str, model: Any, config: dict[str, Any], plan: dict[str, Format],
                 data: Any, progress: Progress | None = None,
                 cancel: CancelFlag | None = None, awq_grid: int = AWQ_GRID) -> None:
    """Quantize `model` (float32) in place as `plan` says, calibrated by `method`."""
    steps = _Steps(0, progress, cancel)
    if method == "gptq":
        _gptq(model, plan, data, steps)
    elif method == "awq":
        _awq(model, config, plan, data, steps, awq_grid)
    elif method == "dwq":
        _dwq(model, plan, data, steps)
    else:
        raise RecipeError(f"unknown method {method!r}")


def calibrate(method: str, model: Any, config: dict[str, Any], plan: dict[str, Format],
              tokenizer: Any, text: Path, n_tokens: int, progress: Progress | None = None,
              cancel: CancelFlag | None = None, *, awq_grid: int = AWQ_GRID) -> int:
    """Quantize `model` in place by `method` on `n_tokens` tokens of `text`; the tokens used.

    engine.quant.quantize.Calibrate: what this child passes to `quantize`."""
    data = calibration_batches(tokenizer, text, n_tokens, method)
    apply_method(method, model, config, plan, data, progress, cancel, awq_grid)
    return int(data.size)


def _hold(module: Any) -> Any:
    """A float stand-in for `module` that mlx-lm's quantizers skip: neither nn.Linear nor
    quantizable (no to_quantized), computing exactly what the module computes."""
    import mlx.nn as nn  # heavy: MLX loads only when calibrating

    class Held(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.call = module.__call__  # a bound method: not a child module, so not a leaf
            self.linear: Any = getattr(module, "as_linear", None)  # a tied embedding as head

        def __call__(self, x: Any) -> Any:
            return self.call(x)

        def as_linear(self, x: Any) -> Any:
            return self.linear(x)

    return Held()


def _swap(model: Any, modules: dict[str, Any]) -> None:
    from mlx.utils import tree_unflatten  # heavy: MLX loads only when calibrating

    model.update_modules(tree_unflatten(list(modules.items())))


def _gptq(model: Any, plan: dict[str, Format], data: Any, steps: _Steps) -> None:
    import mlx.nn as nn  # heavy: MLX and mlx-lm's quant modules load only when calibrating
    from mlx_lm.quant import gptq

    modules = dict(model.named_modules())
    originals = {p: modules[p] for p in plan}
    by_format: dict[Format, list[str]] = {}
    for p, f in plan.items():
        if f.quantized and type(modules[p]) is nn.Linear:
            by_format.setdefault(f, []).append(p)
    batches = -(-data.shape[0] // 8)
    steps.total = len(by_format) * batches + sum(map(len, by_format.values())) + 1
    done: dict[str, Any] = {}
    original_pack = gptq.quantize

    def pack(w: Any, bits: int, scales: Any, biases: Any) -> Any:
        return original_pack(w, bits, scales, biases) if bits in (2, 4, 8) else _pack(
            w, bits, scales, biases)

    for fmt, paths in by_format.items():
        # Only this format's layers are nn.Linear now; the rest compute in float, unseen.
        _swap(model, {p: (originals[p] if p in paths else _hold(originals[p])) for p in plan})
        with _patched(gptq, tqdm=steps.bar(), quantize=pack):
            gptq.gptq_quantize(model, data, fmt.bits, fmt.group_size,
                               fallback_bits=fmt.bits, fallback_group_size=fmt.group_size)
        now = dict(model.named_modules())
        done.update({p: now[p] for p in paths})
    _swap(model, {p: done.get(p, originals[p]) for p in plan})
    rest = {p: f for p, f in plan.items() if p not in done}
    apply_plan(model, rest, cancel=steps.cancel)  # embeddings and float16 tensors; casts all
    steps.advance()


def _pack(w: Any, bits: int, scales: Any, biases: Any) -> Any:
    """gptq's `quantize(w, bits, scales, biases)` for widths its packer lacks (3, 5, 6)."""
    import mlx.core as mx  # heavy: MLX loads only when calibrating
    import numpy as np

    wg = mx.unflatten(w, -1, (scales.shape[-1], -1))
    q = mx.clip(mx.round((wg - biases[..., None]) / scales[..., None]), 0, 2 ** bits - 1)
    q = q.astype(mx.uint8).reshape(w.shape)
    mx.eval(q)
    return mx.array(pack_codes(np.array(q), bits))


def _awq(model: Any, config: dict[str, Any], plan: dict[str, Format], data: Any,
         steps: _Steps, n_grid: int) -> None:
    from mlx_lm.quant import awq  # heavy: mlx-lm's quant modules load only when calibrating

    model_type = str(config.get("model_type"))
    cfg = awq.AWQ_MODEL_CONFIGS.get(model_type)
    if cfg is None:
        raise RecipeError(f"method 'awq': mlx-lm has no AWQ configuration for {model_type!r} "
                          f"models (it has {', '.join(sorted(awq.AWQ_MODEL_CONFIGS))})")
    block = next(f for p, f in plan.items() if ".layers." in f".{p}.")
    modules = dict(model.named_modules())
    outside = {p: modules[p] for p in plan if ".layers." not in f".{p}."}
    steps.total = len(model.layers) + 1
    with _patched(awq, tqdm=steps.bar()):
        awq.awq_quantize(model, data, cfg, group_size=block.group_size, bits=block.bits,
                         embed_group_size=block.group_size, embed_bits=block.bits,
                         n_grid=n_grid)
    # AWQ does not change embeddings or the head (its scales go into norms and blocks); it
    # rounds them with MLX's grid. Strata rounds them as the recipe says, with its own grid.
    _swap(model, outside)
    apply_plan(model, {p: plan[p] for p in outside}, cancel=steps.cancel)
    steps.advance()


def _dwq(model: Any, plan: dict[str, Format], data: Any, steps: _Steps) -> None:
    import mlx.core as mx  # heavy: MLX and mlx-lm's quant modules load only when calibrating
    import mlx.optimizers as optimizers
    from mlx.utils import tree_map
    from mlx_lm.quant import dwq

    teacher = copy.deepcopy(model)
    teacher.eval()
    apply_plan(model, plan, cancel=steps.cancel, dtype="float32")  # the student: RTN first
    rows = [(r, 0) for r in data.tolist()]
    n_valid = DWQ_BATCH if len(rows) >= 2 * DWQ_BATCH else 0
    train, valid = rows[n_valid:], rows[:n_valid] or rows[:DWQ_BATCH]
    if len(train) < DWQ_BATCH:
        raise StrataError(f"method 'dwq' needs at least {DWQ_BATCH * 2} calibration "
                          f"sequences of {data.shape[1]} tokens (got {len(rows)})")
    n_train = len(train) // DWQ_BATCH
    steps.total = n_train + 2 * max(len(valid) // DWQ_BATCH, 1) + 1

    def targets(batch: Any, idx: int, split: str) -> Any:
        return mx.stop_gradient(teacher(batch))

    opt = optimizers.Adam(learning_rate=DWQ_LEARNING_RATE, bias_correction=True)
    with _patched(dwq, tqdm=steps.bar()):
        dwq.dwq_quantize(model, targets, opt, train, valid, batch_size=DWQ_BATCH,
                         max_seq_length=data.shape[1] + 1, seed=0, dtype=mx.float32)
    model.eval()
    model.update(tree_map(lambda a: a.astype(mx.float16)
                          if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))
    steps.advance()


def main(argv: list[str]) -> int:
    """`python -m engine.quant.calibrated JOB_JSON`: one JSON line per message on stdout."""
    import mlx_lm  # noqa: F401  (the real package, before the engine could register a bare one)

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything mlx-lm prints goes to stderr; stdout carries messages only

    def send(**msg: Any) -> None:
        out.write(json.dumps(msg) + "\n")

    # SIGINT and SIGTERM stop it like Ctrl-C (cleaning up), even where the parent was started
    # with SIGINT ignored (a background job of a shell); so does the parent's death.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    parent = os.getppid()
    job = json.loads(argv[0])
    try:
        manifest = quantize(
            Library(Path(job["home"])), decode_source(job["source"]), job["recipe"],
            job["name"], target_bpw=job.get("target_bpw"),
            calibration=Path(job["calibration"]) if job.get("calibration") else None,
            calibration_tokens=job["calibration_tokens"], method=job["method"],
            replace=job.get("replace", False), calibrate=calibrate,
            awq_grid=job.get("awq_grid", AWQ_GRID),
            progress=lambda done, total: send(progress=[done, total]),
            cancel=lambda: os.getppid() != parent)
    except StrataError as exc:
        send(error=str(exc))
        return 1
    except KeyboardInterrupt:
        return 130
    send(manifest=manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

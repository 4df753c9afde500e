"""Calibrated quantization through mlx-lm's own quant module (GPTQ, AWQ, DWQ), in a child process.

Contract: `check_method(method, plan, ...)` says, before any weight is read, whether a method
can apply a recipe's plan (RecipeError with one line otherwise). `run_child(library, job, ...)`
runs one quantize job (engine.quant.quantize.quantize with in_child=True) in a separate Python
process, relays its progress(done, total), stops it when the cancel flag is set (or on Ctrl-C)
and returns the installed manifest; the child installs through Library.install, so a stopped
job leaves the library as it was. `apply_method(...)` runs in that child: it feeds mlx-lm's
`gptq_quantize`, `awq_quantize` or `dwq_quantize` with calibration tokens from a local text
(their own loaders download text) and leaves the model quantized as the plan says.

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
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine.errors import Cancelled, StrataError
from engine.platform import stop_child
from engine.quant.recipes import Format, RecipeError

Progress = Callable[[int, int], None]
CancelFlag = Callable[[], bool]
METHODS = ("rtn", "imatrix", "gptq", "awq", "dwq")
CALIBRATED = ("gptq", "awq", "dwq")  # mlx-lm's, run in a child process
# Methods that read calibration text; imatrix (Strata's weighted rounding) runs in-process.
NEEDS_CALIBRATION = ("imatrix", *CALIBRATED)
SEQUENCE_LENGTH = 512  # calibration sequence length (mlx-lm's default for gptq and awq)
DWQ_LEARNING_RATE = 1e-5
DWQ_BATCH = 2
DWQ_SEQUENCE_LENGTH = 256


def check_method(method: str, plan: dict[str, Format] | None, recipe_name: str,
                 model_type: str | None) -> None:
    """RecipeError (one line) when `method` is unknown or cannot apply `plan`.

    `plan` is None for recipe 'auto' (its allocation is not known before measuring).
    """
    if method not in METHODS:
        raise RecipeError(f"unknown method {method!r} (use {', '.join(METHODS)})")
    if method != "awq":
        return
    if plan is None:
        raise RecipeError("method 'awq' cannot follow recipe 'auto': mlx-lm's AWQ gives every "
                          "transformer block one format, and auto mixes formats")
    block = {f for p, f in plan.items() if ".layers." in f".{p}."}
    if len(block) > 1:
        labels = ", ".join(sorted(f.label() for f in block))
        raise RecipeError(f"method 'awq' cannot apply recipe {recipe_name!r}: mlx-lm's AWQ "
                          f"gives every transformer block one format, the recipe uses "
                          f"{labels} (use gptq or dwq for mixed recipes)")
    if any(not f.quantized for f in block):
        raise RecipeError(f"method 'awq' cannot apply recipe {recipe_name!r}: its blocks stay "
                          "float16, there is nothing to calibrate")


# -- the parent side ------------------------------------------------------------------------
def run_child(home: Path, job: dict[str, Any], progress: Progress | None = None,
              cancel: CancelFlag | None = None) -> dict[str, Any]:
    """Run a quantize job in a child process; the installed manifest. See the module docs."""
    from engine.library.store import Library

    cmd = [sys.executable, "-m", "engine.quant.calibrated", json.dumps(job)]
    env = dict(os.environ, STRATA_HOME=str(home))
    lines: queue.Queue[str | None] = queue.Queue()
    with tempfile.TemporaryFile(mode="w+") as err, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
            cwd=Path(__file__).resolve().parents[2]) as proc:

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        result: dict[str, Any] = {}
        try:
            while True:
                if cancel is not None and cancel():
                    raise Cancelled("quantize")
                try:
                    line = lines.get(timeout=0.2)
                except queue.Empty:
                    continue
                if line is None:
                    break
                msg = json.loads(line) if line.startswith("{") else {}
                if "progress" in msg and progress is not None:
                    progress(*msg["progress"])
                result.update({k: v for k, v in msg.items() if k != "progress"})
            proc.wait()
        except BaseException:  # cancelled or Ctrl-C: stop the child, which cleans up
            # SIGINT: the child raises KeyboardInterrupt and removes its temporary folder.
            stop_child(proc, signal.SIGINT, 30)
            Library(home)  # sweeps a temporary folder the child could not remove
            raise
        if "error" in result:
            raise StrataError(str(result["error"]))
        if "manifest" not in result:
            Library(home)  # a child that died (killed, out of memory) left its folder
            err.seek(0)
            tail = [x for x in err.read().splitlines() if x.strip()]
            why = tail[-1] if tail else f"exit status {proc.returncode}"
            raise StrataError(f"calibrated quantization failed: {why}")
        manifest: dict[str, Any] = result["manifest"]
        return manifest


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
    import mlx.core as mx

    from engine.quant.sensitivity import calibration_tokens

    ids = calibration_tokens(tokenizer, text, n_tokens)
    # DWQ trains on batches and keeps one for validation: shorter sequences, more of them.
    longest = DWQ_SEQUENCE_LENGTH if method == "dwq" else SEQUENCE_LENGTH
    length = min(longest, len(ids) // (2 * DWQ_BATCH if method == "dwq" else 2))
    n = len(ids) // length
    return mx.array(ids[: n * length]).reshape(n, length)


def apply_method(method: str, model: Any, config: dict[str, Any], plan: dict[str, Format],
                 data: Any, progress: Progress | None = None,
                 cancel: CancelFlag | None = None) -> None:
    """Quantize `model` (float32) in place as `plan` says, calibrated by `method`."""
    steps = _Steps(0, progress, cancel)
    if method == "gptq":
        _gptq(model, plan, data, steps)
    elif method == "awq":
        _awq(model, config, plan, data, steps)
    elif method == "dwq":
        _dwq(model, plan, data, steps)
    else:
        raise RecipeError(f"unknown method {method!r}")


def _hold(module: Any) -> Any:
    """A float stand-in for `module` that mlx-lm's quantizers skip: neither nn.Linear nor
    quantizable (no to_quantized), computing exactly what the module computes."""
    import mlx.nn as nn

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
    from mlx.utils import tree_unflatten

    model.update_modules(tree_unflatten(list(modules.items())))


def _gptq(model: Any, plan: dict[str, Format], data: Any, steps: _Steps) -> None:
    import mlx.nn as nn
    from mlx_lm.quant import gptq

    from engine.quant.quantize import apply_plan

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
    import mlx.core as mx
    import numpy as np

    from engine.quant.rounding import pack

    wg = mx.unflatten(w, -1, (scales.shape[-1], -1))
    q = mx.clip(mx.round((wg - biases[..., None]) / scales[..., None]), 0, 2 ** bits - 1)
    q = q.astype(mx.uint8).reshape(w.shape)
    mx.eval(q)
    return mx.array(pack(np.array(q), bits))


def _awq(model: Any, config: dict[str, Any], plan: dict[str, Format], data: Any,
         steps: _Steps) -> None:
    from mlx_lm.quant import awq

    from engine.quant.quantize import apply_plan

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
                         embed_group_size=block.group_size, embed_bits=block.bits)
    # AWQ does not change embeddings or the head (its scales go into norms and blocks); it
    # rounds them with MLX's grid. Strata rounds them as the recipe says, with its own grid.
    _swap(model, outside)
    apply_plan(model, {p: plan[p] for p in outside}, cancel=steps.cancel)
    steps.advance()


def _dwq(model: Any, plan: dict[str, Format], data: Any, steps: _Steps) -> None:
    import copy

    import mlx.core as mx
    import mlx.optimizers as optimizers
    from mlx.utils import tree_map
    from mlx_lm.quant import dwq

    from engine.quant.quantize import apply_plan

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


def _child_main(argv: list[str]) -> int:
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
    from engine.library.store import Library
    from engine.quant.quantize import quantize

    try:
        manifest = quantize(
            Library(Path(job["home"])), job["source"], job["recipe"], job["name"],
            target_bpw=job.get("target_bpw"),
            calibration=Path(job["calibration"]) if job.get("calibration") else None,
            calibration_tokens=job["calibration_tokens"], method=job["method"],
            replace=job.get("replace", False), in_child=True,
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
    sys.exit(_child_main(sys.argv[1:]))

"""Sensitivity-guided bit allocation: measure what quantizing each tensor costs, then spend bits.

Contract: `measure(model, tokenizer, text)` runs the float model over calibration text
(tinyshakespeare; never the evaluation text) and returns, for every quantizable tensor and
every candidate format, the expected loss increase of rounding that tensor to that format,
estimated with the diagonal Fisher information: sum(F * (W - Q(W))**2), where F is the mean
squared gradient of the next-token loss over calibration chunks. `allocate(errors, shapes,
target_bpw)` picks one format per tensor minimising the summed estimate under a bits-per-weight
budget (a Lagrangian sweep, then greedy upgrades with the bits left). Progress is reported per
chunk, then per tensor weighed; the cancel flag is checked between them.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import Cancelled, StrataError
from engine.quant.importance import Importance
from engine.quant.recipes import (
    SUPPORTED_BITS,
    SUPPORTED_GROUPS,
    Format,
    RecipeError,
    effective_group,
    quantizable,
)
from engine.quant.rounding import mlx_grid, quantize_dequantize, weighted_search
from engine.telemetry import CancelFlag, Progress

MIN_BPW, MAX_BPW = 2.5, 9.0
CANDIDATE_BITS = SUPPORTED_BITS
CANDIDATE_GROUPS = SUPPORTED_GROUPS
Errors = dict[str, dict[Format, float]]


def check_target(target_bpw: float) -> None:
    if not MIN_BPW <= target_bpw <= MAX_BPW:
        raise RecipeError(f"target {target_bpw:g} bits per weight is out of reach "
                          f"(between {MIN_BPW:g} and {MAX_BPW:g})")


def calibration_tokens(tokenizer: Any, text_path: Path, n_tokens: int) -> list[int]:
    try:
        text = text_path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise StrataError(f"{text_path}: cannot read calibration text "
                          f"({exc.__class__.__name__})") from exc
    # Encode only the text needed (about 4 characters a token), not a whole corpus.
    ids: list[int] = tokenizer.encode(text[: n_tokens * 8], add_bos=False)
    if len(ids) < 64:
        raise StrataError(f"{text_path}: calibration text too short ({len(ids)} tokens)")
    return ids[:n_tokens]


def fisher_diagonal(model: Any, tokens: list[int], chunk: int = 128,
                    progress: Progress | None = None, cancel: CancelFlag | None = None
                    ) -> dict[str, Any]:
    """Module path -> mean squared gradient of the loss w.r.t. its weight, per chunk."""
    import mlx.core as mx  # heavy: MLX loads only when weights are touched
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    paths = set(quantizable(model))
    chunks = [tokens[i: i + chunk + 1] for i in range(0, len(tokens) - 1, chunk)]
    chunks = [c for c in chunks if len(c) > 8]

    def loss_fn(x: Any, y: Any) -> Any:
        logits = model(x).astype(mx.float32)
        return nn.losses.cross_entropy(logits, y).mean()

    grad_fn = nn.value_and_grad(model, loss_fn)
    acc: dict[str, Any] = {}
    for i, c in enumerate(chunks):
        if cancel is not None and cancel():
            raise Cancelled("sensitivity measurement")
        arr = mx.array(c)[None]
        _, grads = grad_fn(arr[:, :-1], arr[:, 1:])
        flat: Any = tree_flatten(grads)
        for key, g in flat:
            module = key.rsplit(".", 1)[0]
            if key.endswith(".weight") and module in paths:
                sq = g.astype(mx.float32) ** 2
                acc[module] = acc[module] + sq if module in acc else sq
        mx.eval(acc)
        if progress is not None:
            progress(i + 1, len(chunks))
    return {k: v / len(chunks) for k, v in acc.items()}


def candidates(columns: int) -> list[Format]:
    out = set()
    for bits in CANDIDATE_BITS:
        for g in CANDIDATE_GROUPS:
            eg = effective_group(g, columns)
            if eg is not None:
                out.add(Format(bits, eg))
    return sorted(out, key=lambda f: (f.bits_per_weight, f.bits))


def measure(model: Any, tokenizer: Any, text_path: Path, n_tokens: int = 2048,
            chunk: int = 128, progress: Progress | None = None,
            cancel: CancelFlag | None = None, importance: Importance | None = None) -> Errors:
    """Estimated loss increase per tensor and candidate format. See the module docstring.

    With `importance`, each format's error is that of the importance-weighted rounding the
    tensors will get (engine.quant.rounding), so the allocation prices what is stored."""
    import mlx.core as mx  # heavy: MLX loads only when weights are touched

    tokens = calibration_tokens(tokenizer, text_path, n_tokens)
    fisher = fisher_diagonal(model, tokens, chunk, progress, cancel)
    modules = dict(model.named_modules())
    errors: Errors = {}
    # The weighted search is NumPy (it releases the GIL): the formats of a tensor run in
    # threads, MLX stays on this thread. A few workers: each holds a tensor's temporaries.
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        # Weighing every format of every tensor takes minutes with importance: cancel and
        # report between tensors too, not only between calibration chunks.
        for i, (path, f) in enumerate(fisher.items()):
            if cancel is not None and cancel():
                raise Cancelled("sensitivity measurement")
            if progress is not None:
                progress(i, len(fisher))
            w = modules[path].weight.astype(mx.float32)
            imp = importance.get(path) if importance is not None else None
            fmts = candidates(w.shape[-1])
            if imp is None:
                deqs = {fmt: quantize_dequantize(w, fmt.bits, fmt.group_size) for fmt in fmts}
            else:
                w_np = np.array(w)
                futs = {fmt: pool.submit(weighted_search, w_np, imp, fmt.bits, fmt.group_size,
                                         *mlx_grid(w, fmt.bits, fmt.group_size))
                        for fmt in fmts}
                deqs = {}
                for fmt, fut in futs.items():
                    q, sc, bi = fut.result()
                    deqs[fmt] = (mx.array(q) * mx.array(sc)[..., None]
                                 + mx.array(bi)[..., None]).reshape(w.shape)
            errors[path] = {fmt: float((f * (w - d) ** 2).sum().item())
                            for fmt, d in deqs.items()}
    return errors


def allocate(errors: Errors, shapes: dict[str, tuple[int, ...]], target_bpw: float,
             ) -> dict[str, Format]:
    """One format per tensor minimising the summed error with mean bits <= target_bpw."""
    check_target(target_bpw)
    sizes = {p: _size(shapes[p]) for p in errors}
    budget = target_bpw * sum(sizes.values())
    options = {p: sorted(e.items(), key=lambda kv: kv[0].bits_per_weight)
               for p, e in errors.items()}

    def pick(lam: float) -> dict[str, Format]:
        return {p: min(opts, key=lambda kv: kv[1] + lam * sizes[p] * kv[0].bits_per_weight)[0]
                for p, opts in options.items()}

    def cost(plan: dict[str, Format]) -> float:
        return sum(sizes[p] * f.bits_per_weight for p, f in plan.items())

    lo, hi = 0.0, 1.0
    while cost(pick(hi)) > budget and hi < 1e30:  # raise the price of bits until it fits
        hi *= 10
    if cost(pick(hi)) > budget:
        raise RecipeError(f"target {target_bpw:g} bits per weight cannot be met by this model")
    for _ in range(60):
        mid = (lo + hi) / 2
        if cost(pick(mid)) > budget:
            lo = mid
        else:
            hi = mid
    plan = pick(hi)
    # Spend what the sweep left: the upgrade with the best error drop per bit, while it fits.
    spent = cost(plan)
    while True:
        best = None
        for p, opts in options.items():
            cur = errors[p][plan[p]]
            for fmt, err in opts:
                extra = sizes[p] * (fmt.bits_per_weight - plan[p].bits_per_weight)
                if extra <= 0 or err >= cur or spent + extra > budget:
                    continue
                gain = (cur - err) / extra
                if best is None or gain > best[0]:
                    best = (gain, p, fmt, extra)
        if best is None:
            return plan
        _, p, fmt, extra = best
        plan[p] = fmt
        spent += extra


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

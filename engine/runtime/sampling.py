"""Sampling: turn last-position logits into the next token.

Contract: `Sampler(params)(logits, history)` returns a (1,) uint32 MLX array, lazily (the
caller evaluates it, so sampling overlaps with the next step's graph building). Temperature 0
is greedy. Filters apply in llama.cpp's order: repetition penalty, top-k, min-p, top-p.
Logits processors (mlx-lm's seam: `(tokens so far, logits) -> logits`, e.g. a grammar's mask)
run first, on the raw logits; the history they get holds every token before the one sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import StrataError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 64
    seed: int | None = None

    def validate(self) -> SamplingParams:
        checks = (
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
        )
        for ok, msg in checks:
            if not ok:
                raise StrataError(f"invalid sampling setting: {msg}")
        return self


LogitsProcessor = Callable[[list[int], Any], Any]


class Sampler:
    def __init__(self, params: SamplingParams,
                 processors: Sequence[LogitsProcessor] = ()) -> None:
        import mlx.core as mx

        self.params = params.validate()
        self.processors = list(processors)
        self._key = mx.random.key(params.seed) if params.seed is not None else None

    def __call__(self, logits: Any, history: list[int]) -> Any:
        import mlx.core as mx

        p = self.params
        logits = logits.astype(mx.float32)
        for proc in self.processors:
            logits = proc(history, logits)
        if p.repetition_penalty != 1.0 and history:
            recent = mx.array(sorted(set(history[-p.repetition_window :])))
            picked = logits[:, recent]
            picked = mx.where(picked < 0, picked * p.repetition_penalty,
                              picked / p.repetition_penalty)
            logits[:, recent] = picked
        if p.temperature == 0:
            return mx.argmax(logits, axis=-1).astype(mx.uint32)
        logits = logits / p.temperature
        neg = mx.array(-float("inf"), dtype=logits.dtype)
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = mx.sort(logits, axis=-1)[:, -p.top_k][:, None]
            logits = mx.where(logits < kth, neg, logits)
        if p.min_p > 0:
            top = mx.max(logits, axis=-1, keepdims=True)
            # p(x) < min_p * p(max)  <=>  logit(x) < logit(max) + log(min_p)
            logits = mx.where(logits < top + mx.log(mx.array(p.min_p)), neg, logits)
        if p.top_p < 1.0:
            order = mx.argsort(-logits, axis=-1)
            sorted_logits = mx.take_along_axis(logits, order, axis=-1)
            probs = mx.softmax(sorted_logits, axis=-1)
            before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above each token
            sorted_logits = mx.where(before >= p.top_p, neg, sorted_logits)
            logits = mx.zeros_like(logits)
            logits = mx.put_along_axis(logits, order, sorted_logits, axis=-1)
        if self._key is not None:
            self._key, sub = mx.random.split(self._key)
            return mx.random.categorical(logits, key=sub).astype(mx.uint32)
        return mx.random.categorical(logits).astype(mx.uint32)

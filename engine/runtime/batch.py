"""Continuous batching: many requests decode in one forward pass a step, over mlx-lm's parts.

Contract: `Batch(lm)` holds the rows decoding together on one loaded model, in mlx-lm's
`GenerationBatch` with its `BatchKVCache` (mlx-lm's in-memory KV, left-padded; the paged KV
cache is batch-size 1, so a model in a paged mode does not batch: `accepts`). `join(row)`
prefills one request alone through `generate` (the prompt cache it is given and the SSD prefix
cache serve it as they serve any request), samples its first token from the prompt's last
logits with the row's own sampler (what a sequential run samples), emits it, and adds the row
to the decode batch at the next step boundary. `step()` runs one forward pass for every row,
emits each row's `GenerationEvent` through its `emit`, and drops the rows that finished (EOS,
a stop string, max_tokens) or whose `cancel()` is true, checked before the step: a client that
hangs up frees its slot at the next step. Each row keeps its own sampling params (seeded rows
their own random key), stop strings and max_tokens; the events are those `generate` yields
(text deltas that never split a UTF-8 character, the same finish reasons and figures). Rows
with logits processors or a repetition penalty are not batched (they need each step's token
before the next is queued). Engine thread only, like all MLX work. No HTTP here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.runtime.generate import LoadedModel, PromptCache, _stop_split, generate
from engine.runtime.model import ensure_mlx_lm
from engine.runtime.sampling import Sampler, SamplingParams
from engine.runtime.tokenizer import StreamingDetokenizer
from engine.telemetry import GenerationEvent

MAX_ROWS = 8  # rows decoding together; past this a request waits for a slot
_PREFILL = SamplingParams(temperature=0.0)  # the prefill's own token is not used: cheapest


def mergeable(lm: LoadedModel) -> bool:
    """Whether `lm`'s prompt caches can join a batch: mlx-lm's KV cache (not a paged mode),
    every layer's cache one mlx-lm can merge."""
    if lm.paged:
        return False
    cache = lm.new_cache()
    try:
        return all(hasattr(c, "merge") for c in cache.cache)
    finally:
        cache.close()


@dataclass(eq=False)
class Row:
    """One request for a `Batch`: prompt ids, sampling, limits, where its events go."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    emit: Callable[[GenerationEvent], None]
    stop: tuple[str, ...] = ()
    cancel: Callable[[], bool] = lambda: False
    prompt_cache: PromptCache | None = None  # None: a fresh one, dropped after the prefill


def _greedy(logprobs: Any) -> Any:
    # One function object for every greedy row: mlx-lm then samples the batch in one call.
    return mx.argmax(logprobs, axis=-1).astype(mx.uint32)


class _Capture:
    """A logits processor that keeps the logits the first token is sampled from."""

    def __init__(self) -> None:
        self.logits: Any = None

    def __call__(self, history: list[int], logits: Any) -> Any:
        self.logits = logits
        return logits


@dataclass(eq=False)
class _Live:
    row: Row
    uid: int
    detok: StreamingDetokenizer
    start: float
    stats: dict[str, int]
    prefill_s: float
    t_first: float = 0.0
    n: int = 0
    pending: str = ""
    done: bool = False
    history: list[int] = field(default_factory=list)


class Batch:
    """The rows decoding together on `lm` (see the module docstring)."""

    def __init__(self, lm: LoadedModel, max_rows: int = MAX_ROWS) -> None:
        ensure_mlx_lm()
        self.lm = lm
        self.max_rows = max(1, max_rows)
        self._gen: Any = None  # mlx-lm's GenerationBatch; None while no row decodes
        self._rows: dict[int, _Live] = {}
        self._uid = 0
        self.steps = 0  # decode steps run (each one forward pass for every row)
        self.rows_stepped = 0  # tokens those steps made, all rows together
        self.peak_rows = 0  # the most rows one step has run
        self._mergeable: bool | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def accepts(self, params: SamplingParams, processors: Sequence[Any] = ()) -> bool:
        """Whether a request with these settings can decode in this batch: the model's caches
        merge, no logits processors, no repetition penalty."""
        if self._mergeable is None:
            self._mergeable = mergeable(self.lm)
        return self._mergeable and not processors and params.repetition_penalty == 1.0

    @property
    def full(self) -> bool:
        return len(self._rows) >= self.max_rows

    # -- joining ----------------------------------------------------------------------------
    def join(self, row: Row) -> bool:
        """Prefill `row` and emit its first token; True if it decodes on in the batch, False
        if it finished already (cancelled during prefill, EOS, a stop string, max_tokens 1)."""
        lm = self.lm
        start = time.perf_counter()
        capture = _Capture()
        pc = row.prompt_cache if row.prompt_cache is not None else lm.new_cache()
        last = None
        try:
            for ev in generate(lm, row.prompt, _PREFILL, 1, cancel=row.cancel, prompt_cache=pc,
                               logits_processors=[capture]):
                last = ev
            assert last is not None
            live = _Live(row, self._uid, StreamingDetokenizer(lm.tokenizer), start,
                         dict(prompt_tokens=last.prompt_tokens,
                              cached_tokens=last.cached_tokens), 0.0,
                         history=list(row.prompt))
            self._uid += 1
            if last.finish_reason == "cancelled" or capture.logits is None:
                live.t_first = time.perf_counter()
                row.emit(self._event(live, "", None, "cancelled"))
                return False
            sampler = Sampler(row.params)
            y = sampler(capture.logits, live.history)
            tok = int(y.item())
            live.prefill_s = time.perf_counter() - start
            if not self._take(live, tok):
                return False
            self._add(live, tok, pc, sampler)
        finally:
            if row.prompt_cache is None:
                pc.close()
        return True

    def _add(self, live: _Live, tok: int, pc: PromptCache, sampler: Sampler) -> None:
        # mlx-lm's flow: a batch of one (its first step runs here, alone), then extended into
        # the running batch; its KV is copied out of the prompt cache, which stays the
        # prompt's for the next request that shares it.
        from mlx_lm.generate import GenerationBatch, StopSequences  # mlx-lm: load on use

        params = live.row.params
        sample = _greedy if params.temperature == 0 else (
            lambda logprobs: sampler(logprobs, []))
        layers: list[Any] = list(pc.cache)  # mlx-lm's caches here (batchable checked)
        caches = [c.merge([c]) for c in layers]
        joined = GenerationBatch(
            self.lm.model, [live.uid], mx.array([tok], dtype=mx.uint32), caches,
            [list(pc.tokens)], [sample], _greedy, [[]],
            [StopSequences([(t,) for t in self.lm.eos_ids])],
            [max(1, live.row.max_tokens - 1)])
        if self._gen is None:
            self._gen = joined
        else:
            self._gen.extend(joined)
        self._rows[live.uid] = live

    # -- decoding ---------------------------------------------------------------------------
    def step(self) -> None:
        """One decode step for every row; rows cancelled before it leave first."""
        gone = [uid for uid, live in self._rows.items() if live.row.cancel()]
        for uid in gone:
            live = self._rows[uid]
            tail, _, _ = _stop_split(live.pending + live.detok.flush(), live.row.stop)
            live.row.emit(self._event(live, tail, None, "cancelled"))
            live.done = True
        self._drop()
        if self._gen is None:
            return
        self.peak_rows = max(self.peak_rows, len(self._gen.uids))
        responses = self._gen.next()
        self.steps += 1
        self.rows_stepped += len(responses)
        for r in responses:
            got = self._rows.get(r.uid)
            if got is not None and not got.done:
                got.done = not self._take(got, int(r.token))
        self._drop()

    def cancel_all(self) -> None:
        """Finish every row as cancelled (the server stopping)."""
        for live in self._rows.values():
            live.row.emit(self._event(live, "", None, "cancelled"))
            live.done = True
        self._drop()

    def drop_all(self) -> None:
        """Forget every row without a word (their requests were told otherwise)."""
        self._rows.clear()
        self._gen = None

    def _drop(self) -> None:
        """Remove finished rows from mlx-lm's batch (which drops its own finished ones)."""
        done = {uid for uid, live in self._rows.items() if live.done}
        if not done:
            return
        for uid in done:
            del self._rows[uid]
        if self._gen is not None:
            keep = [i for i, uid in enumerate(self._gen.uids) if uid not in done]
            if len(keep) < len(self._gen.uids):
                self._gen.filter(keep)
        if not self._rows:
            self._gen = None

    def _take(self, live: _Live, tok: int) -> bool:
        """Emit `tok`'s event(s) as `generate` does; False when the row finished."""
        live.n += 1
        if live.n == 1:
            live.t_first = time.perf_counter()
        row = live.row
        if tok in self.lm.eos_ids:
            tail, _, _ = _stop_split(live.pending + live.detok.flush(), row.stop)
            row.emit(self._event(live, tail, None, "stop"))
            return False
        live.history.append(tok)
        text, live.pending, stopped = _stop_split(live.pending + live.detok.add(tok), row.stop)
        if stopped:
            row.emit(self._event(live, text, tok, "stop"))
            return False
        row.emit(self._event(live, text, tok, None))
        if live.n >= row.max_tokens:
            tail, _, _ = _stop_split(live.pending + live.detok.flush(), row.stop)
            row.emit(self._event(live, tail, None, "length"))
            return False
        return True

    def _event(self, live: _Live, text: str, token: int | None,
               reason: str | None) -> GenerationEvent:
        now = time.perf_counter()
        n, t_first = live.n, live.t_first
        new = live.stats["prompt_tokens"] - live.stats["cached_tokens"]
        return GenerationEvent(
            text=text, token=token, generated_tokens=n, ttft_s=t_first - live.start,
            prefill_tps=new / live.prefill_s if live.prefill_s > 0 else 0.0,
            decode_tps=(n - 1) / (now - t_first) if n > 1 and now > t_first else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()), finish_reason=reason, **live.stats)

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
their own random key), stop strings, max_tokens, logits processors (a grammar's mask, a
logprobs recorder: called as `generate` calls them, with every token so far) and repetition
penalty (applied to its raw logits, as `generate`'s sampler does); the events are those
`generate` yields (text deltas that never split a UTF-8 character, the same finish reasons and
figures). A processor that raises fails its row alone (`Row.fail`, after the token already
sampled is out); the other rows decode on. While rows decode, OpenBLAS runs one thread
(DECODE_BLAS_THREADS); a prefill gets the process's own count unless two rows decode. Engine
thread only, like all MLX work. No HTTP here.
A row drafts (`Row.drafter`, engine.runtime.speculative): alone in the batch, a step verifies
its drafts in one pass over mlx-lm's batch cache and trims the rejected ones, as `generate`
does. Rows decoding together draft each on its own (`_rows_step`): every row's next token and
its drafts (up to its own k; a row that drafts nothing, only its token) in one forward pass of
width W = 1 + the most drafts, each row's positions sampled with its own sampler and kept up
to its first disagreement. mlx-lm's batch cache writes every row at one index, so the batch
keeps m = the most positions any row kept (the rest trimmed as one count), and a row that kept
fewer leaves m - kept slots behind its tokens: holes (`_holed_cache`), masked out of every
later step's attention and not counted in the row's RoPE offset, so each row attends to
exactly its own tokens at their own positions. Holes cost slots, never tokens; a verify pass
runs only when the rows' expected tokens pay for its width (`_pays`), and never while a row
has logits processors or a repetition penalty (they need each token before the next).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from engine.platform import blas_threads, set_blas_threads
from engine.runtime.generate import LoadedModel, PromptCache, _stop_split, generate
from engine.runtime.model import ensure_mlx_lm
from engine.runtime.sampling import LogitsProcessor, Sampler, SamplingParams
from engine.runtime.speculative import (
    MARGIN,
    Drafter,
    Speculator,
    costs_of,
    expected_tokens,
    for_reply,
)
from engine.runtime.tokenizer import StreamingDetokenizer
from engine.telemetry import GenerationEvent

MAX_ROWS = 8  # rows decoding together; past this a request waits for a slot
_PREFILL = SamplingParams(temperature=0.0)  # the prefill's own token is not used: cheapest
# OpenBLAS threads while rows decode (0: leave OpenBLAS as it is). A matmul of a few rows split
# over OpenBLAS's workers waits for them to be scheduled: on a busy 2-core machine 2-2.5x per
# matmul, and a lone row's decode gained too (docs/benchmarks.md, concurrent requests).
DECODE_BLAS_THREADS = int(os.environ.get("STRATA_BATCH_BLAS_THREADS", "1"))
_PROCESS_BLAS: list[int | None] = []  # the process's own count, before any batch changed it


_HOLED: list[Any] = []  # the holed batch cache class, made on first use (mlx-lm loads late)


def _holed_cache() -> Any:
    """mlx-lm's BatchKVCache with holes: per row, slots that hold no token of the row (a
    rejected draft's, left while another row kept more), masked out of attention. `hole` is a
    numpy (rows, n) bool array, n <= the write index (None: no holes); `dig(g)` makes the
    last g[i] slots of row i holes and takes them off its RoPE offset; trim, filter, extend
    and extract keep the holes where the slots go."""
    if _HOLED:
        return _HOLED[0]
    from mlx_lm.models.cache import BatchKVCache  # mlx-lm: load on use

    class HoledBatchKVCache(BatchKVCache):  # type: ignore[misc]
        hole: Any = None

        def dig(self, gaps: list[int]) -> None:
            if not any(gaps):
                return
            idx = self._idx
            h = np.zeros((len(gaps), idx), bool)
            if self.hole is not None:
                h[:, :self.hole.shape[1]] = self.hole[:, :idx]
            for i, g in enumerate(gaps):
                if g:
                    h[i, idx - g:idx] = True
            self.hole = h
            self.offset = self.offset - mx.array(gaps)

        def make_mask(self, N: int, return_array: bool = False, **kw: Any) -> Any:
            mask = super().make_mask(N, return_array=return_array, **kw)
            h = self.hole
            if h is None:
                return mask
            ok = np.ones((h.shape[0], self._idx + N), bool)
            n = min(h.shape[1], self._idx)
            ok[:, :n] = ~h[:, :n]
            return mask & mx.array(ok)[:, None, None, :]

        def trim(self, n: int) -> int:
            n = super().trim(n)
            if self.hole is not None:
                self.hole = self.hole[:, :self._idx]
            return n

        def filter(self, batch_indices: Any) -> None:
            before = self._idx
            super().filter(batch_indices)
            if self.hole is not None:
                h = self.hole[list(batch_indices)][:, before - self._idx:]
                self.hole = h if h.any() else None

        def extend(self, other: Any) -> None:
            a, b = self._idx, other._idx
            ha, hb = self.hole, getattr(other, "hole", None)
            rows_a, rows_b = int(self.offset.shape[0]), int(other.offset.shape[0])
            super().extend(other)
            if ha is None and hb is None:
                return
            h = np.zeros((rows_a + rows_b, self._idx), bool)
            # Both were right-justified at the new index (mlx-lm's extend).
            if ha is not None:
                h[:rows_a, self._idx - a:self._idx - a + ha.shape[1]] = ha[:, :a]
            if hb is not None:
                h[rows_a:, self._idx - b:self._idx - b + hb.shape[1]] = hb[:, :b]
            self.hole = h

        def extract(self, idx: int) -> Any:
            out = super().extract(idx)
            if self.hole is not None and self.hole[idx].any():
                pads: Any = self.left_padding.tolist()
                pad = int(pads[idx])
                h = np.zeros(self._idx, bool)
                h[:min(self.hole.shape[1], self._idx)] = self.hole[idx, :self._idx]
                keep = mx.array(np.flatnonzero(~h[pad:]))
                out.keys, out.values = out.keys[:, :, keep], out.values[:, :, keep]
                out.offset = int(out.keys.shape[2])
            return out

    _HOLED.append(HoledBatchKVCache)
    return HoledBatchKVCache


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
    processors: Sequence[LogitsProcessor] = ()  # `generate`'s logits processors, in order
    # A processor raised mid-reply (after the row's last token was emitted); None: the row
    # ends with an event whose finish_reason is "error".
    fail: Callable[[Exception], None] | None = None
    # Speculative decoding while the row decodes alone ("auto", "lookup", a Drafter; "off").
    drafter: str | Drafter = "off"


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
    error: Exception | None = None  # a processor raised in the last step
    sampler: Sampler | None = None  # the row's own, for a verify pass's positions
    spec: Speculator | None = None  # made the first time the row decodes alone
    spec_tried: bool = False


@dataclass
class _RowCache:
    """The lone row of mlx-lm's batch as a speculator's cache view (rebuilt every step: a
    join or a filter replaces the batch's cache list)."""

    cache: Any
    tokens: list[int]


class _RowLogits:
    """A row's logits processors and repetition penalty as one mlx-lm batch processor.

    mlx-lm passes the row's tokens so far (prompt and reply, the one being fed included) as
    an MLX array; ours take a list, as in `generate`. Whatever raises is kept for the batch
    to fail this row alone after the step (the logits pass unchanged meanwhile).
    """

    def __init__(self, live: _Live, params: SamplingParams) -> None:
        self.live = live
        self.procs = list(live.row.processors)
        self.params = params

    def __call__(self, context: Any, logits: Any) -> Any:
        if self.live.error is not None:
            return logits
        try:
            history = [int(t) for t in context.tolist()]
            out = logits.astype(mx.float32)  # what generate's Sampler does first
            for proc in self.procs:
                out = proc(history, out)
            return _penalize(out, history, self.params)
        except Exception as exc:  # noqa: BLE001  (this row fails, not the batch)
            self.live.error = exc
            return logits


def _penalize(logits: Any, history: list[int], p: SamplingParams) -> Any:
    """engine.runtime.sampling.Sampler's repetition penalty, the same arithmetic."""
    if p.repetition_penalty == 1.0 or not history:
        return logits
    recent = mx.array(sorted(set(history[-p.repetition_window :])))
    picked = logits[:, recent]
    picked = mx.where(picked < 0, picked * p.repetition_penalty,
                      picked / p.repetition_penalty)
    logits[:, recent] = picked
    return logits


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
        if not _PROCESS_BLAS:  # read once: a batch may have lowered it since
            _PROCESS_BLAS.append(blas_threads())
        self._blas_default = _PROCESS_BLAS[0]  # None: not OpenBLAS (macOS, no shim)
        self._blas_now = self._blas_default

    def __len__(self) -> int:
        return len(self._rows)

    def accepts(self) -> bool:
        """Whether requests can decode in this batch: the model's caches merge (any sampling,
        processors and penalty batch)."""
        if self._mergeable is None:
            self._mergeable = mergeable(self.lm)
        return self._mergeable

    @property
    def full(self) -> bool:
        return len(self._rows) >= self.max_rows

    def _blas(self, threads: int | None) -> None:
        """Set OpenBLAS's thread count (None: the process's own) between steps."""
        if self._blas_default is None or DECODE_BLAS_THREADS < 1:
            return
        want = self._blas_default if threads is None else threads
        if want != self._blas_now:
            mx.synchronize()  # the step in flight finishes with the count it started with
            set_blas_threads(want)
            self._blas_now = want

    # -- joining ----------------------------------------------------------------------------
    def join(self, row: Row) -> bool:
        """Prefill `row` and emit its first token; True if it decodes on in the batch, False
        if it finished already (cancelled during prefill, EOS, a stop string, max_tokens 1)."""
        lm = self.lm
        # A prefill's matmuls are many rows: the process's own count, unless two rows or more
        # decode meanwhile (then the cores are busy with us: one thread gave more).
        self._blas(DECODE_BLAS_THREADS if len(self._rows) >= 2 else None)
        start = time.perf_counter()
        capture = _Capture()
        pc = row.prompt_cache if row.prompt_cache is not None else lm.new_cache()
        last = None
        try:
            # The row's processors see the prompt and mask the first token, as in generate.
            for ev in generate(lm, row.prompt, _PREFILL, 1, cancel=row.cancel, prompt_cache=pc,
                               logits_processors=[*row.processors, capture]):
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
        # The sampler sees log-softmaxed logits: temperature, top-k/p and min-p do not move
        # under that shift, the repetition penalty does (it runs in _RowLogits, on logits).
        sample = _greedy if params.temperature == 0 else (
            lambda logprobs: sampler(logprobs, []))
        procs: list[Any] = ([_RowLogits(live, params)]
                 if live.row.processors or params.repetition_penalty != 1.0 else [])
        layers: list[Any] = list(pc.cache)  # mlx-lm's caches here (batchable checked)
        from mlx_lm.models.cache import KVCache  # mlx-lm: load on use

        # Plain KV layers merge into the holed batch cache (rows draft together over it).
        holed = _holed_cache()
        caches = [holed.merge([c]) if type(c) is KVCache else c.merge([c]) for c in layers]
        live.sampler = sampler
        self._rows[live.uid] = live  # before the first step: a processor may fail it
        try:
            joined = GenerationBatch(
                self.lm.model, [live.uid], mx.array([tok], dtype=mx.uint32), caches,
                [list(pc.tokens)], [sample], _greedy, [procs],
                [StopSequences([(t,) for t in self.lm.eos_ids])],
                [max(1, live.row.max_tokens - 1)])
        except BaseException:
            del self._rows[live.uid]
            raise
        if self._gen is None:
            self._gen = joined
        else:
            self._gen.extend(joined)

    # -- decoding ---------------------------------------------------------------------------
    def step(self) -> None:
        """One decode step for every row; rows cancelled before it leave first."""
        gone = [uid for uid, live in self._rows.items() if live.row.cancel()]
        for uid in gone:
            live = self._rows[uid]
            tail, _, _ = _stop_split(live.pending + live.detok.flush(), live.row.stop)
            live.row.emit(self._event(live, tail, None, "cancelled"))
            live.done = True
        for live in self._rows.values():
            if live.error is not None and not live.done:  # raised in the joining step
                self._failed(live)
        self._drop()
        if self._gen is None:
            return
        self.peak_rows = max(self.peak_rows, len(self._gen.uids))
        self._blas(DECODE_BLAS_THREADS)
        if (self._alone_step() if len(self._gen.uids) == 1 else self._rows_step()):
            self.steps += 1
            self._drop()
            return
        responses = self._gen.next()
        self.steps += 1
        self.rows_stepped += len(responses)
        for r in responses:
            got = self._rows.get(r.uid)
            if got is not None and not got.done:
                got.done = not self._take(got, int(r.token))
        for live in self._rows.values():
            if live.error is not None and not live.done:
                self._failed(live)
        self._drop()

    def _alone_step(self) -> bool:
        """The lone row's step with drafts, as `generate` runs one: its next token (mlx-lm's,
        sampled but not yet fed) and the drafts after it in one pass, the rejected ones trimmed
        from the batch cache. False when the row does not draft or a plain step is the faster
        one now (then mlx-lm's pipelined step runs)."""
        gen = self._gen
        live = self._rows.get(gen.uids[0])
        if live is None or live.done or live.sampler is None:
            return False
        if not live.spec_tried:
            live.spec_tried = True
            row = live.row
            live.spec = for_reply(
                self.lm, row.drafter, row.params, row.processors, live.sampler,
                _RowCache(gen.prompt_cache, gen.tokens[0]),
                lambda x: self.lm.model(x, cache=self._gen.prompt_cache), live.stats)
        spec = live.spec
        if spec is None or spec.rest(live.history):
            return False
        # mlx-lm's batch state, read and kept as its own step keeps it (mlx-lm 0.32): the
        # next token waits in _next_tokens; tokens, _num_tokens and _matchers count what the
        # cache holds.
        tok = int(gen._next_tokens.item())
        if not self._fed(live, tok):
            return True
        spec.pc = _RowCache(gen.prompt_cache, gen.tokens[0])
        ahead, y = spec.step(tok, live.history, live.row.max_tokens - live.n)
        gen._next_tokens = y.astype(mx.uint32)
        for t in ahead:
            if live.row.cancel() or not self._fed(live, t):
                break  # a Stop between two accepted tokens: the next step drops the row
        return True

    def _row_spec(self, live: _Live, i: int) -> Speculator | None:
        """Row i's speculator (made the first time it decodes; None: it does not draft),
        reading the batch's cache and the row's tokens in it."""
        gen = self._gen
        if not live.spec_tried:
            live.spec_tried = True
            row = live.row
            assert live.sampler is not None
            live.spec = for_reply(
                self.lm, row.drafter, row.params, row.processors, live.sampler,
                _RowCache(gen.prompt_cache, gen.tokens[i]),
                lambda x: self.lm.model(x, cache=self._gen.prompt_cache), live.stats)
        if live.spec is not None:
            live.spec.pc = _RowCache(gen.prompt_cache, gen.tokens[i])
        return live.spec

    def _rows_step(self) -> bool:
        """Rows decoding together, each drafting on its own (the module docstring): their
        next tokens (mlx-lm's, sampled but not yet fed) and drafts in one pass, each row's
        own acceptance, one trim for the batch and holes for the rows that kept fewer. False
        when no row would draft, a row cannot (processors, a penalty) or the batch cache has
        no holes (then mlx-lm's pipelined step runs)."""
        gen = self._gen
        lives = [self._rows.get(uid) for uid in gen.uids]
        caches = gen.prompt_cache
        if not all(hasattr(c, "dig") for c in caches):
            return False
        rows: list[_Live] = []
        for live in lives:
            if (live is None or live.done or live.sampler is None or live.row.processors
                    or live.row.params.repetition_penalty != 1.0):
                return False
            rows.append(live)
        specs = [self._row_spec(live, i) for i, live in enumerate(rows)]
        # Called once per step before the step's token is known, as `generate` does.
        want = [s is not None and not s.rest(live.history)
                for s, live in zip(specs, rows, strict=True)]
        # A draft model is one object for every row that names it (DraftModels), with one
        # prompt cache: only the first of those rows drafts in a step, or each proposal would
        # trim that cache to another row's history and prefill it again.
        seen: set[int] = set()
        for i, s in enumerate(specs):
            if want[i] and s is not None:
                want[i] = id(s.drafter) not in seen
                seen.add(id(s.drafter))
        if not any(want):
            return False
        toks = [int(t) for t in gen._next_tokens.tolist()]
        drafts: list[list[int]] = []
        kinds: list[str] = []
        for i, (live, spec) in enumerate(zip(rows, specs, strict=True)):
            fed = self._fed_at(i, live, toks[i])
            d: list[int] = []
            kind = ""
            if fed and want[i] and spec is not None:
                d, kind = spec.draft(live.history, live.row.max_tokens - live.n,
                                     at_depth=False)
            drafts.append(d)
            kinds.append(kind)
        if not self._pays(rows, specs, drafts, kinds):
            drafts = [[] for _ in rows]
        width = 1 + max(len(d) for d in drafts)
        x = mx.array([[t, *d, *[t] * (width - 1 - len(d))]
                      for t, d in zip(toks, drafts, strict=True)])
        logits = self.lm.model(x, cache=caches)  # (rows, width, vocab)
        greedy = [live.row.params.temperature == 0 for live in rows]
        outs: list[Any] = [None] * len(rows)
        if any(greedy):
            top = mx.argmax(logits, axis=-1)
        for i, live in enumerate(rows):
            assert live.sampler is not None
            outs[i] = top[i] if greedy[i] else live.sampler(logits[i], live.history)
        got_rows: Any = mx.stack(outs).tolist()
        got = [[int(t) for t in row] for row in got_rows]
        kept = []
        for d, out in zip(drafts, got, strict=True):
            a = 0
            while a < len(d) and out[a] == d[a]:
                a += 1
            kept.append(a)
        most = 1 + max(kept)
        for c in caches:
            c.trim(width - most)
            c.dig([most - 1 - a for a in kept])
        gen._next_tokens = mx.array([out[a] for out, a in zip(got, kept, strict=True)],
                                    dtype=mx.uint32)
        for i, (live, spec, d, a) in enumerate(zip(rows, specs, drafts, kept, strict=True)):
            gen.tokens[i].extend([toks[i], *d[:a]])
            if d and spec is not None:
                spec.settle(kinds[i], len(d), a)
            for t in d[:a]:
                if live.done or live.row.cancel() or not self._fed_at(i, live, t):
                    break  # the next step drops the row
        return True

    def _pays(self, rows: list[_Live], specs: list[Speculator | None],
              drafts: list[list[int]], kinds: list[str]) -> bool:
        """Whether a pass of every row's token and drafts is expected to make more tokens a
        second than a plain step of the batch: the tokens each row expects from its drafts
        (its acceptance for that kind), against the pass's price in plain batch steps (the
        model's measured step costs, a pass of rows x width tokens against one of rows). A
        forced drafter ("lookup", a draft model) always verifies."""
        width = 1 + max(len(d) for d in drafts)
        if width == 1:
            return False
        if any(s is not None and s.forced and d for s, d in zip(specs, drafts, strict=True)):
            return True
        expect = sum(expected_tokens(s.alpha(k), len(d)) if s is not None and d else 1.0
                     for s, d, k in zip(specs, drafts, kinds, strict=True))
        costs = costs_of(self.lm)
        n = len(rows)
        price = costs.ratio(n * width) / costs.ratio(n)
        return expect / n > MARGIN * price

    def _fed_at(self, i: int, live: _Live, tok: int) -> bool:
        """Count `tok` for row i in mlx-lm's batch and emit it; False when the row finished."""
        self._gen._num_tokens[i] += 1
        self._gen._matchers[i].advance(tok)
        self.rows_stepped += 1
        live.done = not self._take(live, tok)
        return not live.done

    def _fed(self, live: _Live, tok: int) -> bool:
        """Count `tok` in mlx-lm's batch and emit it; False when the row finished."""
        self._gen._num_tokens[0] += 1
        self._gen._matchers[0].advance(tok)
        self.rows_stepped += 1
        live.done = not self._take(live, tok)
        return not live.done

    def _failed(self, live: _Live) -> None:
        """End a row whose processor raised: its `fail`, else an event ending with 'error'."""
        live.done = True
        assert live.error is not None
        if live.row.fail is not None:
            live.row.fail(live.error)
        else:
            live.row.emit(self._event(live, "", None, "error"))

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
        self._blas(None)

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
            self._blas(None)  # what runs alone next gets the process's own count

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

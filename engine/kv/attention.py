"""Attention over KV pages: exact (online softmax over page groups) and sparse (Quest-style).

Contract: `attend(cache, q, k, v, scale, sinks)` returns what
mx.fast.scaled_dot_product_attention would over every token the cache holds plus the current
chunk (causal within the chunk), for (1, q_heads, L, D) queries, learned attention sinks
included (gpt-oss: one logit per query head in the softmax's denominator, no value); in
sparse mode a decode step (L <= SPARSE_MAX_L; past SPARSE_PREFILL_PAST tokens, a chunk of up
to SPARSE_CHUNK_L) reads only the sink pages,
the recent window and the blocks of BLOCK_TOKENS (engine.kv.table) whose bound on the
attention weight any query head of the group could give them is highest (with every page in
RAM or on the SSD, the bound's best RESCORE x the budget re-ranked by their true
logits; VOTE_SHARE of the budget's blocks fixed for the reply by the question's votes, the
exact weights of the prompt's last chunk), within the token budget (a prefill chunk past the
trained length, which attends sparsely with positions remapped, within the trained length
instead, over at most PREFILL_REACH_PAST past tokens: PREFILL_REACH, reading the most recent
of them: PREFILL_RECENT; a decode step there scores far candidates as moved to where the
layout reads them: FAR_ROTATE, `far_of`; with RESELECT_STEPS > 1 the bound's shortlist
serves that many consecutive decode steps; within the trained length, over at most
DENSE_TOP_PAST tokens, the top DENSE_TOP share of the layers attends exactly); `attend`
keeps every layer's block summaries as pages are committed, in every mode, and in sparse
mode the votes of each prefill chunk within the trained length.
`question_steps(store, end)`: how many of a prompt's last tokens its prefill sends as the
question, in chunks of QUESTION_L (past the trained length, sparse: the question must choose
its blocks; one chunk by default, choosing once for all its queries with the far scoring).
`ask(forward, cache, tokens)` sends that chunk: past the trained length in sparse mode twice,
a wide pass whose attention weights fix the blocks the second pass and the reply hold within
a narrow budget (engine.kv.question).
`install_hook(model)` routes the model module's scaled_dot_product_attention here for paged
layers; every other cache (a sliding-window layer's WindowLayerCache, mlx-lm's caches) goes
to mlx-lm's function with the mask the model built.
Quantized pages (KV bits 8 or 4) are decoded group by group as they are read, then attended
with the same float matmuls (on CPU that beats mx.quantized_matmul, docs/benchmarks.md).
On MLX's CPU backend a sparse decode step selects (and, over pages all in RAM, attends) in
numpy instead (engine.kv.cpu_select: the same blocks, one synchronisation a layer), and a
prompt chunk over keys in RAM that MLX's fused attention would take attends in numpy
(`_chunk_np`: MLX's CPU exp made that most of a long prompt's prefill).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv import cpu_kernels, cpu_native, cpu_select, question, remap
from engine.kv.cache import PagedLayerCache

# A score block of page group x heads x queries x page tokens stays under this many floats.
SCORE_ELEMENTS = 1 << 23
# Prefill chunks attend exactly; sparse selection is for decoding (Quest does the same).
SPARSE_MAX_L = 4
# A prefill chunk of at least this many tokens (a long prompt's, not the question after a
# stored context) into a context the compiled loops serve (exact decode over DENSE_MIN_KEYS
# keys, sparse selection) starts loading them for the decode steps.
WARM_CHUNK = 256
# Except past a long context (a restored one): there a chunk of at most SPARSE_CHUNK_L tokens
# selects once for all its queries (the score's sum over the group's rows covers them), so a
# question after 128k stored tokens costs a couple of selections, not one per 4 tokens, each
# reading its pages from the SSD (docs/benchmarks.md, a stored context). generate.py chunks
# the prompt so past SPARSE_PREFILL_PAST tokens.
SPARSE_PREFILL_PAST = 16384
SPARSE_CHUNK_L = 64
# Prefill chunks over at most this many past tokens use MLX's fused kernel on a copy.
FUSED_PAST_MAX = 16384
# So does a decode step over at most this many (a page or two, e.g. a chat's start): the copy
# is small, and it runs a dozen fewer ops a layer than the page-wise path, as mlx-lm's cache.
FUSED_DECODE_PAST = 256
# Pages read from the SSD per group in exact mode: a group is copied about three times on
# its way in (read, stack, MLX) and evaluated before the next, so RAM stays bounded over a
# million-token pass.
STREAM_PAGES = 256
# Quantized pages are decoded at most this many key (or value) floats at a time, so that a
# long context never holds a full-precision copy of a whole layer.
DECODE_ELEMENTS = 1 << 22
# Sparse mode: the sinks and the recent window take at most this share of the budget, the
# chosen blocks the rest (at 768 tokens the defaults, 128 + 512, left one page to choose).
FIXED_SHARE = 0.5
# Pages on the SSD are read whole: when a layer's pages are not all in RAM, sparse mode
# chooses its blocks inside the pages whose best block (over the layer's heads) ranks
# highest, at most this many times the pages its block budget fills, one set for all heads,
# so a step reads about what the budget holds rather than one page per chosen block (at 128k
# that was ~300 pages a layer and a full RAM tier; per head sets read up to 3x more).
READ_PAGES_FACTOR = 3
# Sparse mode with more than twice M candidate pages scores in two levels: each page by its
# own key bound (per head), then only the blocks of its best M pages, M = max(
# TWO_LEVEL_MIN_PAGES, TWO_LEVEL_FACTOR x the pages the block budget fills), where bounding
# every block cost 49 ms a layer per decode step at 128k (load 13) and 0.5 s for a 16-token
# chunk. A page's bound is at least its best block's, so M generous keeps the top blocks.
TWO_LEVEL_MIN_PAGES = 64
TWO_LEVEL_FACTOR = 8
# Sparse mode: the blocks are chosen by their true largest logit among this many times the
# budget's blocks ranked best by the bound (keys read for those only, from either tier); 1
# chooses by the bound alone. At 4k tokens and a 768 budget, a fact exact attention found was
# missed by the bound alone and with 2, found with 4 and 8 (docs/benchmarks.md). It once ran
# only while every page was in RAM, and the same context chose other blocks once its pages
# were on the SSD; now the shortlist's keys come from either tier (`_gather_keys`).
# A page read off the RAM tier for the shortlist's keys is kept for the step's attention
# (`_step_pages`): a step reads each page at most once, so never more pages than exact mode
# (tests/engine/bench/test_kv.py). STRATA_SPARSE_RESCORE=1 turns it off.
RESCORE = max(1, int(os.environ.get("STRATA_SPARSE_RESCORE") or 4))
# Question votes (SnapKV's idea): a prefill chunk in sparse mode (at most VOTE_PAST_MAX tokens
# in) records the exact attention weight its last VOTE_QUERIES queries give each block; decode
# keeps the best-voted VOTE_SHARE of the chosen blocks for the whole reply (beside the per-step
# choice), so the blocks the question itself looked at stay. With RESCORE 4 it found at 4k
# and 8k what exact found where rescoring alone missed (docs/benchmarks.md, issue 19's
# fourth pass). STRATA_SPARSE_VOTES=0 turns them off (without rescoring they lost the fact of
# tests/engine/kv/test_needle.py's sparse test, which the bound alone finds).
# The shortlist holds at most RESCORE_CAP x the budget's tokens (0: no cap): without votes,
# or at a large budget, RESCORE x the blocks read up to 2.75x the keys the step attends
# (32k, budget 2,048: 5,632 keys a head for 2,048). At 768 with votes (24 blocks a step,
# 96 shortlisted) the cap changes nothing.
RESCORE_CAP = float(os.environ.get("STRATA_SPARSE_RESCORE_CAP") or 1.0)
# Except for the question past the trained length (a chunk choosing with the far scoring,
# once a prompt): its bound over 144 rows is loose, and at 16k the cap (512 of 1,968 blocks
# rescored) held 1.7 of the fact's 3 blocks where the full RESCORE x 432 held 2.3, what true
# logits over every candidate hold (docs/benchmarks.md, issue 19, 2026-12-07, second pass).
VOTE_SHARE = float(os.environ.get("STRATA_SPARSE_VOTES") or 0.5)
VOTE_QUERIES = 32
VOTE_PAST_MAX = SPARSE_PREFILL_PAST
# STRATA_SPARSE_FIRST_EXACT=1: the step right after the voting chunk (the prompt's last
# token, which writes the reply's first token) attends exactly, as the rest of the prompt
# did. Off: at 4k and 8k it changed no answer (docs/benchmarks.md).
FIRST_EXACT = (os.environ.get("STRATA_SPARSE_FIRST_EXACT") or "0") != "0"
# Past the trained length a prefill chunk attends sparsely (remapped), but with a budget of
# the trained length less the chunk (its sinks, chosen blocks, window and chunk then fill the
# trained window), not the decode budget: at a 768 budget the prose past the trained length
# was encoded with 768-token attention and no fact there was found, even with positions
# left true (docs/benchmarks.md, issue 19's eighth pass). STRATA_SPARSE_PREFILL_REACH=0
# prefills at the decode budget.
PREFILL_REACH = (os.environ.get("STRATA_SPARSE_PREFILL_REACH") or "1") != "0"
# Only over at most this many past tokens: further on generate.py chunks the prompt at
# SPARSE_CHUNK_L so that each chunk's selection stays cheap, and a question's 64-token chunk
# gathering the trained reach from 128k stored tokens took its first token from 4.2 s to
# 16.0 s (docs/benchmarks.md, issue 19's eighth pass); past it the decode budget holds.
# STRATA_SPARSE_PREFILL_REACH_PAST sets it.
PREFILL_REACH_PAST = int(os.environ.get("STRATA_SPARSE_PREFILL_REACH_PAST") or SPARSE_PREFILL_PAST)
# Such a chunk reads, besides the sinks, the most recent tokens its budget holds (StreamingLLM
# inside the trained reach) rather than choosing blocks: a choice ranks far blocks by logits
# at distances past the trained length, which are noise, and packs the ones it takes in
# beside the near text (docs/benchmarks.md, issue 19's tenth pass). The far text is reached
# by the decode steps' selection. STRATA_SPARSE_PREFILL_RECENT=0 chooses as a decode step.
PREFILL_RECENT = (os.environ.get("STRATA_SPARSE_PREFILL_RECENT") or "1") != "0"
# A decode step past the trained length scores each candidate the trained length does not
# reach (it starts before E = end - trained) as if it sat where the remapped layout puts the
# first chosen block, just after the moved sinks (E + S): its bound, its rescored logits and
# the question's votes for it come from the query rotated back by that shift (exact for the
# bound: RoPE is a rotation, and every key of a block moves alike). At true positions those
# logits are at distances the model never saw. STRATA_SPARSE_FAR_ROTATE=0 scores them as
# cached.
FAR_ROTATE = (os.environ.get("STRATA_SPARSE_FAR_ROTATE") or "1") != "0"
# With the InfLLM layout (remap.LAYOUT "infllm", which packs every chosen block between the
# sinks and the window) a decode step scores each candidate further than FAR_DISTANCE tokens
# from the query as if it sat FAR_DISTANCE before it, where the layout will read it, not at
# the trained length's edge: at 16k the starter's logits there (~8,100 tokens back) ranked
# the fact's blocks ~1,000th of 1,968 in the heads its answer rests on, at 300-1,800 tokens
# ~250th, and that held 1.9 of its 3 blocks among 432 chosen, against 0.2 (docs/benchmarks.md,
# issue 19, 2026-12-07). STRATA_SPARSE_FAR_DISTANCE sets it.
FAR_DISTANCE = int(os.environ.get("STRATA_SPARSE_FAR_DISTANCE") or 1024)
# Past the trained length (sparse, remapped) a prompt's last QUESTION_STEPS tokens (the
# question and the reply's opening, asked after a long context) go as decode steps
# (`question_steps`): at 16k the starter answered from a fact 8,000 tokens back when its
# question's tokens read it, and never when only the answer did.
QUESTION_STEPS = 48
# ... as one chunk that chooses its blocks once, as a decode step does (the decode budget,
# the far scoring), its queries' weights summed (QUESTION_L = QUESTION_STEPS), rather than
# as steps of SPARSE_MAX_L that each choose alone: at 16k, ranked offline from the question
# steps' own queries and keys, the sum over its 12 steps held 2.4 of the fact's 3 blocks
# among the 432 chosen in the heads the answer rests on (median rank 61), one step 1.9
# (median 248) (docs/benchmarks.md, issue 19, 2026-12-07, second pass).
# STRATA_SPARSE_QUESTION_CHUNK=0 sends it as steps.
QUESTION_CHUNK = (os.environ.get("STRATA_SPARSE_QUESTION_CHUNK") or "1") != "0"
QUESTION_L = QUESTION_STEPS if QUESTION_CHUNK else SPARSE_MAX_L
# The two-level first pass bounds far pages in runs of this many, one rotation a run (a page
# then sits up to 3 pages after E + S): at 32k 1.7 ms a layer once a page, under load.
FAR_PAGE_RUN = 4

# STRATA_SPARSE_RESELECT=N (N > 1): a decode step re-ranks the shortlist the bound gave the
# step before it (same layer and pages, the next position) for up to N steps in all, then
# bounds again; a new page (every page_tokens steps), a trim or a new prompt bounds at once.
# Bounding (page and block bounds, the far rotation) is a large part of a sparse step at
# depth: with 4, sparse decode at 32k went from 1.49x to 1.94x mlx-lm. Off by default: with
# 4 it lost the 8k fact at 81% (a wrong last digit) that bounding every step finds, and
# reusing the chosen blocks instead also lost the 4k fact at 63% (docs/benchmarks.md, the
# eleventh pass).
RESELECT_STEPS = max(1, int(os.environ.get("STRATA_SPARSE_RESELECT") or 1))
# Within the trained length and over at most DENSE_TOP_PAST past tokens, the top DENSE_TOP
# share of a sparse store's layers attends exactly: at 8k the starter's answer needs their
# broad attention. With it exact, the 8k facts at 54% and 46% were found. Giving those layers
# the 48 blocks of most exact weight (an oracle), a budget of 1,536 or 2,048, or an estimate of
# the blocks left out (their mean key and value) did not find both. Exact lower layers found
# neither (docs/benchmarks.md, the twelfth pass). Past the trained length every layer
# stays sparse and remapped: exact logits there are at untrained distances.
# STRATA_SPARSE_DENSE_TOP=0 keeps every layer sparse.
DENSE_TOP = float(os.environ.get("STRATA_SPARSE_DENSE_TOP") or 0.25)
DENSE_TOP_PAST = FUSED_PAST_MAX

# MLX's CPU exp runs about 50M elements/s on these machines, numpy's (SIMD) about ten times
# that, so the exp of a long softmax was most of a chunk's attention (a 512-token chunk over
# 7,680 keys: 0.75 of 1.1 s a layer; with numpy a 10k prefill chunk ran 1.6x faster). On
# the CPU a partial over at least this many float32 logits evaluates them and does the exp,
# the sums and the value product in numpy. Not below: each such partial is a sync. 65,536
# once took a 128k question's prefill from 2.1 to 3.2 s, but numpy's bundled BLAS then ran
# two spinning threads; held to one (engine.kv.cpu_select), the same question's first token
# went 2.6 -> 2.3 s and a 64-token sparse chunk at 24k ran 1.17x faster (docs/benchmarks.md,
# the 128k question, 2026-12-05). 0 never does.
NP_EXP_MIN = int(os.environ.get("STRATA_NP_EXP_MIN") or 1 << 16)

_Partial = tuple[Any, Any, Any]  # running max (H, R), sum (H, R), output (H, R, D)


@dataclass
class StepReads:
    """What one sparse step's selection hands its attention, so that nothing is read or
    converted twice in the step. Selection sets `also` (the sinks' and window's page
    ranges: sink pages, the window's first page, n_pages) and `voted` ((H, k) voted blocks,
    blocks a page), which the step's first read of cold pages takes along and clears; the
    numpy selection sets `np_in` (the query and the recent partial as numpy) and `resident`
    (its compiled pass found every page in RAM). A read of cold pages for the step only
    (`_step_pages`) leaves `pages` (those read), `row` (page -> its row in `k` and `v`), `k`
    and `v` (decoded, (n, H, P, D)); a later read in the step takes them from here."""

    also: tuple[int, int, int] | None = None
    voted: tuple[Any, int] | None = None
    np_in: tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
    resident: bool = False
    pages: np.ndarray | None = None
    row: np.ndarray | None = None
    k: Any = None
    v: Any = None


def _stats(s: Any, v: Any) -> _Partial:
    """Softmax statistics (row max, row sum of exp, exp @ v) of logits s (H, R, T) over
    values v (H, T, Dv), or of s (n, H, R, P) over pages v (n, H, P, Dv) summed over the
    pages. On the CPU, past NP_EXP_MIN float32 logits, the logits are evaluated and the
    rest runs in numpy (see NP_EXP_MIN)."""
    pages = s.ndim == 4
    axes = (0, 3) if pages else (2,)
    if (NP_EXP_MIN and s.size >= NP_EXP_MIN and s.dtype == v.dtype == mx.float32
            and mx.default_device() == mx.cpu):
        mx.eval(s, v)
        a = np.asarray(s)
        if not pages:
            m, total, o = cpu_select.softmax_stats(np.array(a), np.asarray(v))
            return mx.array(m), mx.array(total), mx.array(o)
        m = a.max(axis=axes)
        e = a - m[None, :, :, None]
        np.exp(e, out=e)
        o = np.matmul(e, np.asarray(v))
        return mx.array(m), mx.array(e.sum(axis=axes)), mx.array(o.sum(axis=0))
    m = s.max(axis=axes)
    p = mx.exp(s - (m[None, :, :, None] if pages else m[..., None]))
    o = p @ v
    return m, p.sum(axis=axes), (o.sum(axis=0) if pages else o)


def _partial_pages(qg: Any, k: Any, v: Any) -> _Partial:
    """Softmax statistics of queries qg (H, R, D) over pages k, v (n, H, P, D)."""
    return _stats(qg[None] @ k.swapaxes(-1, -2), v)        # s: (n, H, R, P)


def _partial_gathered(qg: Any, k: Any, v: Any) -> _Partial:
    """Same over per-head gathered pages k, v (n, H, P, D) flattened to (H, n*P, D)."""
    n, h, p_, d = k.shape
    return _partial_flat(qg, k.transpose(1, 0, 2, 3).reshape(h, n * p_, d),
                         v.transpose(1, 0, 2, 3).reshape(h, n * p_, d))


def _partial_flat(qg: Any, kk: Any, vv: Any) -> _Partial:
    """Over per-head keys and values kk, vv (H, T, D), no mask."""
    if _np_chunk(qg, vv):
        return _partial_np(qg, (kk,), vv, 0)
    return _stats(qg @ kk.swapaxes(-1, -2), vv)            # s: (H, R, T)


def _partial_parts(qg: Any, ks: tuple[Any, ...], vv: Any) -> _Partial:
    """As `_partial_flat` over the keys `ks` (each (H, T_i, D)) taken in order, vv (H, sum
    T_i, D): the logits are joined, not the keys (a few thousand floats, not the keys)."""
    if _np_chunk(qg, vv):
        return _partial_np(qg, ks, vv, 0)
    return _stats(mx.concatenate([qg @ k.swapaxes(-1, -2) for k in ks], axis=-1), vv)


def _np_chunk(qg: Any, vv: Any) -> bool:
    """Whether a partial of a prompt chunk's rows qg (H, R, D) over vv (H, T, Dv) is taken in
    numpy (`_partial_np`): more than SPARSE_CHUNK_L x 8 rows (a 512-token chunk's, not a
    decode step's, a question's or a 64-token sparse chunk's, which the numpy steps take)."""
    return qg.shape[1] > 8 * SPARSE_CHUNK_L and cpu_select.chunk_enabled(
        qg.shape[1], vv.shape[1], qg.dtype, vv.dtype)


def _partial_np(qg: Any, ks: tuple[Any, ...], vv: Any, L: int) -> _Partial:
    """`_partial_parts` (L 0) or `_partial_recent` (causal over the last L keys) in numpy
    (cpu_select.chunk_partial): the logits a piece of the rows at a time, never the whole
    chunk's (142 MB a layer for 512 tokens over 7,700 keys, then copied for the exp)."""
    mx.eval(qg, *ks, vv)
    k = np.asarray(ks[0]) if len(ks) == 1 else np.concatenate([np.asarray(a) for a in ks], 1)
    m, total, out = cpu_select.chunk_partial(np.asarray(qg), k, np.asarray(vv), L)
    return mx.array(m), mx.array(total), mx.array(out)


def _partial_recent(qg: Any, k: Any, v: Any, L: int) -> _Partial:
    """Over the recent block k, v (H, T, D) whose last L tokens are the queries' own chunk."""
    if _np_chunk(qg, v):
        return _partial_np(qg, (k,), v, L)
    h, r, _ = qg.shape
    t = k.shape[1]
    s = qg @ k.swapaxes(-1, -2)                           # (H, rep*L, T)
    if L > 1:
        rows = mx.arange(L)[:, None] + (t - L)
        mask = rows >= mx.arange(t)[None, :]               # (L, T)
        s = s.reshape(h, r // L, L, t)
        s = mx.where(mask, s, mx.array(-mx.inf, s.dtype)).reshape(h, r, t)
    return _stats(s, v)


def _recent(qg: Any, k: Any, v: Any, L: int) -> _Partial:
    """`_partial_recent`; for a decode step on the CPU that the numpy steps take (float32),
    in numpy, as numpy arrays: MLX's seven small ops took ~100 us a layer, numpy ~15
    (docs/benchmarks.md). Whoever attends in MLX after it converts it (`_as_mx`)."""
    if not (L <= SPARSE_MAX_L and qg.dtype == k.dtype == v.dtype == mx.float32
            and cpu_select.enabled(qg.shape[1])):
        return _partial_recent(qg, k, v, L)
    mx.eval(qg, k, v)
    return cpu_select.recent_partial(cpu_select.to_np(qg), np.asarray(k), np.asarray(v), L)


def _as_mx(acc: _Partial | None) -> _Partial | None:
    """A partial as MLX arrays (`_recent`'s numpy one, where MLX attends next)."""
    if acc is None or not isinstance(acc[0], np.ndarray):
        return acc
    return mx.array(acc[0]), mx.array(acc[1]), mx.array(acc[2])


def _lazy(acc: _Partial | None) -> tuple[Any, ...]:
    """The MLX arrays of a partial, to evaluate (none of a numpy one)."""
    return () if acc is None else tuple(a for a in acc if isinstance(a, mx.array))


def _merge(a: _Partial | None, b: _Partial) -> _Partial:
    if a is None:
        return b
    a = _as_mx(a)
    assert a is not None
    m = mx.maximum(a[0], b[0])
    ea, eb = mx.exp(a[0] - m), mx.exp(b[0] - m)
    return m, a[1] * ea + b[1] * eb, a[2] * ea[..., None] + b[2] * eb[..., None]


def _sink_partial(sinks: Any, h: int, L: int, dv: int, dtype: Any) -> _Partial:
    """The sinks as one more softmax term per query row: logit s, weight exp(s - s) = 1, and
    nothing added to the output. sinks: (q_heads,), rows ordered as `attend` reshapes them."""
    s = sinks.astype(dtype).reshape(h, -1, 1)
    m = mx.broadcast_to(s, (h, s.shape[1], L)).reshape(h, -1)
    return m, mx.ones_like(m), mx.zeros((*m.shape, dv), dtype)


def attend(cache: Any, queries: Any, keys: Any, values: Any, scale: float,
           sinks: Any = None) -> Any:
    """Paged attention for one layer; see the module docstring."""
    store, layer = cache.store, cache.layer
    n_pages, tail_k, tail_v = cache.view
    b, hq, L, d = queries.shape
    if b != 1:
        raise NotImplementedError("paged KV cache: batch size 1 only")
    h = store.kv_heads
    contig = getattr(cache, "contig", None)
    if contig is not None:
        # Every position in the cache's contiguous buffer (in sparse mode at most the budget,
        # so attending to all of it is what sparse selection would do): one fused call, as
        # mlx-lm's cache. (The cache wrote the block summaries as it committed the pages.)
        if L > SPARSE_MAX_L and store.settings.mode == "sparse":
            # The question's votes as a paged chunk records them (the buffer's keys are the
            # pages' and the tail's, in order): a prompt within the budget has them too, so
            # a reply that grows past it selects as one restored from the page store does.
            _note_or_clear_votes(store, layer, queries, scale, 0, contig[0][0], 0)
        if sinks is None and cpu_select.dense_enabled(contig[0].shape[2], hq // h * L,
                                                      queries.dtype,
                                                      cpu_select.CONTIG_DENSE_MIN_KEYS):
            return _dense_np(queries, contig[0], contig[1], scale)
        return _fused_all(queries, contig[0], contig[1], scale, sinks)
    # The tail plus the chunk (1, H, T, D): the cache built it as it committed the pages.
    both = getattr(cache, "recent", None)
    if both is None or both[0].shape[2] != L + (0 if tail_k is None else tail_k.shape[2]):
        both = ((keys, values) if tail_k is None else
                (mx.concatenate([tail_k, keys], axis=2), mx.concatenate([tail_v, values], axis=2)))
    rk, rv = both[0].squeeze(0), both[1].squeeze(0)  # a view: indexing was a gather (a copy)
    note_blocks(store, layer, n_pages, rk)
    past = n_pages * store.P
    if L >= WARM_CHUNK and past + rk.shape[1] >= cpu_select.DENSE_MIN_KEYS and \
            cpu_select.enabled():
        cpu_kernels.warm()  # a long prompt: the decode steps' loops load meanwhile
        cpu_native.warm()
    if L > SPARSE_MAX_L and store.settings.mode == "sparse":
        _note_or_clear_votes(store, layer, queries, scale, n_pages, rk, past)
    # Sparse past the trained length: every chunk, prefill too, attends sparsely with
    # positions remapped into the trained window (engine/kv/remap.py).
    spec = remap.spec_for(store, past + rk.shape[1]) if n_pages else None
    # (A sparse decode step over at most its budget attends to everything anyway.)
    short = past <= FUSED_DECODE_PAST and (store.settings.mode != "sparse"
                                           or past <= store.settings.budget_tokens)
    # An exact chunk at any depth where numpy takes it (`_chunk_np`: in MLX, past
    # FUSED_PAST_MAX the page groups' ops cost more than one contiguous copy).
    whole = L > SPARSE_MAX_L and (past <= FUSED_PAST_MAX or (
        store.settings.mode != "sparse" and cpu_select.chunk_enabled(
            hq // h * L, past + rk.shape[1], queries.dtype, rk.dtype)))
    if spec is None and (whole or short):
        view = store.resident_view(layer, n_pages) if n_pages else (None, None)
        if view is not None:
            return _fused(queries, both[0], both[1], view, scale, sinks)
    r = (hq // h) * L
    dv = values.shape[-1]
    qg = (queries * scale).reshape(h, r, d)
    settings = store.settings
    start = past + rk.shape[1] - L  # the chunk's first position
    sparse = bool(n_pages) and settings.mode == "sparse" and (
        spec is not None or L <= SPARSE_MAX_L
        or (L <= SPARSE_CHUNK_L and n_pages * store.P > SPARSE_PREFILL_PAST))
    exact = bool(n_pages) and (not sparse or (spec is None and (
        dense_top(store, layer, past)
        or (FIRST_EXACT and L <= SPARSE_MAX_L and store.tables[layer].votes_at == start))))
    acc = _exact_whole(store, layer, qg, n_pages, rk, rv, L) if exact else None
    if acc is None:
        recent = _recent(qg, rk, rv, L)
        acc = recent
        if exact:
            acc = _exact(store, layer, qg, n_pages, acc)
        elif sparse:
            budget = None
            if (spec is not None and PREFILL_REACH and L > QUESTION_L
                    and past <= PREFILL_REACH_PAST):
                budget = max(settings.budget_tokens, spec.trained - rk.shape[1])
            acc = _sparse(store, layer, qg, n_pages, recent, spec, start, start + L,
                          budget, recent_only=budget is not None and PREFILL_RECENT)
    assert acc is not None
    if isinstance(acc[2], np.ndarray):
        # The numpy steps' partial (`_sparse`, `_exact` over pages all in RAM): divided here and
        # converted once, where three conversions and MLX's division cost ~0.1 ms a layer.
        if sinks is None:
            out = mx.array((acc[2] / acc[1][..., None]).reshape(1, hq, L, dv))
            return out if out.dtype == queries.dtype else out.astype(queries.dtype)
        acc = (mx.array(acc[0]), mx.array(acc[1]), mx.array(acc[2]))
    if sinks is not None:
        acc = _merge(acc, _sink_partial(sinks, h, L, dv, acc[2].dtype))
    out = acc[2] / acc[1][..., None]
    return out.reshape(1, hq, L, dv).astype(queries.dtype)


def dense_top(store: Any, layer: int, past: int) -> bool:
    """Whether sparse mode attends this layer exactly over `past` tokens within the trained
    length: one of the top DENSE_TOP share of the store's layers (rounded: 8 of 30, none of
    one), at most DENSE_TOP_PAST in."""
    n = store.n_layers
    return past <= DENSE_TOP_PAST and layer >= n - int(DENSE_TOP * n + 0.5)


def _fused_all(queries: Any, k: Any, v: Any, scale: float, sinks: Any = None) -> Any:
    """MLX's fused attention of a chunk over keys and values (1, H, T, D) that end with it
    (on the CPU, a prompt chunk's in numpy: `_chunk_np`)."""
    _, hq, L, _ = queries.shape
    if sinks is None and L > 1 and cpu_select.chunk_enabled(hq // k.shape[1] * L, k.shape[2],
                                                            queries.dtype, k.dtype):
        return _chunk_np(queries, k, v, scale)
    mask = None if L == 1 else "causal"  # aligned to the end, as mlx-lm's
    if sinks is None:
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask,
                                                sinks=sinks.astype(queries.dtype))


def _fused(queries: Any, keys: Any, values: Any, view: tuple[Any, Any], scale: float,
           sinks: Any = None) -> Any:
    """A chunk over a short, all-resident past (keys, values: the tail and the chunk, (1, H,
    T, D)): one contiguous copy, then MLX's fused attention (for hundreds of queries faster
    than page-wise online softmax; for a decode step over a page or two, fewer ops; on the
    CPU, a prompt chunk's in numpy: `_chunk_np`)."""
    _, hq, L, _ = queries.shape
    _, h, _, d = keys.shape
    k, v = keys, values
    if view[0] is not None:
        n, _, p, _ = view[0].shape
        k = mx.concatenate([view[0].transpose(1, 0, 2, 3).reshape(1, h, n * p, d), keys], 2)
        v = mx.concatenate([view[1].transpose(1, 0, 2, 3).reshape(1, h, n * p, -1), values],
                           2)
    t = k.shape[2]
    if sinks is None and L > 1 and cpu_select.chunk_enabled(hq // h * L, t, queries.dtype,
                                                            k.dtype):
        return _chunk_np(queries, k, v, scale)
    mask = None if L == 1 else (mx.arange(L)[:, None] + (t - L)) >= mx.arange(t)[None, :]
    if sinks is None:
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask,
                                                sinks=sinks.astype(queries.dtype))


def _chunk_np(queries: Any, keys: Any, values: Any, scale: float) -> Any:
    """A prompt chunk's attention over keys and values (1, H, T, D) that end with it, in
    numpy (cpu_select.chunk_attention): what `_fused_all` computes, without MLX's CPU exp."""
    _, hq, L, d = queries.shape
    h = keys.shape[1]
    q = cpu_select.to_np((queries * scale).reshape(h, -1, d))
    mx.eval(keys, values)
    out = cpu_select.chunk_attention(q, np.asarray(keys)[0], np.asarray(values)[0], L)
    return mx.array(out.reshape(1, hq, L, -1))


def _dense_np(queries: Any, keys: Any, values: Any, scale: float) -> Any:
    """A decode step's attention over keys and values (1, H, T, D) that end with its own
    tokens, in attend.c (cpu_native.dense_flat) or numpy (cpu_select.dense_partial): what
    `_fused_all` computes."""
    _, hq, L, d = queries.shape
    h = keys.shape[1]
    q = cpu_select.to_np((queries * scale).reshape(h, -1, d))
    mx.eval(keys, values)
    k, v = np.asarray(keys)[0], np.asarray(values)[0]
    part = cpu_native.dense_flat(q, k, v, L, cpu_kernels.THREADS)  # attend.c, where it runs
    if part is None:
        part = cpu_select.dense_partial(q, k, v, pages=False, causal_rows=L)
    _, total, out = part
    return mx.array((out / total[..., None]).reshape(1, hq, L, -1))


def _exact_whole(store: Any, layer: int, qg: Any, n_pages: int, rk: Any, rv: Any, L: int
                 ) -> _Partial | None:
    """A decode step's exact attention over pages all in RAM and the recent keys rk, rv (H,
    T, D), in one call of attend.c (cpu_native: pages and tail merged in C, where the tail's
    numpy partial and the merge cost ~50 us a layer); None where that does not run (then
    `_recent` and `_exact`)."""
    _, r, d = qg.shape
    if (L > SPARSE_MAX_L or store.codec.quantized
            or not cpu_native.fits(r, d, rv.shape[-1], store.P)
            or not (qg.dtype == rk.dtype == rv.dtype == mx.float32)
            or not cpu_select.dense_enabled(n_pages * store.P, r, qg.dtype)):
        return None
    view = store.resident_parts(layer, n_pages)
    if view is None:
        return None
    mx.eval(view, qg, rk, rv)
    return cpu_native.dense_pages(
        cpu_select.to_np(qg), np.asarray(view[0][0]), np.asarray(view[1][0]), 0, n_pages,
        cpu_kernels.THREADS, tail=(np.asarray(rk), np.asarray(rv)), causal=L)


def _exact(store: Any, layer: int, qg: Any, n_pages: int, acc: _Partial | None) -> _Partial:
    h, r, d = qg.shape
    group = max(1, SCORE_ELEMENTS // (h * r * store.P))
    codec = store.codec
    if codec.quantized:
        group = min(group, max(1, DECODE_ELEMENTS // (h * store.P * d)))
    view = store.resident_parts(layer, n_pages)
    if view is not None and (not codec.quantized or cpu_kernels.available()) and \
            cpu_select.dense_enabled(n_pages * store.P, r, qg.dtype):
        # A decode step over pages all in RAM: compiled loops (or numpy), on the CPU's cores
        # at once; quantized pages decoded a page at a time into L1 (without the loops, MLX
        # decodes them below: no wait on MLX for nothing).
        mx.eval(view, qg, *_lazy(acc))
        q = cpu_select.to_np(qg)
        if codec.quantized:
            part = cpu_select.dense_codes(q, tuple(np.asarray(a) for a in view[0]),
                                          tuple(np.asarray(a) for a in view[1]), codec.bits)
        else:
            part = cpu_select.dense_partial(q, np.asarray(view[0][0]), np.asarray(view[1][0]),
                                            pages=True)
        if part is not None:
            if acc is not None:
                part = cpu_select.merge([part, (np.asarray(acc[0]), np.asarray(acc[1]),
                                                np.asarray(acc[2]))])
            # As numpy: `attend` divides and converts it once, as a sparse step's.
            return part
    if view is not None:
        kp, vp = view
        for i in range(0, n_pages, group):
            k = codec.decode(tuple(a[i:i + group] for a in kp))
            v = codec.decode(tuple(a[i:i + group] for a in vp))
            acc = _merge(acc, _partial_pages(qg, k, v))
        return acc  # type: ignore[return-value]
    for k, v in store.stream(layer, np.arange(n_pages), min(group, STREAM_PAGES)):
        acc = _merge(acc, _partial_pages(qg, k, v))
        mx.eval(acc)  # frees the group's pages: a lazy pass would hold every page it read
    return acc  # type: ignore[return-value]


def note_blocks(store: Any, layer: int, n_pages: int, rk: Any) -> None:
    """Block summaries of the pages a chunk completed: rk (H, T, D) is the tail the cache
    held plus the chunk, whose first T // P pages were just committed as pages n_pages...
    Skipped when the table lags (pages that came another way): `_catch_up` reads those."""
    table = store.tables[layer]
    full = rk.shape[1] // store.P
    if full and table.block_pages == n_pages:
        h, _, d = rk.shape
        k = rk[:, :full * store.P].reshape(h, full, store.P, d).transpose(1, 0, 2, 3)
        # From the keys as stored (quantized, or cast to the page dtype), so that a process
        # that restores these pages and catches up from them selects exactly alike.
        k = store.codec.decode(store.codec.encode(k)) if store.codec.quantized else \
            k.astype(store.dtype)
        table.add_blocks(*_blocks_of(k, table.block_tokens))


def _blocks_of(k: Any, b: int) -> tuple[Any, Any]:
    """Pages k (n, H, P, D) -> per block of b tokens, key min and max (n, H, P // b, D)."""
    n, h, p, d = k.shape
    kb = k.reshape(n, h, p // b, b, d)
    return kb.min(axis=3), kb.max(axis=3)


def _catch_up(store: Any, layer: int, n_pages: int) -> None:
    """Block summaries for pages that reached the store without passing `attend` (restored
    from the prefix cache, filled by a benchmark, adopted after a restart): read once."""
    table = store.tables[layer]
    if table.block_pages >= n_pages:
        return
    pages = np.arange(table.block_pages, n_pages)
    res = table.resident(pages)
    for i, (k, _) in enumerate(store.stream(layer, pages, STREAM_PAGES)):
        r = res[i * STREAM_PAGES:(i + 1) * STREAM_PAGES]
        # `stream` gives a group's resident pages first: back to page order.
        order = np.argsort(np.concatenate([np.flatnonzero(r), np.flatnonzero(~r)]))
        bmin, bmax = _blocks_of(k[mx.array(order)], table.block_tokens)
        mx.eval(bmin, bmax)
        table.add_blocks(bmin, bmax)


def _page_rows(table: Any, pages: Any) -> tuple[Any, Any]:
    """The block summaries (H, M * nb, D) of `pages` (H, M) per head, the blocks of each page
    in order: one `take` of whole pages' rows from the summaries viewed as (H * pages, nb *
    D), where a take_along_axis of each block's D values cost 15x more (0.46 ms against 0.03
    at 32k, two levels, budget 2,048)."""
    bmin, bmax = table.block_summaries
    h, n, d = bmin.shape
    rows = (pages + mx.arange(h)[:, None] * table.block_pages).reshape(-1)
    nb = n // table.block_pages
    return tuple(mx.take(a.reshape(h * table.block_pages, nb * d), rows, axis=0).reshape(
        h, -1, d) for a in (bmin, bmax))  # type: ignore[return-value]


def _score(bmin: Any, bmax: Any, qt: Any, m: Any, starts: Any = None,
           far: tuple[remap.RopeSpec, int, int] | None = None, group: int = 1) -> Any:
    """Per KV head and block, the bound on the attention weight any query row could give it:
    logsumexp over rows of (bound on q.k) - m, m being the row's running max (H, R).
    bmin, bmax (H, n, D) key min and max; qt (H, D, R). The bound is computed in the
    queries' dtype: on the CPU a float16 matmul has no BLAS kernel (0.1-0.8 s a layer for a
    64-token chunk over 128k), and the cast costs little beside it. With `far` (spec, E, S)
    and the rows' first positions `starts` (1 or H, n): rows in runs of `group` (a page's
    blocks) whose run starts before E are bounded moved by `_far_shift` of that start, by
    the query rotated back once a run (a rotation per block cost 6x the plain bound)."""
    bmax, bmin = bmax.astype(qt.dtype), bmin.astype(qt.dtype)
    if far is None:
        bound = bmax @ mx.maximum(qt, 0) + bmin @ mx.minimum(qt, 0)    # (H, n, R)
    else:
        h, d, r = qt.shape
        n = bmax.shape[1]
        g = -(-n // group)
        if g * group > n:  # a last, partial run: zero rows, cut off below
            pad = [(0, 0), (0, g * group - n), (0, 0)]
            bmax, bmin = mx.pad(bmax, pad), mx.pad(bmin, pad)
        # (1 or H, g) shifts: the rotation broadcasts, its angles computed once a shift
        q = remap.rerotate(qt.swapaxes(-1, -2)[:, None], -_far_shift(starts[:, ::group], far),
                           far[0])                                    # (H, g, R, D)
        q = mx.broadcast_to(q, (h, g, r, d))
        if group == 1:  # one row a rotation (pages): products, not 1-row matmuls
            bound = (mx.maximum(q, 0) * bmax[:, :, None] +
                     mx.minimum(q, 0) * bmin[:, :, None]).sum(axis=-1)
        else:
            q = q.swapaxes(-1, -2)                                    # (H, g, D, R)
            bound = (bmax.reshape(h, g, group, d) @ mx.maximum(q, 0) +
                     bmin.reshape(h, g, group, d) @ mx.minimum(q, 0)).reshape(h, -1, r)[:, :n]
    return mx.logsumexp(bound - m[:, None, :], axis=-1)


def far_of(spec: remap.RopeSpec, end: int, sink_tokens: int) -> tuple[remap.RopeSpec, int, int]:
    """A step ending at token `end`'s far scoring (spec, E, S): candidates starting before E
    are scored moved to E + S. The reach layout moves what the trained length does not reach
    just inside it (E = end - trained, after the S sink tokens), as it will read them; the
    InfLLM layout reads every chosen block near the window, so anything further than
    FAR_DISTANCE is scored FAR_DISTANCE back (S = 0)."""
    if remap.reach(end, spec.trained):
        return spec, end - spec.trained, sink_tokens
    return spec, end - FAR_DISTANCE, 0


def _far_shift(starts: Any, far: tuple[remap.RopeSpec, int, int]) -> Any:
    """Positions to move each candidate starting at `starts` by (FAR_ROTATE): E + S - start
    before E = end - trained, where the trained length does not reach; else 0. (Scoring
    moves a page's blocks by its first block's shift, so one at offset o sits at E + S + o.)"""
    _, e, s = far
    starts = starts.astype(mx.int32)
    return mx.where(starts < e, e + s - starts, 0)


def note_votes(store: Any, layer: int, queries: Any, scale: float, n_pages: int,
               rk: Any) -> None:
    """The question's votes: the exact softmax weight the chunk's last VOTE_QUERIES queries
    (1, q_heads, L, D) give each block of the pages [0, n_pages) and of rk (H, T, D), the
    tail plus the chunk (causal), summed over the group's query heads and those queries, kept
    in the layer's table (kv_heads, blocks). Keys from either tier, in page order, so the
    votes do not depend on where the pages live. Never past the trained length
    (`_note_or_clear_votes`): the question goes as steps there."""
    table = store.tables[layer]
    h, t, d = rk.shape
    _, hq, L, _ = queries.shape
    lv = min(L, VOTE_QUERIES)
    q = (queries[0, :, L - lv:] * scale).reshape(h, -1, d)           # (H, R), rows rep-major
    r = q.shape[1]
    b = table.block_tokens
    parts: list[tuple[Any, Any, Any]] = []                            # (max, sum, block sums)
    if n_pages:
        group = max(1, SCORE_ELEMENTS // (h * r * store.P))
        for k in _key_groups(store, layer, np.arange(n_pages), group):
            parts.append(_vote_part(q[None] @ k.swapaxes(-1, -2), b))  # (n, H, R, P)
    s = q @ rk.swapaxes(-1, -2)                                       # (H, R, T)
    rows = mx.arange(lv)[:, None] + (t - lv)
    s = mx.where(rows >= mx.arange(t)[None, :], s.reshape(h, -1, lv, t),
                 mx.array(-mx.inf, s.dtype)).reshape(h, r, t)
    parts.append(_vote_part(s, b))
    top = parts[0][0]
    for p in parts[1:]:
        top = mx.maximum(top, p[0])
    scales = [mx.exp(p[0] - top) for p in parts]
    z = sum((p[1] * c for p, c in zip(parts, scales, strict=True)), mx.zeros_like(top))
    votes = mx.concatenate([p[2] * (c / z)[..., None] for p, c in zip(parts, scales,
                                                                      strict=True)], axis=-1)
    votes = votes.sum(axis=1).astype(mx.float32)                      # (H, blocks)
    mx.eval(votes)
    table.set_votes(votes, n_pages * store.P + t)


def _vote_part(s: Any, b: int) -> tuple[Any, Any, Any]:
    """Of logits s over pages (n, H, R, P) or over keys in order (H, R, T): each row's max,
    its sum of exp against that max, and those exps summed per block of b keys (H, R,
    blocks), in block order (over keys, a partial last block is in the window: no vote). On
    the CPU, past NP_EXP_MIN float32 logits, in numpy: MLX's CPU exp made the votes 39 ms of
    a 512-token chunk's layer at 8k."""
    pages = s.ndim == 4
    axes = (0, 3) if pages else (2,)
    on_np = (NP_EXP_MIN and s.size >= NP_EXP_MIN and s.dtype == mx.float32
             and mx.default_device() == mx.cpu)
    e: Any
    m: Any
    if on_np:
        mx.eval(s)
        e = np.array(s)
        m = e.max(axis=axes)
        e -= m[None, :, :, None] if pages else m[..., None]
        np.exp(e, out=e)
    else:
        m = s.max(axis=axes)
        e = mx.exp(s - (m[None, :, :, None] if pages else m[..., None]))
    if pages:
        n, h, r, p = e.shape
        bs = e.reshape(n, h, r, p // b, b).sum(axis=-1).transpose(1, 2, 0, 3).reshape(h, r, -1)
    else:
        h, r, t = e.shape
        tf = t // b * b
        bs = e[..., :tf].reshape(h, r, tf // b, b).sum(axis=-1)
    total = e.sum(axis=axes)
    if on_np:
        return mx.array(m), mx.array(total), mx.array(np.ascontiguousarray(bs))
    return m, total, bs


def _note_or_clear_votes(store: Any, layer: int, queries: Any, scale: float, n_pages: int,
                         rk: Any, past: int) -> None:
    """A sparse prefill chunk's votes (`note_votes`), or none past VOTE_PAST_MAX or past the
    trained length: there the question goes as steps that choose for themselves
    (`question_steps`), and the last chunk's votes are the prose's, not the question's (at 16k
    with them half the budget held blocks the prose's end looked at, and the 50% fact was
    missed that the same steps found without them, docs/benchmarks.md). A wide first pass's
    fixed blocks stay for the same question's second pass (`ask`)."""
    table = store.tables[layer]
    if (table.fixed is not None and not question.wide(store)
            and table.votes_at == past + rk.shape[1] - queries.shape[2]):
        return
    if (VOTE_SHARE > 0 and past <= VOTE_PAST_MAX
            and remap.spec_for(store, past + rk.shape[1]) is None):
        note_votes(store, layer, queries, scale, n_pages, rk)
    else:  # an older chunk's votes are not this prompt's question
        store.tables[layer].set_votes(None, -1)


def question_steps(store: Any, end: int) -> int:
    """How many of a prompt's last tokens (it ends at token `end`) go as the question: in
    chunks of at most QUESTION_L tokens (one chunk, or decode-style steps), each selecting
    its blocks within the decode budget with the far scoring: QUESTION_STEPS where the prompt
    reaches past the trained length in sparse mode with positions remapped, else 0. A longer
    chunk there reads only the trained reach (PREFILL_REACH) or chooses without the far
    scoring, so a question prefilled so never reads a fact further back, and the answer
    alone reading it is not enough (docs/benchmarks.md, issue 19, 2026-12-07). The question
    chooses within the reply's budget: the trained reach's (as a prefill chunk there reads,
    PREFILL_REACH) found the 16k fact at 90% and lost those at 50% and 70%."""
    return QUESTION_STEPS if end > QUESTION_STEPS and remap.spec_for(store, end) else 0


def ask(forward: Callable[[Any], Any], cache: Sequence[Any], tokens: Any) -> Any:
    """`forward(tokens)` for a prompt's question chunk (1, n) over `cache` (a model's layer
    caches), returning what it returns. Past the trained length in sparse mode (remapped),
    up to question.WIDE_MAX x it, it runs twice (engine.kv.question): a wide first pass
    records the blocks the question's attention weights favour, the cache is trimmed back,
    and the second pass, whose output is returned, reads the narrow budget with those blocks
    held, as does the reply after it."""
    store = next((c.store for c in cache if hasattr(c, "store")), None)
    n = tokens.shape[1]
    end = next((c.offset for c in cache if hasattr(c, "store")), 0) + n
    spec = None if store is None else remap.spec_for(store, end)
    if spec is None or not question.applies(spec, end) or not SPARSE_MAX_L < n <= QUESTION_L:
        return forward(tokens)
    question.set_wide(store, True)
    try:
        forward(tokens)
        mx.eval([c.state for c in cache])
    finally:
        question.set_wide(store, False)
    for c in cache:
        c.trim(n)
    return forward(tokens)


def question_tokens(store: Any, end: int) -> int:
    """How many of a prompt's last tokens (it ends at token `end`) a restore leaves to be
    prefilled so that the question's votes are recorded as a fresh prefill records them:
    the last chunk's VOTE_QUERIES queries and the final token; 0 when this store records no
    votes (not sparse, votes off, or past VOTE_PAST_MAX or the trained length, where a chunk
    records none), or none that matter soon: a prompt under half the budget (a reply must
    pass the rest of the budget before a block is chosen) keeps its whole restore, logits
    and all. Past the trained length with the question read twice (`ask`): the question
    (`question_steps`), whose first pass fixes the blocks its reply holds."""
    spec = remap.spec_for(store, end)
    if spec is not None and question.applies(spec, end) and question_steps(store, end):
        return question_steps(store, end)
    settings = store.settings
    if (getattr(settings, "mode", None) != "sparse" or VOTE_SHARE <= 0
            or end - VOTE_QUERIES - 1 > VOTE_PAST_MAX or 2 * end <= settings.budget_tokens
            or remap.spec_for(store, end) is not None):
        return 0
    return VOTE_QUERIES + 1


def _key_groups(store: Any, layer: int, pages: np.ndarray, group: int) -> Any:
    """Decoded keys (n, H, P, D) of `pages`, groups of at most `group`, in page order, from
    whichever tier holds each page."""
    table = store.tables[layer]
    view = store.resident_parts(layer, int(pages[-1]) + 1) if len(pages) and bool(
        (np.diff(pages) == 1).all()) and int(pages[0]) == 0 else None
    if view is not None:
        for i in range(0, len(pages), group):
            yield store.codec.decode(tuple(a[i:i + group] for a in view[0]))
        return
    res = table.resident(pages)
    for i, (k, _) in enumerate(store.stream(layer, pages, group)):
        r = res[i * group:(i + 1) * group]
        order = np.argsort(np.concatenate([np.flatnonzero(r), np.flatnonzero(~r)]))
        yield k[mx.array(order)]


def _fixed(table: Any, start: int) -> np.ndarray | None:
    """The blocks a wide first pass fixed for a step starting at `start` ((H, n), best first,
    -1 past a head's own count), or None (no such pass for this context)."""
    if table.fixed is None or table.votes_at > start:
        return None
    return table.fixed  # type: ignore[no-any-return]


def _hold(fixed: np.ndarray, top: np.ndarray, lo: int, hi: int, k_sel: int) -> np.ndarray:
    """Each head's fixed blocks within [lo, hi) (at most k_sel), then its own choice `top`
    (H, k_sel) without them, in the order given, cut to k_sel in all: the step chooses as if
    nothing were fixed (the scratch that found 5 of 5 facts at 32k did so), and the fixed
    blocks take the places of the last of its choice."""
    out = np.empty((top.shape[0], k_sel), np.int64)
    for h, (f, row) in enumerate(zip(fixed, top, strict=True)):
        f = f[(f >= lo) & (f < hi)][:k_sel]
        rest = row[~np.isin(row, f)]
        out[h, :len(f)] = f
        out[h, len(f):] = rest[:k_sel - len(f)]
    return out


def _voted(table: Any, lo: int, hi: int, nb: int, k_vote: int, start: int) -> Any:
    """The k_vote best-voted blocks (H, k_vote) among the candidates [lo, hi) pages, or None
    (no votes for this context, or too few voted blocks among the candidates)."""
    votes = table.votes
    if k_vote <= 0 or votes is None or table.votes_at > start:
        return None
    n = min(votes.shape[1], hi * nb) - lo * nb
    if n <= k_vote:
        return None
    pick = mx.argpartition(-votes[:, lo * nb:lo * nb + n], kth=k_vote - 1, axis=-1)
    return pick[:, :k_vote] + lo * nb


def _sparse(store: Any, layer: int, qg: Any, n_pages: int, acc: _Partial,
            spec: remap.RopeSpec | None = None, start: int = -1, end: int = 0,
            budget: int | None = None, recent_only: bool = False) -> _Partial:
    """Quest over blocks of BLOCK_TOKENS (8): per KV head, the blocks most likely to matter to any
    of its query heads, within the budget; the sinks and the window are read whole.

    A block's bound on q.k (sum over dims of max(q kmin, q kmax), two matmuls) is turned into
    an upper bound on the attention weight each query head could give it, relative to that
    head's strongest recent key (acc's running max), and those are summed over the group:
    one head that needs a block keeps it, where a sum of raw bounds let the other heads'
    indifference drown it. The sinks and the window take at most FIXED_SHARE of the budget;
    the window's older pages then compete as candidates. With RESCORE > 1 the bound only
    shortlists: `_rescore` ranks its best by their true logits. With question votes (the
    prompt's last chunk, `note_votes`), VOTE_SHARE of the chosen blocks are the best-voted
    ones, the same for every step of the reply. Every choice is a function of the summaries,
    the votes and the keys as stored, never of the tier a page is in: candidate pages are
    narrowed to the best READ_PAGES_FACTOR x RESCORE x the pages the budget fills on both
    tiers, and the shortlist's keys are read from either (`_gather_keys`).
    `spec` (past the trained length): the gathered keys are re-rotated so that the sinks,
    the chosen blocks and the window sit contiguously inside the trained window
    (remap.block_deltas); a decode step's selection scores the candidates the trained length
    does not reach as moved (FAR_ROTATE), a chunk's ranks by the keys as cached. `start`: the
    position of the step's first query (question votes are for the steps after theirs);
    `end`: the chunk's end (the remapped layout keeps what the trained length reaches);
    `budget`: tokens to attend instead of the settings' (a prefill chunk past the trained
    length, PREFILL_REACH); `recent_only`: the budget's blocks are the most recent ones
    (PREFILL_RECENT). Past the trained length the question's wide pass (`ask`) reads
    question.wide_budget and fixes its best-weighted blocks (`_fix_votes`); its second pass
    and the reply then read question.narrow_budget, those blocks first (`_hold`). A decode
    step the numpy steps attend returns its partial as numpy arrays (`attend` divides and
    converts it once)."""
    held = StepReads()
    far = None
    # Decode steps and the question (QUESTION_L) only: a chunk's rows multiply the rotated
    # queries (a 64-token chunk past 128k: 150 MB a layer).
    if spec is not None and FAR_ROTATE and budget is None and end - start <= QUESTION_L:
        far = far_of(spec, end, min(store.tables[layer].sink_pages, n_pages) * store.P)
    step = end if budget is None and not recent_only and end - start <= SPARSE_MAX_L else None
    table = store.tables[layer]
    votes = False
    if spec is not None and budget is None:
        if question.wide(store) and end - start > SPARSE_MAX_L:
            budget, votes = question.wide_budget(spec), True  # the question's first pass
        elif table.fixed is not None and table.votes_at <= start:
            budget = question.narrow_budget(spec, end)  # its second pass and the reply
    chosen = select_blocks(store, layer, qg, n_pages, acc, start, held, budget, recent_only,
                           far, step, np_top=True)
    if chosen is None:
        return _exact(store, layer, qg, n_pages, acc)
    top, sink, hi = chosen
    if end - start <= SPARSE_MAX_L and cpu_select.enabled(qg.shape[1]):
        # A decode step over pages all in RAM: attended in numpy too (the query and the
        # recent partial are evaluated already), returned as numpy for `attend` to divide.
        q_np, rec = held.np_in or (
            cpu_select.to_np(qg), (cpu_select.to_np(acc[0]), cpu_select.to_np(acc[1]),
                                   cpu_select.to_np(acc[2])))
        part = cpu_select.attend_blocks(store, layer, q_np, rec, np.asarray(top), sink, hi,
                                        n_pages, spec, end, held.resident)
        if part is not None:
            return part
    if isinstance(top, np.ndarray):
        top = mx.array(top.astype(np.int32))
    P = store.P
    b = table.block_tokens
    nb = P // b
    h, r, d = qg.shape
    delta = None
    if spec is not None:
        top, delta = remap.block_deltas(top, sink, hi, n_pages, P, b, end, spec.trained)
    # Attended blocks in the order sinks, chosen, window: with remapping only the first two
    # are re-rotated (the window's delta is 0, and rotating by 0 is the identity: at 32k and
    # a 2,048 budget that skipped 112 of 256 blocks' rotation, ~0.5 ms a layer).
    sinks = mx.arange(sink * nb)
    win = mx.arange(hi * nb, n_pages * nb)
    blocks = mx.concatenate([mx.broadcast_to(sinks[None], (h, sinks.shape[0])),
                             top.astype(sinks.dtype),
                             mx.broadcast_to(win[None], (h, win.shape[0]))], axis=1)
    n_rot = blocks.shape[1] - win.shape[0]
    page, blk = blocks // nb, blocks % nb
    heads = mx.arange(h)[:, None]
    if table.all_resident(n_pages):
        # Everything hot: stay lazy (no sync), map pages to slots inside the graph.
        slots = page if table.identity else mx.array(table.slot_of[:n_pages])[page]
        pools: tuple[Any, Any] | None = (store.pool_k[layer], store.pool_v[layer])
    else:
        page_np = np.array(page)
        uniq = np.unique(page_np)
        # Pages the rescoring read for this step only (RAM could not hold the shortlist) are
        # attended from what was read: a page is read once a step (never more than exact).
        got = None if held.k is not None else store.ensure_resident(layer, uniq)
        if got is not None:
            slots = mx.array(table.slot_of[page_np])
            pools = (store.pool_k[layer], store.pool_v[layer])
        else:
            ku, vu, row = _step_pages(store, layer, uniq, held)
            slots, pools = mx.array(row[page_np]), None

    def gather(which: int, cols: slice) -> Any:
        """Keys (0) or values (1) of the blocks `cols` of `blocks`, (H, n, b, dim)."""
        at, bk = slots[:, cols], blk[:, cols]
        if pools is None:
            a = ku if which == 0 else vu
            return a.reshape(*a.shape[:2], nb, b, a.shape[-1])[at, heads, bk]
        # Gathered head-major, (H, n, b, dim): flattening to (H, n*b, dim) is free.
        return store.codec.decode(tuple(a.reshape(*a.shape[:2], nb, b, a.shape[-1])[
            at, heads, bk] for a in pools[which]))

    v = gather(1, slice(None))
    v = v.reshape(h, -1, v.shape[-1])
    if spec is None:
        return _merge(acc, _partial_flat(qg, gather(0, slice(None)).reshape(h, -1, d), v))
    assert delta is not None
    n_top = top.shape[1]
    rot = mx.concatenate([delta[:, :sink * nb], delta[:, delta.shape[1] - n_top:]], axis=1)
    k_rot = remap.rerotate(gather(0, slice(0, n_rot)), rot, spec).reshape(h, -1, d)
    k_win = gather(0, slice(n_rot, None)).reshape(h, -1, d)
    if votes:
        _fix_votes(table, qg, k_rot, k_win, top, sink * nb, hi * nb, start)
    return _merge(acc, _partial_parts(qg, (k_rot, k_win), v))


def _fix_votes(table: Any, qg: Any, k_rot: Any, k_win: Any, top: Any, lo: int, hi: int,
               start: int) -> None:
    """The wide pass's votes: the softmax weight (over the sinks, the chosen blocks and the
    window) the question's rows (H, R, D) give each chosen block, summed over the rows, turned
    into the blocks its second pass and the reply hold (question.fixed_blocks), kept in the
    layer's table from the question's first position `start`. top: (H, k) chosen blocks in
    k_rot's order (after the sinks' blocks)."""
    s_rot = qg @ k_rot.swapaxes(-1, -2)
    s_win = qg @ k_win.swapaxes(-1, -2)
    m = mx.maximum(s_rot.max(axis=-1), s_win.max(axis=-1))[..., None]
    e = mx.exp(s_rot - m)
    w = e / (e.sum(axis=-1) + mx.exp(s_win - m).sum(axis=-1))[..., None]
    h, _, t = w.shape
    b = table.block_tokens
    k = top.shape[1]
    per_block = w.sum(axis=1).reshape(h, t // b, b).sum(axis=-1)[:, t // b - k:]
    mx.eval(per_block, top)
    fixed = question.fixed_blocks(np.array(per_block, dtype=np.float32), np.array(top), lo, hi)
    table.set_votes(None, start, fixed)


def select_blocks(store: Any, layer: int, qg: Any, n_pages: int, acc: _Partial,
                  start: int = -1, held: StepReads | None = None,
                  budget: int | None = None, recent_only: bool = False,
                  far: tuple[remap.RopeSpec, int, int] | None = None,
                  step_end: int | None = None, np_top: bool = False
                  ) -> tuple[Any, int, int] | None:
    """The blocks a sparse step over pages [0, n_pages) attends besides the sinks and the
    window (see `_sparse`): (top (H, k) block indices, sink pages, hi: the window's first
    page), or None when the budget holds every candidate (the step is then exact). The same
    summaries, votes and keys choose the same blocks whatever tier each page is in.
    `recent_only`: the k blocks just before the window, nothing scored. `far` (spec, E, S):
    candidates starting before position E are scored moved to E + S (FAR_ROTATE).
    `step_end`: a decode step's end; such a step right after the one that bounded (same
    pages and budget, starting where it ended) re-ranks that step's shortlist instead of
    bounding again, up to RESELECT_STEPS steps in all. `np_top`: top may be a numpy array
    (the numpy steps chose it), not converted to MLX."""
    table = store.tables[layer]
    P = store.P
    budget = store.settings.budget_tokens if budget is None else budget
    sink = min(table.sink_pages, n_pages)
    win = max(1, min(table.window_pages, int(budget * FIXED_SHARE) // P - sink))
    win = min(win, n_pages - sink)
    b = table.block_tokens
    nb = P // b
    k_sel = (budget - (sink + win) * P) // b
    lo, hi = sink, n_pages - win
    if (hi - lo) * nb <= k_sel or k_sel <= 0:
        return None
    if recent_only:
        recent = mx.arange(hi * nb - k_sel, hi * nb)
        return mx.broadcast_to(recent[None], (store.kv_heads, k_sel)), sink, hi
    if far is not None and lo * P >= far[1]:
        far = None  # every candidate within the trained reach
    _catch_up(store, layer, n_pages)
    if held is not None:
        # The step's sinks and window: a shortlist read for this step only takes them along
        # (`_step_pages`), so the attention after it finds every page in one read batch.
        # (as page ranges: most steps read nothing, and building the array cost 0.04 ms)
        held.also = (sink, hi, n_pages)
    fixed = _fixed(table, start)
    if fixed is not None:  # (their pages join a read for the step, as voted blocks do)
        _also_voted(held, np.where(fixed < 0, fixed[:, :1], fixed), nb)
    top: Any = _select(store, layer, qg, n_pages, acc, start, held, budget, far, step_end,
                       sink, hi, k_sel)
    if fixed is not None:
        top = _hold(fixed, np.asarray(top), sink * nb, hi * nb, k_sel)
    if isinstance(top, np.ndarray) and not np_top:
        top = mx.array(top.astype(np.int32))
    return top, sink, hi


def _select(store: Any, layer: int, qg: Any, n_pages: int, acc: _Partial, start: int,
            held: StepReads | None, budget: int,
            far: tuple[remap.RopeSpec, int, int] | None, step_end: int | None, sink: int,
            hi: int, k_sel: int) -> Any:
    """`select_blocks`' choice past its early returns: top (H, k_sel), numpy (the numpy
    steps, `_select_np`) or MLX."""
    if cpu_select.enabled(qg.shape[1]):
        return _select_np(store, layer, qg, n_pages, acc, start, held, budget, far, step_end,
                          sink, hi, k_sel)[0]
    table = store.tables[layer]
    nb = store.P // table.block_tokens
    lo = sink
    voted = _voted(table, lo, hi, nb, int(k_sel * VOTE_SHARE), start)
    _also_voted(held, voted, nb)
    k_step = k_sel - (0 if voted is None else voted.shape[1])
    score, cand = _shortlist(table, (n_pages, budget, False), start, step_end, lambda: _bounded(
        store, layer, qg, n_pages, acc, lo, hi, k_sel, voted, far))
    if k_step <= 0:
        assert voted is not None
        return voted
    if RESCORE > 1:
        top = _rescore(store, layer, qg, acc, score, k_step, cand, lo, n_pages, held, far,
                       far is not None and step_end is None, budget)
    else:
        top = mx.argpartition(-score, kth=k_step - 1, axis=-1)[:, :k_step]
        top = top + lo * nb if cand is None else mx.take_along_axis(cand, top, axis=-1)
    if voted is not None:
        top = mx.concatenate([voted.astype(top.dtype), top], axis=1)
    return top


def _also_voted(held: StepReads | None, voted: Any, nb: int) -> None:
    """The voted blocks (H, k) join what a step's shortlist read takes along (they are
    chosen without being rescored, so the rescoring does not read them): kept as given
    (an MLX array is not evaluated unless a read for the step happens)."""
    if held is not None and voted is not None and held.also is not None:
        held.voted = (voted, nb)


def _shortlist(table: Any, key: tuple[Any, ...], start: int, step_end: int | None,
               bound: Any) -> tuple[Any, Any]:
    """`bound()`'s (score, candidates), or the last step's when this decode step follows it
    with the same key (pages, budget, backend) and it has served fewer than RESELECT_STEPS
    steps; remembered for the next step (decode steps only)."""
    last = table.chosen
    if (step_end is not None and RESELECT_STEPS > 1 and last is not None and last[0] == key
            and last[1] == start and last[2] < RESELECT_STEPS):
        table.chosen = (key, step_end, last[2] + 1, last[3])
        return last[3]  # type: ignore[no-any-return]
    out = bound()
    table.chosen = None if step_end is None else (key, step_end, 1, out)
    return out  # type: ignore[no-any-return]


def _select_np(store: Any, layer: int, qg: Any, n_pages: int, acc: _Partial, start: int,
               held: StepReads | None, budget: int,
               far: tuple[remap.RopeSpec, int, int] | None, step_end: int | None, sink: int,
               hi: int, k_sel: int) -> tuple[np.ndarray, int, int]:
    """`select_blocks` past its early returns, in numpy (engine.kv.cpu_select): the same
    votes, bound, shortlist reuse and rescoring, one synchronisation (the query and its
    running max) instead of ~40 small MLX ops; top (H, k) as numpy integers. `held` gets
    the query and recent partial as numpy (`np_in`) for the step's attention, and `resident`
    when the compiled pass found every page in the RAM pool."""
    table = store.tables[layer]
    b = table.block_tokens
    nb = store.P // b
    lo = sink
    # One synchronisation for the query and the whole recent partial (attend_blocks reads
    # all three next): one each cost two more waits on MLX's stream a layer.
    mx.eval(qg, *_lazy(acc))
    q, m0 = cpu_select.to_np(qg), cpu_select.to_np(acc[0])
    if held is not None and acc[1] is not None and acc[2] is not None:
        held.np_in = (q, (m0, cpu_select.to_np(acc[1]), cpu_select.to_np(acc[2])))
    voted = cpu_select.voted(table.votes, table.votes_at, lo, hi, nb, int(k_sel * VOTE_SHARE),
                             start)
    _also_voted(held, voted, nb)
    k_step = k_sel - (0 if voted is None else voted.shape[1])
    pages = -(-k_sel * b // store.P)
    n_first = max(TWO_LEVEL_MIN_PAGES, TWO_LEVEL_FACTOR * pages)
    read_pages = max(2, READ_PAGES_FACTOR * RESCORE * pages)
    m = _shortlist_len(store, b, k_step, far is not None and step_end is None, budget)
    if k_step > 0 and RESCORE > 1 and step_end is not None and RESELECT_STEPS == 1:
        # A decode step that bounds afresh: bound, shortlist and rescoring in one compiled
        # pass where every page is in RAM (None otherwise: the steps below).
        top = cpu_select.choose(store, layer, q, m0, n_pages, lo, hi, n_first, read_pages,
                                voted, far, FAR_PAGE_RUN, k_step, m)
        if top is not None:
            table.chosen = None
            if held is not None:
                held.resident = True
            if voted is not None:
                top = np.concatenate([voted, top], axis=1)
            return top, sink, hi
    score, cand = _shortlist(table, (n_pages, budget, True), start, step_end,
                             lambda: cpu_select.bounded(
                                 table, q, m0, n_pages, lo, hi, n_first, read_pages, voted,
                                 far, FAR_PAGE_RUN))
    if k_step <= 0:
        assert voted is not None
        return voted, sink, hi
    if RESCORE > 1:
        def keys_of(at: np.ndarray) -> np.ndarray:
            k = cpu_select.resident_keys(store, layer, at) if table.all_resident(
                n_pages) else None
            return k if k is not None else cpu_select.to_np(
                _gather_keys(store, layer, mx.array(at), n_pages, held))

        def pool_of(at: np.ndarray) -> cpu_select.Pool | None:
            return cpu_select.resident_pool(store, layer, at) if table.all_resident(
                n_pages) else None

        top = cpu_select.rescore(q, m0, score, k_step, m, cand, lo, nb, b, far, keys_of,
                                 pool_of)
    else:
        top = np.argpartition(-score, k_step - 1, axis=-1)[:, :k_step]
        top = top + lo * nb if cand is None else np.take_along_axis(cand, top, axis=-1)
    if voted is not None:
        top = np.concatenate([voted, top], axis=1)
    return top, sink, hi


def _bounded(store: Any, layer: int, qg: Any, n_pages: int, acc: _Partial, lo: int, hi: int,
             k_sel: int, voted: Any, far: tuple[remap.RopeSpec, int, int] | None
             ) -> tuple[Any, Any]:
    """`select_blocks`' shortlist before the true logits: each candidate block's bound
    (H, n) with -inf for the voted blocks and those outside the pages a step reads, and the
    candidates' block indices (H, n), or None when they are every block of pages [lo, hi)."""
    table = store.tables[layer]
    P = store.P
    b = table.block_tokens
    nb = P // b
    h = qg.shape[0]
    bmin, bmax = table.block_summaries
    qt = qg.swapaxes(-1, -2)                                        # (H, D, R)
    c = hi - lo
    # Candidate blocks: every block of the candidate pages, or with many pages (two levels)
    # the blocks of the pages whose own bound ranks highest per head.
    n_first = max(TWO_LEVEL_MIN_PAGES, TWO_LEVEL_FACTOR * -(-k_sel * b // P))
    if c > 2 * n_first:
        pmin, pmax = table.kmin[lo:hi], table.kmax[lo:hi]          # (c, H, D)
        pscore = _score(pmin.transpose(1, 0, 2), pmax.transpose(1, 0, 2), qt, acc[0],
                        (mx.arange(lo, hi) * P)[None], far, FAR_PAGE_RUN)
        first = mx.argpartition(-pscore, kth=n_first - 1, axis=-1)[:, :n_first]  # (H, M)
        cand = (first[..., None] * nb + mx.arange(nb)).reshape(h, -1) + lo * nb  # (H, M*nb)
        score = _score(*_page_rows(table, first + lo), qt, acc[0], cand * b, far, nb)
        pages_of, n_cand = first, n_first                          # (H, M) pages - lo
    else:
        cand = None
        score = _score(bmin[:, lo * nb:hi * nb], bmax[:, lo * nb:hi * nb], qt, acc[0],
                       (mx.arange(lo * nb, hi * nb) * b)[None], far, nb)
        pages_of, n_cand = None, c
    ninf = mx.array(-mx.inf, score.dtype)
    if voted is not None:
        # The voted blocks are chosen already: the step chooses among the others.
        mask = mx.put_along_axis(mx.zeros((h, n_pages * nb), mx.bool_), voted,
                                 mx.ones(voted.shape, mx.bool_), axis=1)
        taken = mask[:, lo * nb:hi * nb] if cand is None else mx.take_along_axis(mask, cand,
                                                                                   axis=1)
        score = mx.where(taken, ninf, score)
    m = max(2, READ_PAGES_FACTOR * RESCORE * -(-k_sel * b // P))
    if m < c:
        # A step reads about what its shortlist holds rather than one page per block (the
        # pages on the SSD are read whole), on both tiers alike.
        per_page = score.reshape(h, n_cand, nb).max(axis=-1)        # (H, n_cand)
        if pages_of is None:
            best = per_page.max(axis=0)                             # (c,)
        else:
            best = mx.full((c,), -mx.inf, per_page.dtype).at[pages_of.reshape(-1)].maximum(
                per_page.reshape(-1))
        keep = mx.argpartition(-best, kth=m - 1)[:m]
        chosen = mx.put_along_axis(mx.zeros((c,), mx.bool_), keep,
                                   mx.ones(keep.shape, mx.bool_), axis=0)
        ok = chosen[None] if pages_of is None else chosen[pages_of]  # (1 or H, n_cand)
        score = mx.where(ok[..., None], score.reshape(h, n_cand, nb),
                         ninf).reshape(h, n_cand * nb)
    return score, cand


def _step_pages(store: Any, layer: int, uniq: np.ndarray, held: StepReads | None
                ) -> tuple[Any, Any, np.ndarray]:
    """Decoded keys and values (n, H, P, D) of the distinct pages `uniq` for this step only,
    and row (page -> its row): the pages in `held` (read by the rescoring this step) are
    taken from there, the others read once (`stream`: resident ones from RAM, cold ones
    verified off the SSD, not kept in RAM unless a slot is free). What was read is added to
    `held`, so a later read in the same step finds it."""
    table = store.tables[layer]
    row = np.full(table.n_pages, -1, np.int64)
    ks: list[Any] = []
    vs: list[Any] = []
    n = 0
    ranges, voted = None, None
    if held is not None:
        if held.k is not None:
            have = held.pages
            assert have is not None and held.row is not None
            row[have] = held.row[have]
            ks.append(held.k)
            vs.append(held.v)
            n = held.k.shape[0]
        ranges, voted, held.also, held.voted = held.also, held.voted, None, None
    need = uniq[row[uniq] < 0]
    also = None
    if ranges is not None:  # the sinks [0, ranges[0]), the window [ranges[1], ranges[2])
        also = np.concatenate([np.arange(ranges[0]), np.arange(ranges[1], ranges[2])])
    if also is not None and len(need):
        # Pages the step reads next (`select_blocks`: sinks, window, voted blocks): one batch
        # now spares a second read and the copy of this one that joining them took (~6 ms a
        # layer at 128k).
        if voted is not None:
            also = np.union1d(also, np.unique(np.asarray(voted[0]) // voted[1]))
        need = np.union1d(need, also[row[also] < 0])
    if len(need):
        res = table.resident(need)
        # `stream` gives a group's resident pages first, then the cold ones.
        row[need[np.concatenate([np.flatnonzero(res), np.flatnonzero(~res)])]] = n + np.arange(
            len(need))
        ku, vu = next(iter(store.stream(layer, need, len(need))))
        ks.append(ku)
        vs.append(vu)
    k = ks[0] if len(ks) == 1 else mx.concatenate(ks)
    v = vs[0] if len(vs) == 1 else mx.concatenate(vs)
    if held is not None:
        held.pages, held.row, held.k, held.v = np.flatnonzero(row >= 0), row, k, v
    return k, v, row


def _gather_keys(store: Any, layer: int, at: Any, n_pages: int,
                 held: StepReads | None = None) -> Any:
    """Decoded keys (H, m, b, D) of the blocks `at` (H, m) per head, from whichever tier holds
    their pages: gathered from the RAM tier, cold pages read through the store's verified
    path first (kept in RAM when it holds them, else read for this step only)."""
    table = store.tables[layer]
    h, _ = at.shape
    b = table.block_tokens
    nb = store.P // b
    page, blk = at // nb, at % nb
    heads = mx.arange(h)[:, None]
    if table.all_resident(n_pages):
        slots = page if table.identity else mx.array(table.slot_of[:n_pages])[page]
    else:
        page_np = np.array(page)
        uniq = np.unique(page_np)
        if store.ensure_resident(layer, uniq) is None:
            # Read for this step only, keys and values together (a record's CRC covers
            # both): kept in `held`, the step's attention reads its chosen blocks from there.
            ku, _, row = _step_pages(store, layer, uniq, held)
            pos = mx.array(row[page_np])
            return ku.reshape(*ku.shape[:2], nb, b, ku.shape[-1])[pos, heads, blk]
        slots = mx.array(table.slot_of[page_np])
    return store.codec.decode(tuple(a.reshape(*a.shape[:2], nb, b, a.shape[-1])[slots, heads, blk]
                                    for a in store.pool_k[layer]))


def _shortlist_len(store: Any, b: int, k_sel: int, question: bool,
                   budget: int | None = None) -> int:
    """How many blocks the bound shortlists for their true logits when k_sel are chosen:
    RESCORE x k_sel, within RESCORE_CAP x the budget (the one in effect; None: the
    settings') unless this is the question past the trained length (`question`: a chunk
    choosing with the far scoring)."""
    m = RESCORE * k_sel
    if RESCORE_CAP > 0 and not question:
        budget = store.settings.budget_tokens if budget is None else budget
        m = min(m, max(k_sel, int(RESCORE_CAP * budget) // b))
    return m


def _rescore(store: Any, layer: int, qg: Any, acc: _Partial, score: Any, k_sel: int,
             cand: Any, lo: int, n_pages: int, held: StepReads | None = None,
             far: tuple[remap.RopeSpec, int, int] | None = None,
             question: bool = False, budget: int | None = None) -> Any:
    """The k_sel blocks (H, k_sel) among `score`'s candidates (the blocks of pages lo.., or
    with two levels the blocks `cand` names per head) chosen by their true largest logit: the
    RESCORE * k_sel best by bound are read (keys only, from either tier) and ranked by max
    q.k against each query head's recent max, summed over the group as the bound is; a
    candidate the bound ruled out (-inf: voted, or outside the pages kept) stays out.
    The box bound of 8 keys in 64 dimensions is loose on natural text: at 4k tokens and a
    768 budget it missed a fact that true logits find (docs/benchmarks.md, issue 19); the
    bound still prunes, so a step reads RESCORE x the chosen blocks' keys, not all keys.
    `far`: blocks past the trained reach are scored moved, as `_score` bounds them.
    `question`: the shortlist is not capped (`_shortlist_len`)."""
    h, r, d = qg.shape
    b = store.tables[layer].block_tokens
    nb = store.P // b
    m = min(_shortlist_len(store, b, k_sel, question, budget), score.shape[1])
    pre = mx.argpartition(-score, kth=m - 1, axis=-1)[:, :m]             # (H, m) candidates
    at = pre + lo * nb if cand is None else mx.take_along_axis(cand, pre, axis=-1)
    k = _gather_keys(store, layer, at, n_pages, held)                    # (H, m, b, D)
    if far is not None and r > b:  # more rows than keys: the keys turned instead (as
        # cpu_select.rescore; the rows turned per block were (H, m, R, D), ~190 MB a layer)
        k = remap.rerotate(k, _far_shift(at * b, far), far[0])
        far = None
    if far is None:
        s = (qg @ k.reshape(h, m * b, d).swapaxes(-1, -2)).reshape(h, r, m, b).max(axis=-1)
    else:  # the query rotated back per block: fewer rows than the keys (1.6 -> 0.9 ms)
        qr = remap.rerotate(qg[:, None], -_far_shift(at * b, far), far[0])  # (H, m, R, D)
        s = (qr @ k.swapaxes(-1, -2)).max(axis=-1).swapaxes(1, 2)          # (H, R, m)
    true = mx.logsumexp(s - acc[0][:, :, None], axis=1)                  # (H, m)
    out = mx.take_along_axis(score, pre, axis=-1) == -mx.inf
    true = mx.where(out, mx.array(-mx.inf, true.dtype), true)
    pick = mx.argpartition(-true, kth=k_sel - 1, axis=-1)[:, :k_sel]
    return mx.take_along_axis(at, pick, axis=-1)


# -- the hook -----------------------------------------------------------------------------
def _make_hook(original: Any) -> Any:
    def scaled_dot_product_attention(queries: Any, keys: Any, values: Any, cache: Any = None,
                                     scale: float = 1.0, mask: Any = None, sinks: Any = None,
                                     **kw: Any) -> Any:
        if isinstance(cache, PagedLayerCache):
            return attend(cache, queries, keys, values, scale, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                        sinks=sinks, **kw)

    scaled_dot_product_attention._strata_original = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def install_hook(model: Any) -> list[str]:
    """Patch scaled_dot_product_attention in every module defining the model's layers.

    Idempotent; other caches fall through to mlx-lm's own function. Returns modules patched.
    """
    names = {type(m).__module__ for m in model.modules()}
    patched = []
    for name in sorted(names):
        mod = sys.modules.get(name)
        fn = getattr(mod, "scaled_dot_product_attention", None)
        if fn is None or hasattr(fn, "_strata_original"):
            continue
        setattr(mod, "scaled_dot_product_attention", _make_hook(fn))  # noqa: B010
        patched.append(name)
    return patched

"""Sparse selection in numpy, for MLX's CPU backend.

Contract: `bounded`, `rescore` and `voted` compute what engine.kv.attention's `_bounded`,
`_rescore` and `_voted` compute (the same bound, the same shortlist, the same true logits,
the same choice up to float32 rounding and the order of ties), `choose` what `bounded` then
`rescore` choose, and `attend_blocks` what `_sparse` attends after choosing (those two None
where they cannot: pages not all in RAM as float32, or no compiled loops for `choose`),
on numpy arrays: queries (H, R, D) and running maxima (H, R) in float32, the layer's
summaries and votes viewed without a copy, block indices as int64. `enabled(rows)` says
whether attention takes this path: decode steps on the CPU, unless STRATA_NP_SELECT=0.
`chunk_attention` is a prompt chunk's causal attention over keys in RAM (`chunk_enabled`).
Importing this module holds numpy's bundled OpenBLAS to one thread (engine.platform).

Why: a sparse decode step's selection and attention are ~60 MLX ops on arrays of 10^3 to
10^5 elements, and on MLX's CPU backend each costs 0.05-0.8 ms whatever its size (selection
alone 4.6 ms a layer at 32k, budget 2,048; docs/benchmarks.md). numpy does the same
arithmetic in a fraction of that; the price is one synchronisation a layer (the query and
its running max are evaluated). On a GPU the ops stay in MLX, where they are cheap and a
sync is not.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from engine import platform
from engine.kv import cpu_kernels, cpu_native, remap

# numpy's bundled OpenBLAS at one thread from here on: its spinning workers took the cores
# MLX and the page reads needed (here, not when the engine loads: `strata --help` and the
# engine's import stay free of numpy).
platform.numpy_blas_one_thread()

NP_SELECT = (os.environ.get("STRATA_NP_SELECT") or "1") != "0"
NP_DENSE = (os.environ.get("STRATA_NP_DENSE") or "1") != "0"
# A prompt chunk's attention over keys in RAM: MLX's fused attention on the CPU spends most
# of its time in its exp (about 0.1G elements/s here, numpy's 3.7G): a 512-token chunk over
# 4,096 keys took 232 ms a layer, and a 4,096-token prompt 37.7 s to its first token, most of
# it there (docs/benchmarks.md, prefill attention). Past this many logits a KV head, numpy.
NP_CHUNK = (os.environ.get("STRATA_NP_CHUNK") or "1") != "0"
CHUNK_MIN_LOGITS = 1 << 14
# A piece's logits at most this many floats (16 MB): at 16k keys, 85 rows a piece ran 10%
# faster than 192, and at 128k keys 192 rows would hold 300 MB a thread.
CHUNK_PIECE_LOGITS = 1 << 22
# Query rows (the group's query heads x the step's tokens) up to which a step selects here:
# decode steps, the question after 128k stored tokens (~120 rows) and the 64-token chunks of
# a sparse prefill past 16k (192 rows for the starter). Both of those ran faster here than in
# MLX once numpy's BLAS kept to one thread and only the rows looked at were converted (a
# 24k chunk 1.15x, docs/benchmarks.md). The 512-token chunks below 16k select nothing: they
# attend whole (`chunk_attention`).
MAX_ROWS = 256

Far = tuple[remap.RopeSpec, int, int]  # (spec, E, S): see attention._far_shift
Partial = tuple[np.ndarray, np.ndarray, np.ndarray]  # softmax max, sum, output
Pool = tuple[np.ndarray, np.ndarray, np.ndarray]  # RAM pool, each block's slot, block in it
NINF = np.float32(-np.inf)


def enabled(rows: int = 1) -> bool:
    """Whether a sparse step with `rows` query rows per KV head selects here (numpy) rather
    than in MLX ops."""
    return NP_SELECT and rows <= MAX_ROWS and mx.default_device() == mx.cpu


def dense_enabled(keys: int, rows: int, dtype: Any, least: int | None = None) -> bool:
    """Whether an exact decode step (`rows` query rows a KV head, at most MAX_DENSE_ROWS) over
    `keys` keys of `dtype` attends here (`dense_partial`) rather than through MLX: on the
    CPU, float32, at least `least` keys (DENSE_MIN_KEYS; CONTIG_DENSE_MIN_KEYS where MLX's
    alternative is one fused call), unless STRATA_NP_DENSE=0."""
    least = DENSE_MIN_KEYS if least is None else least
    return (NP_DENSE and rows <= MAX_DENSE_ROWS and keys >= least
            and dtype == mx.float32 and mx.default_device() == mx.cpu)


def chunk_enabled(rows: int, keys: int, *dtypes: Any) -> bool:
    """Whether a prompt chunk's attention (`rows` query rows a KV head over `keys` keys; the
    queries' and the keys' `dtypes`) runs here (`chunk_attention`) rather than in MLX's
    fused attention: on the CPU, float32, at least CHUNK_MIN_LOGITS logits a head, unless
    STRATA_NP_CHUNK=0."""
    return (NP_CHUNK and rows * keys >= CHUNK_MIN_LOGITS
            and all(d == mx.float32 for d in dtypes) and mx.default_device() == mx.cpu)


def to_np(a: Any) -> np.ndarray:
    """A float32 (or integer) numpy array of MLX array `a`, evaluated; no copy when `a` is
    float32 and contiguous already (a numpy array as it is)."""
    if isinstance(a, np.ndarray):
        return a
    if a.dtype in (mx.float16, mx.bfloat16):
        a = a.astype(mx.float32)
    return np.asarray(a)


THREADS = cpu_kernels.THREADS  # the larger numpy work's threads, the loops' pool
_threads = cpu_kernels.threads


# A chunk's bound, rescoring or softmax partial of at least this many multiply-adds is
# computed a piece at a time on the THREADS threads (`cpu_kernels.share`; numpy's BLAS keeps
# to one thread, see above): the products, and the passes after them over each piece while
# it is in the cache. A decode step's stay whole.
SPLIT_MACS = 1 << 23


def _in_pieces(n: int, macs: int, part: Callable[[int, int], None]) -> None:
    """part(a, b) over [0, n): whole under SPLIT_MACS multiply-adds or on one thread, else
    a piece at a time on the threads (`cpu_kernels.share`)."""
    if THREADS < 2 or macs < SPLIT_MACS:
        part(0, n)
    else:
        cpu_kernels.share(n, part)


def lse(x: np.ndarray, axis: int) -> np.ndarray:
    """log(sum(exp(x))) along `axis`; -inf where every element is -inf (as mx.logsumexp)."""
    m = x.max(axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, np.float32(0))
    with np.errstate(divide="ignore"):
        return (np.log(np.exp(x - m).sum(axis=axis, keepdims=True)) + m).squeeze(axis)


def far_shift(starts: np.ndarray, far: Far) -> np.ndarray:
    """attention._far_shift: E + S - start for candidates starting before E, else 0."""
    _, e, s = far
    starts = starts.astype(np.int64)
    return np.where(starts < e, e + s - starts, 0)


def score(bmin: np.ndarray, bmax: np.ndarray, qt: np.ndarray, m: np.ndarray,
          starts: np.ndarray | None = None, far: Far | None = None,
          group: int = 1, rows: np.ndarray | None = None) -> np.ndarray:
    """attention._score: per KV head and candidate (H, n), the logsumexp over query rows of
    the bound on q.k minus the row's running max. bmin, bmax (H, n, D) float32, or with
    `rows` (H, M) pools (X, per, D) whose rows[h] are head h's candidates, per each; qt
    (H, D, R); m (H, R); with `far`, runs of `group` candidates starting before E bounded by
    the query rotated back by the run's first start's shift."""
    if far is None:
        return _plain_score(bmin, bmax, qt, m, rows)
    assert starts is not None
    fused = cpu_kernels.far_bound(bmin, bmax, qt.swapaxes(-1, -2), m, starts, far, group,
                                  remap._split_tables(far[0]), remap.SPLIT, rows)
    if fused is not None:  # one compiled loop, where it is here
        return fused
    if rows is not None:
        h, d = rows.shape[0], bmax.shape[-1]
        bmin, bmax = (a[rows].reshape(h, -1, d) for a in (bmin, bmax))
    h, d, r = qt.shape
    n = bmax.shape[1]
    g = -(-n // group)
    if g * group > n:  # a last, partial run: zero rows, cut off below
        bmax, bmin = (np.concatenate([a, np.zeros((h, g * group - n, d), a.dtype)], 1)
                      for a in (bmax, bmin))
    q = remap.rerotate(qt.swapaxes(-1, -2)[:, None],
                       -far_shift(starts[:, ::group], far), far[0])  # (H, g, R, D)
    q = np.broadcast_to(q, (h, g, r, d))
    if group == 1:
        bound = (np.maximum(q, 0) * bmax[:, :, None] +
                 np.minimum(q, 0) * bmin[:, :, None]).sum(axis=-1)
    else:
        q = q.swapaxes(-1, -2)                                              # (H, g, D, R)
        bound = (bmax.reshape(h, g, group, d) @ np.maximum(q, 0) +
                 bmin.reshape(h, g, group, d) @ np.minimum(q, 0)).reshape(h, -1, r)[:, :n]
    return lse(bound - m[:, None, :], axis=-1)


def _plain_score(bmin: np.ndarray, bmax: np.ndarray, qt: np.ndarray, m: np.ndarray,
                 rows: np.ndarray | None) -> np.ndarray:
    """`score` without `far`: the bound's two products and the logsumexp over the rows, a
    piece of the candidates at a time, on the threads once the products pass SPLIT_MACS
    (a question's 141 query rows over 1,400 candidates: its lse on one thread cost as much
    as the products on two, and each piece's bound stays in the cache for it)."""
    h, d, r = qt.shape
    per = 1 if rows is None else bmax.shape[1]
    c = bmax.shape[1] if rows is None else rows.shape[1]     # candidates, or pool rows
    out = np.empty((h, c * per), np.float32)
    qp, qn = np.maximum(qt, 0), np.minimum(qt, 0)

    def part(a: int, b: int) -> None:
        if rows is None:
            lo_, hi_ = bmin[:, a:b], bmax[:, a:b]
        else:
            lo_, hi_ = (x[rows[:, a:b]].reshape(h, -1, d) for x in (bmin, bmax))
        x = np.matmul(hi_, qp)                                              # (H, n, R)
        x += np.matmul(lo_, qn)
        x -= m[:, None, :]
        out[:, a * per:b * per] = lse(x, axis=-1)

    _in_pieces(c, h * c * per * r * d, part)
    return out


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32, copy=False)


def page_rows(table: Any, bmin: np.ndarray, bmax: np.ndarray, pages: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The block summaries of pages (H, M) per head, from bmin, bmax (H, block_pages * nb, D)
    float16, as float32 pools (X, nb, D) and each (head, page)'s row in them (H, M). Each
    (head, page) is converted once and kept in `table.np_rows` (`row_cache`): float16 to
    float32 ran at ~0.5G values/s, 1.4 ms of a 32k decode step's layer, and a step's
    first-level pages are mostly the last step's. Only pages looked at take memory."""
    h, _, d = bmin.shape
    nb = bmin.shape[1] // table.block_pages
    heads = np.arange(h)[:, None]
    need = row_cache(table, h, nb, d)[0][heads, pages] < 0
    st = row_cache(table, h, nb, d, int(need.sum()))
    row_of = st[0]
    if need.any():
        hh, mm = np.nonzero(need)
        pp = pages[hh, mm]
        used, k = st[1], len(hh)
        st[2][used:used + k] = bmin.reshape(h, -1, nb * d)[hh, pp]
        st[3][used:used + k] = bmax.reshape(h, -1, nb * d)[hh, pp]
        row_of[hh, pp] = np.arange(used, used + k)
        st[1] = used + k
    return st[2].reshape(-1, nb, d), st[3].reshape(-1, nb, d), row_of[heads, pages]


def row_cache(table: Any, h: int, nb: int, d: int, more: int = 0) -> list[Any]:
    """table.np_rows, made or grown to hold a row for every page and `more` rows beyond those
    in use: [row of each (head, page) or -1 (H, N) int64, rows in use, the rows converted,
    min and max (X, nb D) float32]."""
    n = table.block_pages
    st = table.np_rows
    if st is None:
        st = [np.full((h, n), -1, np.int64), 0, np.empty((64, nb * d), np.float32),
              np.empty((64, nb * d), np.float32)]
        table.np_rows = st
    if st[0].shape[1] < n:
        st[0] = np.concatenate([st[0], np.full((h, 2 * n - st[0].shape[1]), -1, np.int64)], 1)
    used = st[1]
    if used + more > len(st[2]):
        size = max(used + more, 2 * len(st[2]))
        for i in (2, 3):
            grown = np.empty((size, nb * d), np.float32)
            grown[:used] = st[i][:used]
            st[i] = grown
    return st  # type: ignore[no-any-return]


def voted(votes: Any, votes_at: int, lo: int, hi: int, nb: int, k_vote: int,
          start: int) -> np.ndarray | None:
    """attention._voted: the k_vote best-voted blocks (H, k_vote) among pages [lo, hi)."""
    if k_vote <= 0 or votes is None or votes_at > start:
        return None
    v = to_np(votes)
    n = min(v.shape[1], hi * nb) - lo * nb
    if n <= k_vote:
        return None
    pick = np.argpartition(-v[:, lo * nb:lo * nb + n], k_vote - 1, axis=-1)
    return pick[:, :k_vote] + lo * nb


def page_pools(table: Any) -> tuple[np.ndarray, np.ndarray]:
    """The page summaries (N, H, D) read in place as pools of one row (N H, 1, D): head h's
    page i is row i H + h (a head-major copy of the candidates took 0.15 ms a layer at 32k)."""
    pmin, pmax = (_f32(np.asarray(a)).reshape(-1, 1, a.shape[-1])
                  for a in (table.kmin, table.kmax))
    return pmin, pmax


def first_pages(table: Any, q: np.ndarray, m0: np.ndarray, lo: int, hi: int, n_first: int,
                far: Far | None, page_run: int) -> np.ndarray | None:
    """The first level of `bounded`: per head, the n_first pages (H, n_first), as offsets
    from lo, whose own bound ranks highest among pages [lo, hi); None (one level: every
    page's blocks are candidates) unless there are more than 2 n_first pages."""
    if hi - lo <= 2 * n_first:
        return None
    h = q.shape[0]
    pmin, pmax = page_pools(table)
    prow = np.arange(lo, hi)[None] * h + np.arange(h)[:, None]             # (H, c)
    pscore = score(pmin, pmax, q.swapaxes(-1, -2), m0, (np.arange(lo, hi) * table.page_tokens)[
        None], far, page_run, prow)
    return np.argpartition(-pscore, n_first - 1, axis=-1)[:, :n_first]


def choose(store: Any, layer: int, q: np.ndarray, m0: np.ndarray, n_pages: int, lo: int,
           hi: int, n_first: int, read_pages: int, voted: np.ndarray | None,
           far: Far | None, page_run: int, k: int, m: int) -> np.ndarray | None:
    """`bounded` then `rescore` (shortlist m, keep k a head) as one compiled pass
    (cpu_kernels.choose): the blocks (H, k) they choose, up to the order of ties. None unless
    every page is in the RAM tier as plain float32 and the loops run here (the caller then
    takes those two). Why: around their loops the two ran ~30 numpy calls of 20-90 us each
    on these machines, ~1.5 ms of a 32k decode step's layer."""
    table = store.tables[layer]
    pk = plain_pool(store, layer)
    if pk is None or not table.all_resident(n_pages):
        return None
    b = table.block_tokens
    nb = table.page_tokens // b
    pmin, pmax = page_pools(table)
    bmin, bmax = (np.asarray(a) for a in table.block_summaries)
    return cpu_kernels.choose(
        pmin, pmax, bmin, bmax, q, m0, lo, hi - lo, n_first, page_run, nb, b, far,
        None if far is None else remap._split_tables(far[0]), remap.SPLIT, voted, read_pages,
        m, k, pk, None if table.identity else table.slot_of)


def bounded(table: Any, q: np.ndarray, m0: np.ndarray, n_pages: int, lo: int, hi: int,
            n_first: int, read_pages: int, voted_blocks: np.ndarray | None, far: Far | None,
            page_run: int) -> tuple[np.ndarray, np.ndarray | None]:
    """attention._bounded on numpy arrays: (bound (H, n) with -inf for the voted blocks and
    those outside the `read_pages` best pages, candidates (H, n) or None for every block of
    pages [lo, hi)). Two levels (pages first, then the blocks of the n_first best pages a
    head) when there are more than 2 n_first candidate pages."""
    P = table.page_tokens
    b = table.block_tokens
    nb = P // b
    h = q.shape[0]
    qt = q.swapaxes(-1, -2)                                                 # (H, D, R)
    c = hi - lo
    bmin, bmax = (np.asarray(a) for a in table.block_summaries)           # (H, N nb, D)
    pages_of: np.ndarray | None
    first = first_pages(table, q, m0, lo, hi, n_first, far, page_run)
    if first is not None:
        cand: np.ndarray | None = (first[..., None] * nb + np.arange(nb)).reshape(h, -1) \
            + lo * nb
        pool_min, pool_max, rows = page_rows(table, bmin, bmax, first + lo)
        assert cand is not None
        sc = score(pool_min, pool_max, qt, m0, cand * b, far, nb, rows)
        pages_of, n_cand = first, n_first
    else:
        cand = None
        sc = score(_f32(bmin[:, lo * nb:hi * nb]), _f32(bmax[:, lo * nb:hi * nb]), qt, m0,
                   (np.arange(lo * nb, hi * nb) * b)[None], far, nb)
        pages_of, n_cand = None, c
    if voted_blocks is not None:
        mask = np.zeros((h, n_pages * nb), np.bool_)
        np.put_along_axis(mask, voted_blocks, True, axis=1)
        taken = mask[:, lo * nb:hi * nb] if cand is None else np.take_along_axis(mask, cand,
                                                                                  axis=1)
        sc = np.where(taken, NINF, sc)
    if read_pages < c:
        per_page = sc.reshape(h, n_cand, nb).max(axis=-1)                  # (H, n_cand)
        if pages_of is None:
            best = per_page.max(axis=0)                                     # (c,)
        else:
            best = np.full((c,), NINF, per_page.dtype)
            np.maximum.at(best, pages_of.reshape(-1), per_page.reshape(-1))
        keep = np.argpartition(-best, read_pages - 1)[:read_pages]
        chosen = np.zeros((c,), np.bool_)
        chosen[keep] = True
        ok = chosen[None] if pages_of is None else chosen[pages_of]        # (1 or H, n_cand)
        sc = np.where(ok[..., None], sc.reshape(h, n_cand, nb), NINF).reshape(h, n_cand * nb)
    return sc, cand


def rescore(q: np.ndarray, m0: np.ndarray, sc: np.ndarray, k_sel: int, m: int,
            cand: np.ndarray | None, lo: int, nb: int, b: int, far: Far | None,
            keys_of: Callable[[np.ndarray], np.ndarray],
            pool_of: Callable[[np.ndarray], Pool | None] | None = None) -> np.ndarray:
    """attention._rescore on numpy arrays: of the m best candidates by bound, the k_sel
    (H, k_sel) with the largest true logit against each query row's running max, summed over
    the group; keys_of(at) gives the float32 keys (H, m, b, D) of blocks `at` (H, m), pool_of(at)
    where they are in the RAM tier (`resident_pool`), if it knows: with `far`, the compiled
    loop then reads them in place (a decode step's few rows; past b rows the keys are turned
    instead, as many rows turned per block cost more than the keys)."""
    h, r, d = q.shape
    m = min(m, sc.shape[1])
    pre = np.argpartition(-sc, m - 1, axis=-1)[:, :m]                      # (H, m)
    at = pre + lo * nb if cand is None else np.take_along_axis(cand, pre, axis=-1)
    k = None
    true = None
    if far is not None and r > b:
        # More query rows than a block has keys (the question past the trained length, 144
        # rows): each block's keys turned forward by its shift instead of the rows back
        # (the same logits, RoPE being a rotation), then one matmul a piece: the loop
        # turned and dotted 144 rows a block, 1.2 s of a question after 128k stored tokens.
        k = keys_of(at)                                                     # (H, m, b, D)
        true = _true_logits(q, remap.rerotate(k, far_shift(at * b, far), far[0]), m0)
    elif far is not None:  # one compiled loop, where it is here
        src = pool_of(at) if pool_of is not None else None
        true = cpu_kernels.far_rescore(q, src if src is not None else (k := keys_of(at)), at,
                                       b, m0, far, remap._split_tables(far[0]), remap.SPLIT)
    if true is None:
        k = keys_of(at) if k is None else k                                 # (H, m, b, D)
        if far is None:
            true = _true_logits(q, k, m0)
        else:  # the query rotated back per block: fewer rows than the keys
            qr = remap.rerotate(q[:, None], -far_shift(at * b, far), far[0])  # (H, m, R, D)
            s = (qr @ k.swapaxes(-1, -2)).max(axis=-1).swapaxes(1, 2)       # (H, R, m)
            true = lse(s - m0[:, :, None], axis=1)                          # (H, m)
    out = np.take_along_axis(sc, pre, axis=-1) == NINF
    true = np.where(out, NINF, true)
    pick = np.argpartition(-true, k_sel - 1, axis=-1)[:, :k_sel]
    return np.take_along_axis(at, pick, axis=-1)


def _true_logits(q: np.ndarray, k: np.ndarray, m0: np.ndarray) -> np.ndarray:
    """`rescore`'s true logits without `far`: per head and block (H, m), the logsumexp over
    the rows of q (H, R, D) of the block's largest q.k (keys k (H, m, b, D)) minus the row's
    running max m0 (H, R); a piece of the blocks at a time, on the threads past SPLIT_MACS
    (as `_plain_score`)."""
    h, r, d = q.shape
    m, b = k.shape[1], k.shape[2]
    out = np.empty((h, m), np.float32)

    def part(lo: int, hi: int) -> None:
        s = np.matmul(q, k[:, lo:hi].reshape(h, (hi - lo) * b, d).swapaxes(-1, -2))
        # Each block's max as b strided maxima: numpy's max over a last axis of b (8) runs
        # a reduction per block, several times slower.
        y = s[..., 0::b].copy()                                             # (H, R, n)
        for i in range(1, b):
            np.maximum(y, s[..., i::b], out=y)
        y -= m0[:, :, None]
        out[:, lo:hi] = lse(y, axis=1)

    _in_pieces(m, h * m * b * r * d, part)
    return out


def softmax_stats(s: np.ndarray, v: np.ndarray) -> Partial:
    """The softmax partial (row max (H, R), row sum of exp (H, R), exp @ v (H, R, Dv)) of
    logits s (H, R, T) over values v (H, T, Dv), float32; `s` is overwritten. A piece of the
    rows at a time, on the threads past SPLIT_MACS: a question's 141 rows over ~2,000
    chosen keys took 13 ms a layer on one thread, its exp @ v 8 of them."""
    h, r, t = s.shape
    m = np.empty((h, r), np.float32)
    total = np.empty((h, r), np.float32)
    out = np.empty((h, r, v.shape[-1]), np.float32)

    def part(lo: int, hi: int) -> None:
        x = s[:, lo:hi]
        mx_ = x.max(axis=-1)
        x -= mx_[..., None]
        np.exp(x, out=x)
        m[:, lo:hi] = mx_
        total[:, lo:hi] = x.sum(axis=-1)
        np.matmul(x, v, out=out[:, lo:hi])

    _in_pieces(r, h * r * t * v.shape[-1], part)
    return m, total, out


# Dense decode attention (`dense_partial`): at least this many keys, split over THREADS
# threads. MLX's fused attention on the CPU read 16k keys in 7.7-10.6 ms a layer, numpy on
# two threads in 2.5-3.4 ms, the compiled loop (cpu_kernels.dense_pages, each key and value
# read once) on two threads in ~1.6 (docs/benchmarks.md). A starter decode step took 50.0 ->
# 46 ms at 512 keys this way, 53.9 -> 44.8 at 1,024, the same at 300, 1 ms more at 160 (the
# synchronisation costs what it saves): from 384.
DENSE_MIN_KEYS = 384
# Over a layer's contiguous buffer (attention.attend's `contig`: MLX's alternative is one fused
# call, no wait on MLX a layer) from more keys: once decode steps' products read packed codes
# (engine.runtime.packed) the per-layer wait cost more than numpy saved below ~1,000 keys
# (`strata bench quick --kv-modes exact`, STRATA_NP_DENSE=1 against 0, 2026-12-07: 46.9
# against 51.6 tok/s at depth 512, 41.5 against 43.7 at 1,024, 38.7/37.4 against 35.5/33.7
# at 2,048, 30.8 against 24.1-25.8 at 4,096).
CONTIG_DENSE_MIN_KEYS = 1024
MAX_DENSE_ROWS = 32  # decode steps: a group of up to 8 query heads, up to 4 tokens


def _pages_part(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> Partial:
    s = np.matmul(q[None], k.swapaxes(-1, -2))                         # (n, H, R, P)
    m = s.max(axis=(0, 3))
    s -= m[None, :, :, None]
    np.exp(s, out=s)
    return m, s.sum(axis=(0, 3)), np.matmul(s, v).sum(axis=0)


def _flat_part(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None
               ) -> Partial:
    s = q @ k.swapaxes(-1, -2)                                          # (H, R, T)
    if mask is not None:
        s[:, :, s.shape[-1] - mask.shape[-1]:][:, mask] = NINF
    m = s.max(axis=-1)
    s -= m[..., None]
    np.exp(s, out=s)
    return m, s.sum(axis=-1), s @ v


def recent_partial(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal_rows: int) -> Partial:
    """The softmax partial of a decode step's queries q (H, R, D) (scaled) over the recent
    keys k, v (H, T, D) whose last `causal_rows` are the step's own tokens (rows rep-major:
    causal among those), on this thread (a few hundred keys: the threads' handoff would
    cost more)."""
    mask = None
    if causal_rows > 1:
        t = causal_rows
        mask = np.tile(np.triu(np.ones((t, t), np.bool_), 1), (q.shape[1] // t, 1))
    return _flat_part(q, k, v, mask)


def merge(parts: list[Partial]) -> Partial:
    """Softmax partials (max, sum, output) over disjoint keys, joined into one."""
    m = parts[0][0]
    for p in parts[1:]:
        m = np.maximum(m, p[0])
    total, out = None, None
    for p in parts:
        c = np.exp(p[0] - m)
        total = p[1] * c if total is None else total + p[1] * c
        out = p[2] * c[..., None] if out is None else out + p[2] * c[..., None]
    assert total is not None and out is not None
    return m, total, out


def dense_partial(q: np.ndarray, k: np.ndarray, v: np.ndarray, pages: bool,
                  causal_rows: int = 1) -> Partial:
    """The softmax partial (max (H, R), sum (H, R), output (H, R, Dv)) of queries q (H, R, D)
    (scaled) over every key: pages k, v (n, H, P, D) when `pages`, else per-head keys (H, T,
    D) whose last `causal_rows` are the queries' own tokens (rows rep-major, as `attend`
    reshapes them: causal among those). Pages go to attend.c on THREADS threads of its own
    (cpu_native) where it takes them, else are shared over the threads in pieces
    (cpu_kernels.share); per-head keys are cut into THREADS ranges; the partials merged."""
    n = k.shape[0] if pages else k.shape[1]
    mask = None
    if not pages and causal_rows > 1:
        t = causal_rows
        # row j of each query head may not see the chunk's tokens after its own
        mask = np.tile(np.triu(np.ones((t, t), np.bool_), 1), (q.shape[1] // t, 1))  # (R, t)

    def part(a: int, b: int) -> Partial:
        if pages:
            got = cpu_kernels.dense_pages(q, k, v, a, b)
            return _pages_part(q, k[a:b], v[a:b]) if got is None else got
        return _flat_part(q, k[:, a:b], v[:, a:b], mask if b == n else None)

    if pages:  # in C where it can (its own threads), else the numba loops in pieces
        got = cpu_native.dense_pages(q, k, v, 0, n, cpu_kernels.THREADS)
        if got is not None:
            return got
    else:  # numpy's ops: two halves
        spans = cpu_kernels.spans(n)
        if len(spans) == 1:
            return part(*spans[0])
        return merge(list(_threads().map(lambda c: part(*c), spans)))
    return merge(_in_order(n, part))


def _in_order(n: int, part: Callable[[int, int], Any]) -> list[Any]:
    """part(a, b) over [0, n) shared over the threads (`cpu_kernels.share`), the results in
    the order of their ranges: merged in that order, a step's partials sum alike whatever
    thread took which piece (the same logits from one run to the next)."""
    got = cpu_kernels.share(n, lambda a, b: (a, part(a, b)))
    return [p for _, p in sorted(got, key=lambda x: x[0])]


def chunk_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal_rows: int
                    ) -> np.ndarray:
    """Softmax attention (H, R, Dv), normalized, of queries q (H, R, D) (scaled) over per-head
    keys k, v (H, T, D) whose last `causal_rows` are the queries' own tokens (rows rep-major,
    as `attend` reshapes them: row j sees those up to its own, j mod causal_rows)."""
    return _chunk(q, k, v, causal_rows, True)[2]


def chunk_partial(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal_rows: int = 0
                  ) -> Partial:
    """`chunk_attention`'s softmax partial (row max, row sum of exp, exp @ v), to be merged
    with others (`merge`); causal_rows 0: every key seen by every row."""
    return _chunk(q, k, v, causal_rows, False)


def _chunk(q: np.ndarray, k: np.ndarray, v: np.ndarray, n: int, normalize: bool
           ) -> Partial:
    """A piece of the rows at a time on the threads: each piece's logits, mask, exp, sums and
    product while they are in the cache (no logits of the whole chunk held at once)."""
    h, r, _ = q.shape
    t = k.shape[1]
    kt = k.swapaxes(-1, -2)
    m = np.empty((h, r, 1), np.float32)
    total = np.empty((h, r, 1), np.float32)
    out = np.empty((h, r, v.shape[-1]), np.float32)
    # row i of the chunk may not see the chunk's tokens after its own: -inf added there
    after = np.triu(np.full((n, n), NINF, np.float32), 1)

    step = max(1, CHUNK_PIECE_LOGITS // (h * t))

    def part(a: int, b: int) -> None:
        for c in range(a, b, step):
            rows(c, min(c + step, b))

    def rows(a: int, b: int) -> None:
        # rows of one query head see keys up to their last row's token: the rest not computed
        end = t if n < 1 or a // n != (b - 1) // n else t - n + (b - 1) % n + 1
        s = np.matmul(q[:, a:b], kt[:, :, :end])                       # (H, b - a, end)
        if n > 1:
            s[:, :, t - n:] += after[np.arange(a, b) % n, :end - (t - n)]
        top = s.max(axis=-1, keepdims=True)
        s -= top
        np.exp(s, out=s)
        m[:, a:b] = top
        total[:, a:b] = s.sum(axis=-1, keepdims=True)
        o = out[:, a:b]
        np.matmul(s, v[:, :end], out=o)
        if normalize:
            o /= total[:, a:b]

    _in_pieces(r, h * r * t * k.shape[-1], part)
    return m[..., 0], total[..., 0], out


def dense_codes(q: np.ndarray, kparts: tuple[np.ndarray, ...], vparts: tuple[np.ndarray, ...],
                bits: int) -> Partial | None:
    """`dense_partial` over pages held quantized (engine.kv.codec's parts at 8 or 4 bits,
    numpy), decoded a page at a time by the compiled loop (cpu_kernels.dense_pages_q), the
    pages shared over the threads; None where the loop cannot take them (the caller decodes in
    MLX)."""
    parts = _in_order(kparts[0].shape[0], lambda a, b: cpu_kernels.dense_pages_q(
        q, kparts, vparts, bits, a, b))
    return None if any(p is None for p in parts) else merge(parts)  # type: ignore[arg-type]


def plain_pool(store: Any, layer: int) -> np.ndarray | None:
    """The RAM tier's float32 keys pool (slots, H, P, D) viewed without a copy, or None when
    the pages are quantized, 16-bit or buffered (the caller goes through MLX)."""
    pool = store.pool_k[layer]
    if pool is None or len(pool) != 1 or pool[0].dtype != mx.float32:
        return None
    return np.asarray(pool[0])


def resident_pool(store: Any, layer: int, at: np.ndarray) -> Pool | None:
    """Where the blocks `at` (H, m) are in the RAM tier: the keys pool (slots, H, P, D) and
    each block's slot and block of it (H, m); None when the pool is not `plain_pool`."""
    a = plain_pool(store, layer)
    if a is None:
        return None
    table = store.tables[layer]
    nb = store.P // table.block_tokens
    page = at // nb
    return a, page if table.identity else table.slot_of[page], at % nb


def resident_keys(store: Any, layer: int, at: np.ndarray) -> np.ndarray | None:
    """Keys (H, m, b, D) float32 of the blocks `at` (H, m), gathered in numpy from the RAM
    tier's pool; None when the pool is not `plain_pool`."""
    got = resident_pool(store, layer, at)
    if got is None:
        return None
    a, slots, blk = got
    b = store.tables[layer].block_tokens
    heads = np.arange(at.shape[0])[:, None]
    return a.reshape(*a.shape[:2], -1, b, a.shape[-1])[slots, heads, blk]


def attend_blocks(store: Any, layer: int, q: np.ndarray,
                  recent: tuple[np.ndarray, np.ndarray, np.ndarray], top: np.ndarray,
                  sink: int, hi: int, n_pages: int, spec: remap.RopeSpec | None,
                  end: int, resident: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """attention._sparse's attention after selection, in numpy: the softmax partial (max,
    sum, output) of queries q (H, R, D) over the sink pages [0, sink), the chosen blocks `top`
    (H, k) and the window pages [hi, n_pages), re-rotated as remap.block_deltas places them
    (`spec`), merged with the `recent` partial. None unless every page is in the RAM tier as
    plain float32 (`plain_pool`). `resident`: the step's `choose` found them so (not
    checked again)."""
    table = store.tables[layer]
    pk = plain_pool(store, layer)
    pool_v = store.pool_v[layer]
    if pk is None or pool_v is None or not (resident or table.all_resident(n_pages)):
        return None
    pv = np.asarray(pool_v[0])
    P = store.P
    b = table.block_tokens
    nb = P // b
    h, _, d = q.shape
    part = cpu_kernels.attend_chosen(
        q, pk, pv, top, sink, hi, n_pages, nb, b,
        None if spec is None else (remap.reach(end, spec.trained), end, spec.trained),
        None if spec is None else remap._split_tables(spec), remap.SPLIT,
        None if table.identity else table.slot_of, recent)
    if part is not None:  # one loop: laid out, turned and merged there, nothing gathered
        return part
    delta = None
    if spec is not None:
        top, delta = remap.block_deltas(top, sink, hi, n_pages, P, b, end, spec.trained)
    n_top = top.shape[1]
    blocks = np.concatenate([np.broadcast_to(np.arange(sink * nb), (h, sink * nb)),
                             top.astype(np.int64),
                             np.broadcast_to(np.arange(hi * nb, n_pages * nb),
                                             (h, (n_pages - hi) * nb))], axis=1)
    n_rot = sink * nb + n_top
    page, blk = blocks // nb, blocks % nb
    slots = page if table.identity else table.slot_of[page]
    heads = np.arange(h)[:, None]
    k = pk.reshape(*pk.shape[:2], nb, b, d)[slots, heads, blk]                # (H, n, b, D)
    v = pv.reshape(*pv.shape[:2], nb, b, pv.shape[-1])[slots, heads, blk]
    if delta is not None:  # the window's delta is 0: only sinks and chosen blocks turn
        turn = np.concatenate([delta[:, :sink * nb], delta[:, delta.shape[1] - n_top:]], 1)
        k[:, :n_rot] = remap.rerotate(k[:, :n_rot], turn, spec)  # type: ignore[arg-type]
    return merge([recent, _flat_part(q, k.reshape(h, -1, d), v.reshape(h, -1, v.shape[-1]),
                                     None)])

"""Compiled loops for the sparse path and exact decode on MLX's CPU backend (numba), where
numpy pays per op.

Contract: `rotate(k, delta, tables, split)` returns what remap.rerotate returns for float32
numpy keys in RoPE's halves layout, from remap's angle tables (k (Hk, Nk, B, D) broadcast
against delta (Hd, Nd), each block rotated by its delta positions), or None when the loop is
not available (`dense_pages`, `dense_pages_q`, `far_bound`, `far_rescore`, `choose` and
`attend_chosen` likewise return what their docstrings name, or None): numba not installed (a
Linux-only dependency; on a Mac the sparse path runs in MLX on the GPU), STRATA_NUMBA=0, or its
compilation failed (a RuntimeWarning says why). `choose` runs attend.c's pass instead of the
loop where that runs (engine.kv.cpu_native), numba or not. Callers then take the numpy path
(MLX's, for quantized pages). The first call loads or compiles the loops (cached beside this
file or in numba's user cache: ~0.4 s to load with numba's import, ~1.5 s to compile), once per
process, on the first decode step that needs them, or ahead of it on a thread (`warm`) while
a long prompt is prefilled (attention.WARM_CHUNK); not for a short one (the question after a
128k stored context), whose prefill it would slow for the cores.

Why: a re-rotation is a handful of elementwise passes over arrays whose inner dimension is
half the head (32 floats), and numpy's per-call and per-inner-loop costs made the four of a
32k sparse decode step's layer (the query per far page, per block page and per shortlisted
block, the chosen keys) 1.9 ms of its ~6 ms (docs/benchmarks.md). One fused loop computes
each block's angles once from remap's tables and writes the rotated rows: ~10x less. Exact
decode over pages in RAM reads each key and value once in `dense_pages` (online softmax a
page at a time), where numpy wrote and reread the logits; `dense_pages_q` decodes quantized
pages one at a time into L1, where MLX decoded a float32 copy of every page first.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from engine.kv import cpu_native

ENABLED = (os.environ.get("STRATA_NUMBA") or "1") != "0"
T = TypeVar("T")

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "loops": the compiled loops by name, None once loading failed
_warming: list[bool] = []  # a warm-up thread was started


def _compile() -> dict[str, Any] | None:
    """The numba-compiled loops by name, or None (numba missing)."""
    try:
        from engine.kv import cpu_loops  # imports numba (Linux only), ~0.3 s on first use
    except ImportError:
        return None
    return {"rotate": cpu_loops.rotate_blocks, "far_bound": cpu_loops.far_bound,
            "far_rescore": cpu_loops.far_rescore, "choose": cpu_loops.choose,
            "attend_chosen": cpu_loops.attend_chosen,
            "dense_pages": cpu_loops.dense_pages, "dense_pages_q": cpu_loops.dense_pages_q}


def _loops() -> dict[str, Any] | None:
    if "loops" not in _state:
        with _lock:
            if "loops" not in _state:
                _state["loops"] = _compile() if ENABLED else None
    return _state["loops"]  # type: ignore[no-any-return]


# Threads for the larger numpy work and the exact decode loops (numpy's matmul and exp and
# the loops, compiled nogil, release the GIL); cpu_select cuts its work over the same pool.
# The sparse loops run whole: cut over the threads they were no faster here, in situ
# (docs/benchmarks.md), and a prefill chunk's were slower (after its matmuls OpenBLAS's
# workers spin on the other core).
THREADS = max(1, min(4, os.cpu_count() or 1))
_pool: list[ThreadPoolExecutor] = []


def threads() -> ThreadPoolExecutor:
    """The process's pool of THREADS workers for numpy work and the loops."""
    if not _pool:
        with _lock:
            if not _pool:
                _pool.append(ThreadPoolExecutor(THREADS, thread_name_prefix="strata-np"))
    return _pool[0]


def spans(n: int, least: int = 2) -> list[tuple[int, int]]:
    """[0, n) cut into at most THREADS spans; one span when n < least (too little work to
    share)."""
    if THREADS < 2 or n < max(least, 2):
        return [(0, n)]
    cut = -(-n // THREADS)
    return [(a, min(n, a + cut)) for a in range(0, n, cut)]


# Pieces a thread of `share`'s work is cut into: a worker that starts late or runs slow (its
# core busy elsewhere) takes fewer of them, and the caller the rest.
PIECES = max(1, int(os.environ.get("STRATA_SHARE_PIECES") or 4))


def share(n: int, work: Callable[[int, int], T], least: int = 2) -> list[T]:
    """work(a, b) over [0, n) cut into up to PIECES x THREADS ranges, taken in turn by this
    thread and THREADS - 1 pool workers; the results in no set order. One call on [0, n)
    when n < least or there is one thread. Where two threads were handed half each, a step
    waited for the half whose thread started last (a core busy elsewhere: the exact pass at
    16k ran its halves one after the other about as often as at once, docs/benchmarks.md);
    a worker that has not started when the pieces run out is not waited for."""
    if THREADS < 2 or n < max(least, 2):
        return [work(0, n)]
    k = min(n, PIECES * THREADS)
    cuts = [(n * i // k, n * (i + 1) // k) for i in range(k)]
    turn = itertools.count()  # next() on a count is atomic under the GIL

    def take() -> list[T]:
        out = []
        while (i := next(turn)) < k:
            out.append(work(*cuts[i]))
        return out

    helpers = [threads().submit(take) for _ in range(THREADS - 1)]
    got = take()
    for f in helpers:
        if not f.cancel():  # started: it may hold a piece
            got.extend(f.result())
    return got


def _run(name: str, *args: Any) -> bool:
    """Run loop `name`; False (and numpy from then on) when the loops are not available or
    this one fails to compile (numba compiles on the first call of each signature)."""
    loops = _loops()
    if loops is None:
        return False
    try:
        loops[name](*args)
    except Exception as e:
        _state["loops"] = None
        warnings.warn(f"the compiled loop {name} failed ({e}); numpy computes instead",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def warm() -> None:
    """Load the loops on a daemon thread (a no-op once loaded or loading): called by a long
    prompt's prefill, so that its first decode step does not pay the ~0.6 s (numba's import
    and the cached machine code)."""
    if ENABLED and "loops" not in _state and not _warming:
        _warming.append(True)
        threading.Thread(target=_loops, name="strata-loops-load", daemon=True).start()


def available() -> bool:
    """Whether the compiled loops run here (loading them if need be)."""
    return _loops() is not None


def rotate(k: np.ndarray, delta: np.ndarray, tables: tuple[np.ndarray, ...], split: int
           ) -> np.ndarray | None:
    """remap.rerotate for float32 keys in the halves layout, through the compiled loop, with
    remap's angle tables (cos and sin of lo, cos and sin of hi x split positions, each
    (split, half)); None when the loop is not available."""
    if k.dtype != np.float32 or k.ndim != 4 or delta.ndim != 2 or _loops() is None:
        return None
    cl, sl, ch, sh = tables
    if not _fits_tables(k.shape[-1], delta, tables, split):
        return None
    h = max(k.shape[0], delta.shape[0])
    n = max(k.shape[1], delta.shape[1])
    if any(x not in (1, want) for x, want in ((k.shape[0], h), (delta.shape[0], h),
                                              (k.shape[1], n), (delta.shape[1], n))):
        return None  # not broadcastable: numpy's path raises as it would
    out = np.empty((h, n, k.shape[2], k.shape[3]), np.float32)
    ok = _run("rotate", k, delta.astype(np.int64, copy=False), split, cl, sl, ch, sh, out)
    return out if ok else None


def _fits_tables(dim: int, delta: np.ndarray, tables: tuple[np.ndarray, ...], split: int
                 ) -> bool:
    """Whether rows of `dim` hold the rotated dims and every delta lies within the angle
    tables: the loops check no bounds, and would read or write out of place."""
    return dim >= 2 * tables[0].shape[1] and (
        not delta.size or int(np.abs(delta).max()) < split * len(tables[2]))


def _far_ok(q: np.ndarray, tables: tuple[np.ndarray, ...], split: int, e: int, s0: int,
            lo_start: int, loops: bool = True) -> bool:
    """Whether the far loops (with `loops`; else any code) can take a query (H, R, D) float32
    and shifts up to e + s0 - lo_start (within the angle tables)."""
    cl, _, ch, _ = tables
    return (q.dtype == np.float32 and q.shape[-1] >= 2 * cl.shape[1]
            and e + s0 - lo_start < split * len(ch) and (not loops or _loops() is not None))


def far_bound(bmin: np.ndarray, bmax: np.ndarray, q: np.ndarray, m: np.ndarray,
              starts: np.ndarray, far: tuple[Any, int, int], group: int,
              tables: tuple[np.ndarray, ...], split: int, rows: np.ndarray | None = None
              ) -> np.ndarray | None:
    """cpu_select.score with `far`, in one loop: per KV head and candidate (H, n), the
    logsumexp over query rows of the box bound on q.k minus the row's running max, each run
    of `group` candidates scored with the query q (H, R, D) rotated back by the run's first
    start's far shift (E + S - start before E, else 0). bmin, bmax (H, n, D) float32, or
    with `rows` (H, M) pools (X, per, D) read in place: candidate j of head h is
    pool[rows[h, j // per], j % per] (n = M per). m (H, R); starts (1 or H, n). None when
    the loops are not available."""
    _, e, s0 = far
    if not _far_ok(q, tables, split, e, s0, int(starts.min(initial=e))):
        return None
    if rows is None:  # each head's candidates as a pool of one candidate a row
        h, n, d = bmax.shape
        bmin, bmax = (_f32(a).reshape(h * n, 1, d) for a in (bmin, bmax))
        rows = np.arange(h * n).reshape(h, n)
    n = rows.shape[1] * bmax.shape[1]
    if (bmin.shape != bmax.shape or bmax.dtype != np.float32 or bmin.dtype != np.float32
            or q.shape[-1] != bmax.shape[-1] or rows.shape[0] != q.shape[0]
            or starts.shape[-1] != n or starts.shape[0] not in (1, rows.shape[0])
            or (rows.size and not 0 <= rows.min() <= rows.max()
                                         < len(bmax))):
        return None  # the loop checks no bounds
    out = np.empty((rows.shape[0], n), np.float32)
    ok = _run("far_bound", bmin, bmax, rows.astype(np.int64, copy=False), q, _f32(m),
              starts.astype(np.int64, copy=False), e, s0, group, split, *tables, out)
    return out if ok else None


def far_rescore(q: np.ndarray, keys: np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray],
                at: np.ndarray, b: int, m0: np.ndarray, far: tuple[Any, int, int],
                tables: tuple[np.ndarray, ...], split: int) -> np.ndarray | None:
    """cpu_select.rescore's true logits with `far`, in one loop: per KV head and block
    (H, m), the logsumexp over query rows of the block's largest q.k (the query rotated back
    by the block's far shift) minus the row's running max m0 (H, R). `keys`: the blocks'
    keys (H, m, b, D), or where they are in a RAM pool (pool (slots, H, P, D), slot and block
    of it (H, m) each: read in place); at (H, m) the blocks' indices. None when the loops are
    not available."""
    _, e, s0 = far
    if isinstance(keys, tuple):
        pk, slots, blk = keys
    else:  # the gathered keys as a pool of one page a block: slot j, block 0
        pk = keys.swapaxes(0, 1)
        slots = np.broadcast_to(np.arange(keys.shape[1]), at.shape)
        blk = np.zeros(at.shape, np.int64)
    if pk.dtype != np.float32 or not _far_ok(q, tables, split, e, s0,
                                               int(at.min(initial=e // b)) * b):
        return None
    if not _in_pool(pk, slots, blk, b, q.shape[0]) or slots.shape != at.shape:
        return None
    out = np.empty(at.shape, np.float32)
    ok = _run("far_rescore", q, pk, slots.astype(np.int64, copy=False),
              blk.astype(np.int64, copy=False), at.astype(np.int64, copy=False), b, _f32(m0),
              e, s0, split, *tables, out)
    return out if ok else None


# The angle tables' stand-ins where nothing moves: the loops take four arrays and never look
# them up then.
_NO_TABLES = tuple(np.ones((1, 1), np.float32) for _ in range(4))


def choose(pmin: np.ndarray, pmax: np.ndarray, bmin: np.ndarray, bmax: np.ndarray,
           q: np.ndarray, m0: np.ndarray, lo: int, c: int, n_first: int, page_run: int,
           nb: int, b: int, far: tuple[Any, int, int] | None,
           tables: tuple[np.ndarray, ...] | None, split: int, voted: np.ndarray | None,
           read_pages: int, m: int, k: int, pk: np.ndarray, slot_of: np.ndarray | None
           ) -> np.ndarray | None:
    """cpu_select's `bounded` and `rescore` in one loop: per KV head, the k blocks (H, k)
    chosen among the blocks of pages [lo, lo + c). Past 2 n_first pages, each head's
    candidates are the blocks of its n_first pages of highest page bound (page summaries
    pmin, pmax (N H, 1, D) float32: page p of head h is row p H + h), else every page's,
    bounded by their block summaries (bmin, bmax (H, N nb, D) float16, read in place).
    Then the voted blocks (H, v) are left out, only the read_pages best pages read,
    the m best by bound rescored by their true logits (queries q (H, R, D) against running
    maxima m0 (H, R); keys read in place from the RAM pool pk (slots, H, P, D) float32, page
    p in slot slot_of[p], or slot p when slot_of is None) and the k best kept. With `far`,
    candidates before E are scored moved, as far_bound and far_rescore score them. None
    when the loops are not available or the arguments do not fit."""
    h, r, d = q.shape
    P = nb * b
    if far is None:  # nothing moves: the tables are never looked up
        e = s0 = 0
        tables = _NO_TABLES
    else:
        assert tables is not None
        _, e, s0 = far
        if not _far_ok(q, tables, split, e, s0, lo * P, loops=False):
            return None
    end = lo + c  # pages [lo, end) hold every candidate block
    n_pick = n_first if c > 2 * n_first else c
    voted = np.zeros((h, 0), np.int64) if voted is None else voted
    slots = np.zeros(1, np.int64) if slot_of is None else slot_of[:end]
    if (q.dtype != np.float32 or pk.dtype != np.float32 or pmin.dtype != np.float32
            or pmax.dtype != np.float32 or pmin.shape != pmax.shape or pmin.shape[1:] != (1, d)
            or len(pmin) < end * h or bmin.dtype != np.float16 or bmax.shape != bmin.shape
            or bmin.shape[0] != h or bmin.shape[1] < end * nb or bmin.shape[1] % nb
            or bmin.shape[2] != d or not (bmin.flags.c_contiguous and bmax.flags.c_contiguous)
            or pk.ndim != 4 or pk.shape[1] < h
            or pk.shape[2] != P or pk.shape[3] != d or voted.shape[0] != h
            or m0.shape != (h, r) or not 0 < k <= min(m, n_pick * nb) or c < 1):
        return None
    # The loop checks no bounds.
    if voted.size and (voted.min() < 0 or voted.max() >= end * nb):
        return None
    if (end > len(pk) if slot_of is None else
            len(slots) < end or slots[lo:].min() < 0 or slots[lo:].max() >= len(pk)):
        return None
    voted = voted.astype(np.int64, copy=False)
    if cpu_native.may_run():  # attend.c's, where it runs (a 32k layer: 0.47 -> 0.26 ms)
        got = cpu_native.choose(pmin, pmax, bmin, bmax, q, _f32(m0), lo, c, n_first,
                                page_run, nb, b, e, s0, tables, split, voted, read_pages,
                                min(m, n_pick * nb), k, pk,
                                None if slot_of is None else slots.astype(np.int64, copy=False),
                                THREADS)
        if got is not None:
            return got
    if _loops() is None:
        return None
    out = np.empty((h, k), np.int64)
    ok = _run("choose", pmin, pmax, bmin.view(np.uint16).reshape(h, -1),
              bmax.view(np.uint16).reshape(h, -1), q, _f32(m0), lo, c, n_first, page_run, nb,
              b, e, s0, split, *tables, voted.astype(np.int64, copy=False), end * nb,
              read_pages, m, pk, slots.astype(np.int64, copy=False), slot_of is None, out)
    return out if ok else None


def _in_pool(pk: np.ndarray, slots: np.ndarray, blk: np.ndarray, b: int, h: int) -> bool:
    """Whether blocks (slots, blk) of b keys and heads [0, h) lie inside pool pk: the loops
    check no bounds (numpy's gather would raise where they read out of place)."""
    return not slots.size or bool(
        0 <= slots.min() and slots.max() < len(pk) and 0 <= blk.min()
        and (blk.max() + 1) * b <= pk.shape[2] and h <= pk.shape[1]
        and slots.shape == blk.shape and slots.shape[0] == h)


def attend_chosen(q: np.ndarray, pk: np.ndarray, pv: np.ndarray, chosen: np.ndarray,
                  sink: int, hi: int, n_pages: int, nb: int, b: int,
                  place: tuple[bool, int, int] | None, tables: tuple[np.ndarray, ...] | None,
                  split: int, slot_of: np.ndarray | None,
                  init: tuple[np.ndarray, np.ndarray, np.ndarray]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The softmax partial (max (H, R), sum (H, R), output (H, R, Dv)) of queries q (H, R, D)
    over what a sparse step reads, merged with the partial `init` (float32, those shapes):
    per head the sink pages [0, sink), the chosen blocks `chosen` (H, k) and the window pages
    [hi, n_pages) of the RAM pools pk (slots, H, P, D) and pv (slots, H, P, Dv), page p in
    slot slot_of[p] (slot p when slot_of is None); with `place` (reach layout, end, trained)
    the keys turned as remap.block_deltas turns them. cpu_select's layout, gather,
    re-rotation, `_flat_part` and `merge` in one loop, nothing copied out of the pools (the
    layout in numpy cost ~0.35 ms of a 32k step's layer). None when the loops are not
    available or the arguments do not fit."""
    h, r, _ = q.shape
    dv = pv.shape[-1]
    if place is None:
        turned, reach, end, trained = False, False, 0, 0
        tables = _NO_TABLES
    else:
        assert tables is not None
        turned, (reach, end, trained) = True, place
        reach_max = 2 * (n_pages * nb * b + abs(end) + abs(trained))  # |delta| at most
        if pk.shape[-1] < 2 * tables[0].shape[1] or reach_max >= split * len(tables[2]):
            return None
    slots = np.zeros(1, np.int64) if slot_of is None else slot_of[:n_pages]
    if (q.dtype != np.float32 or pk.dtype != np.float32 or pv.dtype != np.float32
            or pk.ndim != 4 or pv.shape[:3] != pk.shape[:3] or pk.shape[1] < h
            or pk.shape[2] != nb * b or pk.shape[3] != q.shape[2] or chosen.shape[0] != h
            or not 0 <= sink <= hi <= n_pages or init[0].shape != (h, r)
            or init[1].shape != (h, r) or init[2].shape != (h, r, dv)
            or any(a.dtype != np.float32 for a in init)):
        return None
    # The loop checks no bounds.
    if chosen.size and (chosen.min() < 0 or chosen.max() >= n_pages * nb):
        return None
    if (n_pages > len(pk) if slot_of is None else len(slots) < n_pages
            or (n_pages and (slots.min() < 0 or slots.max() >= len(pk)))):
        return None
    chosen = chosen.astype(np.int64, copy=False)
    slots = slots.astype(np.int64, copy=False)
    if cpu_native.may_run():  # attend.c's, where it runs
        got = cpu_native.attend_chosen(q, pk, pv, chosen, sink, hi, n_pages, nb, b, place,
                                       tables, split, None if slot_of is None else slots,
                                       init, THREADS)
        if got is not None:
            return got
    if _loops() is None:
        return None
    out = (np.empty((h, r), np.float32), np.empty((h, r), np.float32),
           np.empty((h, r, dv), np.float32))

    def heads(a: int, z: int) -> bool:
        return _run("attend_chosen", q[a:z], pk, pv, chosen[a:z], sink, hi, n_pages, nb, b,
                    turned, reach, end, trained, slots, slot_of is None, split, *tables,
                    *(x[a:z] for x in init), *(x[a:z] for x in out), a)
    # The heads on both threads: a 32k step 5% faster (docs/benchmarks.md), where the
    # slower hosts before showed no gain.
    ok = all(share(h, heads))
    return out if ok else None


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32, copy=False)


def dense_pages(q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: int, hi: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The softmax partial (max (H, R), sum (H, R), output (H, R, Dv)) of queries q (H, R, D)
    (scaled) over pages [lo, hi) of k (n, H, P, D) and v (n, H, P, Dv), all float32: what
    cpu_select's `_pages_part` computes, reading each key and value once. None when the loops
    are not available."""
    if (q.dtype != np.float32 or k.dtype != np.float32 or v.dtype != np.float32
            or k.ndim != 4 or v.ndim != 4 or q.ndim != 3 or _loops() is None):
        return None
    h, r, d = q.shape
    if (k.shape[1] != h or k.shape[3] != d or v.shape[:3] != k.shape[:3]
            or not 0 <= lo < hi <= k.shape[0]):
        return None  # the loop checks no bounds
    out = (np.empty((h, r), np.float32), np.empty((h, r), np.float32),
           np.empty((h, r, v.shape[-1]), np.float32))
    ok = _run("dense_pages", q, k, v, lo, hi, *out)
    return out if ok else None


def dense_pages_q(q: np.ndarray, kparts: tuple[np.ndarray, ...],
                  vparts: tuple[np.ndarray, ...], bits: int, lo: int, hi: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`dense_pages` over pages quantized as engine.kv.codec holds them at 8 or 4 bits: each
    of kparts, vparts is (codes uint32 (n, H, P, D * bits // 32), scales, biases float32
    (n, H, P, groups)), decoded a page at a time (no decoded copy). None when the loop is not
    available or the parts are not that."""
    if bits not in (8, 4) or q.dtype != np.float32 or q.ndim != 3 or _loops() is None:
        return None
    h, r, d = q.shape
    kc, ks, kb = kparts
    vc, vs, vb = vparts
    lead = kc.shape[:3]
    if (kc.dtype != np.uint32 or vc.dtype != np.uint32 or kc.ndim != 4 or vc.ndim != 4
            or any(a.dtype != np.float32 or a.ndim != 4 for a in (ks, kb, vs, vb))
            or any(a.shape[:3] != lead for a in (ks, kb, vc, vs, vb))
            or ks.shape != kb.shape or vs.shape != vb.shape or lead[1] != h
            or kc.shape[3] * 32 // bits != d or d % ks.shape[3]
            or (vc.shape[3] * 32 // bits) % vs.shape[3] or not 0 <= lo < hi <= lead[0]):
        return None  # the loop checks no bounds
    kc, vc = (np.ascontiguousarray(a).view(np.uint8) for a in (kc, vc))
    out = (np.empty((h, r), np.float32), np.empty((h, r), np.float32),
           np.empty((h, r, vc.shape[3] * 8 // bits), np.float32))
    ok = _run("dense_pages_q", q, kc, ks, kb, vc, vs, vb, bits, lo, hi, *out)
    return out if ok else None

"""Exact decode attention over float32 pages, and a sparse step's block choice, in C
(engine/kv/attend.c), on Linux CPU with AVX-512.

Contract: `dense_pages(q, k, v, lo, hi, threads, tail, causal)` returns what
cpu_kernels.dense_pages returns (the softmax partial of queries q (H, R, D), scaled, over
pages [lo, hi) of k, v (n, H, P, D)), and over the recent keys and values `tail` (H, T, D)
too where given (a decode step's whole attention in one call), computed by attend.c on up to
`threads` threads of its own, or None where it cannot: STRATA_NATIVE_KV=0, no C compiler, a
failed compile, no AVX-512, or arrays it does not take (not float32, rows not contiguous, D
or Dv not a multiple of 64, more than 32 query rows, pages or a tail of more than 512
tokens); callers take the numba loops (and numpy for the tail) then. `dense_flat(q, k, v,
causal, threads)` does the same over a layer's contiguous buffer (per-head keys (H, T, D)),
read as pages in place. The result does not
depend on which thread took which pages (partials merged in page order); it equals
cpu_kernels.dense_pages up to float rounding. `choose(...)` is cpu_kernels.choose's pass
(bound, shortlist, rescoring: the blocks a sparse step reads) on the same threads, the numba
loop's blocks up to float rounding; `attend_chosen(...)` is cpu_kernels.attend_chosen's
partial (sinks, chosen blocks and window, turned as placed), the loop's up to float
rounding. The library is compiled once per machine
(engine.native, ~1 s) on the first call, or ahead of it by `warm`. `status()` says which.

Why: a 16k-token exact step reads 755 MB of K and V (the starter); the numba loops, shared
over Python's pool in pieces, reached ~26 GB/s and cost 40-200 us a layer in the handoff; in
C, with its own workers and prefetches a page ahead, ~35 GB/s (docs/benchmarks.md). A 32k
sparse step's choice took ~0.47 ms a layer in the numba loop (one thread, its float16
summaries widened one value at a time), ~0.26 here.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np

from engine import native, platform

ENABLED = (os.environ.get("STRATA_NATIVE_KV") or "1") != "0"
SOURCE = Path(__file__).with_name("attend.c")
FLAGS = ("-O3", "-pthread")  # -O2 kept the 4 x 4 accumulators in memory: 2x slower
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "lib": the loaded library or None; "why": status


def _load() -> Any | None:
    if not ENABLED:
        _state["why"] = "off (STRATA_NATIVE_KV=0)"
        return None
    try:
        path = native.built(SOURCE, platform.default_cache(), FLAGS)
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged file in the cache (renames are whole): built again
            path.unlink(missing_ok=True)
            lib = ctypes.CDLL(str(native.built(SOURCE, platform.default_cache(), FLAGS)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        _state["why"] = f"not built ({e}{': ' + detail.decode()[:200] if detail else ''})"
        return None
    if not lib.strata_dense_pages_avx512():
        _state["why"] = "off (no AVX-512)"
        return None
    p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.strata_dense_pages_threads.argtypes = [p, i, i, i, p, n, n, p, n, n, i, i, i, i,
                                               p, n, p, n, i, i, i, p, p, p]
    lib.strata_dense_pages_threads.restype = i
    lib.strata_choose.argtypes = [p, p, p, p, n, p, p, i, i, i, i, i, i, i, i, i, n, n, i,
                                  p, p, p, p, i, p, i, n, i, i, i, p, n, n, p, i, i, p]
    lib.strata_choose.restype = i
    lib.strata_attend_chosen.argtypes = [p, i, i, i, p, n, n, p, n, n, i, p, i, i, i, i, i, i,
                                         i, i, n, n, p, i, i, p, p, p, p, i, p, p, p, p, p,
                                         p, i]
    lib.strata_attend_chosen.restype = i
    _state["why"] = "on (AVX-512)"
    return lib


def _lib() -> Any | None:
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]


def warm() -> None:
    """Compile and load the library on a daemon thread (a no-op once loaded or loading)."""
    if ENABLED and "lib" not in _state and not _state.get("warming"):
        _state["warming"] = True
        threading.Thread(target=_lib, name="strata-attend-load", daemon=True).start()


def may_run() -> bool:
    """False once loading failed or was turned off (no attempt made here); True before the
    first use and once loaded."""
    return ENABLED and _state.get("lib", True) is not None


# attend.c's limits (its `takes`): checked here too, so that a step it would refuse skips the
# arrays' preparation (a model with head_dim 80 would otherwise pay it every layer).
MAX_ROWS, MAX_DIM, MAX_SIZE = 32, 256, 512


def fits(rows: int, dim: int, dv: int, size: int) -> bool:
    """Whether attend.c takes `rows` query rows a KV head, keys of `dim` and values of `dv`,
    pages of `size` tokens (and whether it may still run at all, `may_run`)."""
    return (may_run() and 1 <= rows <= MAX_ROWS and size % 4 == 0 and 4 <= size <= MAX_SIZE
            and all(x % 64 == 0 and 64 <= x <= MAX_DIM for x in (dim, dv)))


def status() -> str:
    """'on (AVX-512)', or why not; 'not loaded' before the first use."""
    return str(_state.get("why", "not loaded"))


def _rows_ok(a: np.ndarray) -> bool:
    """float32 (n, H, P, D) whose rows are contiguous and whose page and head strides are
    whole floats (a pool's slots, sliced or not)."""
    return (a.dtype == np.float32 and a.ndim == 4 and a.strides[3] == 4
            and a.strides[2] == 4 * a.shape[3] and a.strides[0] % 4 == 0
            and a.strides[1] % 4 == 0 and a.strides[0] > 0 and a.strides[1] > 0)


def _tail_ok(a: np.ndarray, h: int, d: int) -> bool:
    """float32 (H, T, D) with contiguous rows (one row: any stride between)."""
    return (a.dtype == np.float32 and a.ndim == 3 and a.shape[0] == h and a.shape[2] == d
            and a.strides[2] == 4 and (a.strides[1] == 4 * d or a.shape[1] == 1)
            and a.strides[0] % 4 == 0 and a.strides[0] > 0)


def dense_pages(q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: int, hi: int, threads: int,
                tail: tuple[np.ndarray, np.ndarray] | None = None, causal: int = 1
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """See the module docstring; `tail`: the recent keys and values (H, T, D) after the
    pages, attended in the same call, whose last `causal` are the queries' own tokens (rows
    rep-major, as attention.attend reshapes them: causal among those)."""
    if q.dtype != np.float32 or q.ndim != 3 or not (_rows_ok(k) and _rows_ok(v)):
        return None
    h, r, d = q.shape
    dv = v.shape[3]
    if (k.shape[1] != h or k.shape[3] != d or v.shape[:3] != k.shape[:3]
            or not 0 <= lo <= hi <= k.shape[0]):
        return None  # the C checks no bounds
    tk = tv = None
    if tail is not None:
        tk, tv = tail
        if not (_tail_ok(tk, h, d) and _tail_ok(tv, h, dv)) or tk.shape[1] != tv.shape[1]:
            return None
    lib = _lib()
    if lib is None:
        return None
    q = np.ascontiguousarray(q)
    out = (np.empty((h, r), np.float32), np.empty((h, r), np.float32),
           np.empty((h, r, dv), np.float32))
    ok = lib.strata_dense_pages_threads(
        q.ctypes.data, h, r, d, k.ctypes.data, k.strides[0] // 4, k.strides[1] // 4,
        v.ctypes.data, v.strides[0] // 4, v.strides[1] // 4, k.shape[2], dv, lo, hi,
        None if tk is None else tk.ctypes.data, 0 if tk is None else tk.strides[0] // 4,
        None if tv is None else tv.ctypes.data, 0 if tv is None else tv.strides[0] // 4,
        0 if tk is None else tk.shape[1], causal, max(1, threads),
        *(a.ctypes.data for a in out))
    return out if ok else None


def _plain(a: np.ndarray, dtype: Any) -> bool:
    return a.dtype == dtype and a.flags.c_contiguous


def choose(pmin: np.ndarray, pmax: np.ndarray, bmin: np.ndarray, bmax: np.ndarray,
           q: np.ndarray, m0: np.ndarray, lo: int, c: int, n_first: int, page_run: int,
           nb: int, b: int, e: int, s0: int, tables: tuple[np.ndarray, ...], split: int,
           voted: np.ndarray, read_pages: int, m: int, k: int, pk: np.ndarray,
           slot_of: np.ndarray | None, threads: int = 1) -> np.ndarray | None:
    """cpu_kernels.choose's blocks (H, k) computed by attend.c's `strata_choose`, on
    arguments cpu_kernels.choose has checked (bounds included; bmin, bmax as float16 (H, N
    nb, D)), or None where it does not run (the numba loop then). Same blocks as the loop up
    to float rounding, ties broken alike."""
    h, r, d = q.shape
    if not (d % 16 == 0 and d <= MAX_DIM and r <= MAX_ROWS and _plain(q, np.float32)
            and _plain(m0, np.float32) and _plain(pmin, np.float32)
            and _plain(pmax, np.float32) and _plain(bmin, np.float16)
            and _plain(bmax, np.float16) and _plain(voted, np.int64)
            and all(_plain(t, np.float32) and t.shape[1] == tables[0].shape[1]
                    for t in tables)
            and pk.dtype == np.float32 and pk.strides[3] == 4 and pk.strides[2] == 4 * d
            and pk.strides[0] % 4 == 0 and pk.strides[1] % 4 == 0
            and (slot_of is None or _plain(slot_of, np.int64))):
        return None
    lib = _lib()
    if lib is None:
        return None
    out = np.empty((h, k), np.int64)
    pages = bmin.shape[1] // nb
    ok = lib.strata_choose(
        pmin.ctypes.data, pmax.ctypes.data, bmin.ctypes.data, bmax.ctypes.data, pages,
        q.ctypes.data, m0.ctypes.data, h, r, d, lo, c, n_first, page_run, nb, b, e, s0, split,
        *(t.ctypes.data for t in tables), tables[0].shape[1], voted.ctypes.data,
        voted.shape[1], (lo + c) * nb, read_pages, m, k,
        pk.ctypes.data, pk.strides[0] // 4, pk.strides[1] // 4,
        None if slot_of is None else slot_of.ctypes.data, slot_of is None, max(1, threads),
        out.ctypes.data)
    return out if ok else None


def attend_chosen(q: np.ndarray, pk: np.ndarray, pv: np.ndarray, chosen: np.ndarray,
                  sink: int, hi: int, n_pages: int, nb: int, b: int,
                  place: tuple[bool, int, int] | None, tables: tuple[np.ndarray, ...],
                  split: int, slot_of: np.ndarray | None,
                  init: tuple[np.ndarray, np.ndarray, np.ndarray], threads: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """cpu_kernels.attend_chosen's partial computed by attend.c's `strata_attend_chosen`, on
    arguments cpu_kernels.attend_chosen has checked (bounds included; chosen and slot_of
    int64), or None where it does not run (the numba loop then). Equal to the loop's up to
    float rounding; the same bits on any number of threads."""
    h, r, d = q.shape
    dv = pv.shape[3]
    if not (d % 16 == 0 and d <= MAX_DIM and dv % 64 == 0 and dv <= MAX_DIM
            and r <= MAX_ROWS and _plain(q, np.float32) and _plain(chosen, np.int64)
            and _rows_ok(pk) and _rows_ok(pv) and all(_plain(a, np.float32) for a in init)
            and all(_plain(t, np.float32) and t.shape[1] == tables[0].shape[1]
                    for t in tables)
            and (slot_of is None or _plain(slot_of, np.int64))):
        return None
    lib = _lib()
    if lib is None:
        return None
    turned, (reach, end, trained) = place is not None, place or (False, 0, 0)
    out = (np.empty((h, r), np.float32), np.empty((h, r), np.float32),
           np.empty((h, r, dv), np.float32))
    ok = lib.strata_attend_chosen(
        q.ctypes.data, h, r, d, pk.ctypes.data, pk.strides[0] // 4, pk.strides[1] // 4,
        pv.ctypes.data, pv.strides[0] // 4, pv.strides[1] // 4, dv, chosen.ctypes.data,
        chosen.shape[1], sink, hi, n_pages, nb, b, turned, reach, end, trained,
        None if slot_of is None else slot_of.ctypes.data, slot_of is None, split,
        *(t.ctypes.data for t in tables), tables[0].shape[1], *(a.ctypes.data for a in init),
        *(a.ctypes.data for a in out), max(1, threads))
    return out if ok else None


BLOCK = 128  # tokens a block when per-head keys are read as pages (`dense_flat`)


def dense_flat(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: int, threads: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The softmax partial of queries q (H, R, D) (scaled) over per-head keys and values k, v
    (H, T, D), rows contiguous (a layer's contiguous buffer), whose last `causal` are the
    queries' own tokens: cpu_select.dense_partial's `pages=False` case. The keys are read as
    pages of BLOCK tokens in place (each head's block n at its own offset: strides, no copy)
    and the last, partial block as the tail, in one call of `dense_pages`; None where that
    does not run."""
    if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != v.shape[:2] or not (
            _tail_ok(k, k.shape[0], k.shape[2]) and _tail_ok(v, v.shape[0], v.shape[2])):
        return None
    h, t, d = k.shape
    n = max(0, (t - causal) // BLOCK)  # whole blocks before the queries' own tokens
    step = np.lib.stride_tricks.as_strided

    def pages(a: np.ndarray) -> np.ndarray:
        return step(a, (max(n, 1), h, BLOCK, a.shape[2]),
                    (BLOCK * a.strides[1], a.strides[0], a.strides[1], 4), writeable=False)

    return dense_pages(q, pages(k), pages(v), 0, n, threads,
                       tail=(k[:, n * BLOCK:], v[:, n * BLOCK:]), causal=causal)

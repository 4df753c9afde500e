"""The numba loops behind engine.kv.cpu_kernels (imported only there, and only when numba is
installed: importing this module imports numba).

Contract: each function is compiled on first use and cached on disk (`cache=True`); they are
defined at module level because numba caches no function that calls jitted functions held in
a closure (it recompiled each, ~1.2 s, in every process). They check no bounds:
cpu_kernels checks the shapes and indices before calling them.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

jit = numba.njit(cache=True, nogil=True, fastmath=True)
# The loops with -inf in them (running maxima, logsumexp) keep IEEE infinities: numba's full
# fastmath lets LLVM assume there are none.
jit_inf = numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "arcp"})
# Sums run in float32 (`np.float32(0.0)`): a float64 accumulator of float32 products kept
# the dot products from vectorizing (the attention loop 0.68 ms against 0.54).


@jit
def angles(d: int, split: int, cl: Any, sl: Any, ch: Any, sh: Any, c: Any, s: Any
           ) -> None:
    """cos and sin of d positions x each frequency, into c and s (half,)."""
    a = abs(d)
    hi = a // split
    lo = a % split
    for i in range(c.shape[0]):  # angle sum: (hi * split) + lo
        c[i] = ch[hi, i] * cl[lo, i] - sh[hi, i] * sl[lo, i]
        si = sh[hi, i] * cl[lo, i] + ch[hi, i] * sl[lo, i]
        s[i] = si if d >= 0 else -si


@jit
def turn(x: Any, c: Any, s: Any, out: Any) -> None:
    """One row x (D,) rotated by angles c, s (halves layout) into out (D,)."""
    half = c.shape[0]
    for i in range(half):
        x1 = x[i]
        x2 = x[i + half]
        out[i] = x1 * c[i] - x2 * s[i]
        out[i + half] = x1 * s[i] + x2 * c[i]
    for i in range(2 * half, x.shape[0]):
        out[i] = x[i]


@jit
def rotate_blocks(k: Any, delta: Any, split: int, cl: Any, sl: Any, ch: Any, sh: Any,
                  out: Any) -> None:
    """cpu_kernels.rotate: k (Hk, Nk, B, D) broadcast against delta (Hd, Nd) into out."""
    heads, n_blocks, rows, _ = out.shape
    c = np.empty(cl.shape[1], np.float32)
    s = np.empty(cl.shape[1], np.float32)
    for h in range(heads):
        hk = h if k.shape[0] > 1 else 0
        hd = h if delta.shape[0] > 1 else 0
        for n in range(n_blocks):
            nk = n if k.shape[1] > 1 else 0
            angles(delta[hd, n if delta.shape[1] > 1 else 0], split, cl, sl, ch, sh, c, s)
            for r in range(rows):
                turn(k[hk, nk, r], c, s, out[h, n, r])


@jit_inf
def lse_rows(x: Any) -> float:
    """cpu_select.lse of one vector."""
    top = -np.inf
    for v in x:
        top = max(top, v)
    if not np.isfinite(top):
        top = 0.0
    total = 0.0
    for v in x:
        total += np.exp(v - top)
    return np.log(total) + top


@jit_inf
def far_bound(bmin: Any, bmax: Any, at: Any, q: Any, m: Any, starts: Any, e: int, s0: int,
              group: int, split: int, cl: Any, sl: Any, ch: Any, sh: Any, out: Any
              ) -> None:
    """cpu_kernels.far_bound into out (H, n): candidate j of head h has the summaries
    bmin/bmax[at[h, j // per], j % per] of pools (X, per, D)."""
    heads, n = out.shape
    per, dim = bmax.shape[1], bmax.shape[2]
    rows = q.shape[1]
    c = np.empty(cl.shape[1], np.float32)
    s = np.empty(cl.shape[1], np.float32)
    qq = np.empty((rows, dim), np.float32)
    qp = np.empty((rows, dim), np.float32)
    qn = np.empty((rows, dim), np.float32)
    x = np.empty(rows, np.float32)
    for h in range(heads):
        hs = h if starts.shape[0] > 1 else 0
        for j0 in range(0, n, group):
            st = starts[hs, j0]
            angles(-(e + s0 - st) if st < e else 0, split, cl, sl, ch, sh, c, s)
            for r in range(rows):
                turn(q[h, r], c, s, qq[r])
                for i in range(dim):
                    qp[r, i] = max(qq[r, i], 0.0)
                    qn[r, i] = min(qq[r, i], 0.0)
            for j in range(j0, min(n, j0 + group)):
                hi_ = bmax[at[h, j // per], j % per]
                lo_ = bmin[at[h, j // per], j % per]
                for r in range(rows):
                    acc = np.float32(0.0)
                    for i in range(dim):
                        acc += qp[r, i] * hi_[i] + qn[r, i] * lo_[i]
                    x[r] = acc - m[h, r]
                out[h, j] = lse_rows(x)


@jit_inf
def far_rescore(q: Any, pk: Any, slots: Any, blk: Any, at: Any, b: int, m0: Any, e: int,
                s0: int, split: int, cl: Any, sl: Any, ch: Any, sh: Any, out: Any) -> None:
    """cpu_kernels.far_rescore into out (H, m): block j of head h is the b keys
    pk[slots[h, j], h, blk[h, j] * b:...], starting at token at[h, j] * b."""
    heads, n = at.shape
    rows, dim = q.shape[1], q.shape[2]
    c = np.empty(cl.shape[1], np.float32)
    s = np.empty(cl.shape[1], np.float32)
    qq = np.empty((rows, dim), np.float32)
    x = np.empty(rows, np.float32)
    for h in range(heads):
        for j in range(n):
            st = at[h, j] * b
            angles(-(e + s0 - st) if st < e else 0, split, cl, sl, ch, sh, c, s)
            keys = pk[slots[h, j], h, blk[h, j] * b:(blk[h, j] + 1) * b]
            for r in range(rows):
                turn(q[h, r], c, s, qq[r])
                best = np.float32(-np.inf)
                for t in range(b):
                    acc = np.float32(0.0)
                    for i in range(dim):
                        acc += qq[r, i] * keys[t, i]
                    if acc > best:
                        best = acc
                x[r] = best - m0[h, r]
            out[h, j] = lse_rows(x)


@jit_inf
def attend_blocks(q: Any, pk: Any, pv: Any, slots: Any, blk: Any, delta: Any, b: int,
                  split: int, cl: Any, sl: Any, ch: Any, sh: Any, m_out: Any, l_out: Any,
                  o_out: Any) -> None:
    """cpu_kernels.attend into m_out, l_out, o_out."""
    heads, rows, dim = q.shape
    n = slots.shape[1]
    c = np.empty(cl.shape[1], np.float32)
    s = np.empty(cl.shape[1], np.float32)
    key = np.empty(dim, np.float32)
    p = np.empty((rows, n * b), np.float32)
    for h in range(heads):
        for j in range(n):  # logits, each block's keys rotated by its delta on the way
            d = delta[h, j]
            if d != 0:
                angles(d, split, cl, sl, ch, sh, c, s)
            for t in range(b):
                src = pk[slots[h, j], h, blk[h, j] * b + t]
                if d != 0:
                    turn(src, c, s, key)
                    kk = key
                else:
                    kk = src  # read in place: no copy of an unmoved key
                for r in range(rows):
                    acc = np.float32(0.0)
                    for i in range(dim):
                        acc += q[h, r, i] * kk[i]
                    p[r, j * b + t] = acc
        for r in range(rows):  # softmax partial: max, exp, sum
            top = -np.inf
            for x in range(n * b):
                top = max(top, p[r, x])
            total = np.float32(0.0)
            for x in range(n * b):
                w = np.exp(p[r, x] - top)
                p[r, x] = w
                total += w
            m_out[h, r] = top
            l_out[h, r] = total
            o_out[h, r, :] = 0.0
        for j in range(n):  # weights x values
            for t in range(b):
                v = pv[slots[h, j], h, blk[h, j] * b + t]
                for r in range(rows):
                    w = p[r, j * b + t]
                    for i in range(v.shape[0]):
                        o_out[h, r, i] += w * v[i]

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


# exp(x) for float32 as arithmetic LLVM vectorizes (numba calls libm's expf one value at a
# time): x = k ln2 + r, |r| <= ln2/2, exp(r) by Cephes' expf polynomial (relative error
# ~1e-7), 2^k built in an int32 array viewed as float32. Arguments are clamped to
# [EXP_LO, EXP_HI]: -inf gives ~1e-38, not 0, which no sum here can tell apart.
EXP_LO = np.float32(-87.0)
EXP_HI = np.float32(88.0)
LOG2E = np.float32(1.44269504)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)


@jit_inf  # -inf arguments are clamped: with full fastmath LLVM may assume there are none
def exp_into(x: Any, shift: Any, out: Any, bits: Any) -> None:
    """out[i] = exp(x[i] - shift[i]) over 1-d float32 arrays; bits: int32 scratch (n,)."""
    for i in range(x.shape[0]):
        t = min(max(x[i] - shift[i], EXP_LO), EXP_HI)
        k = np.floor(t * LOG2E + np.float32(0.5))
        r = t - k * LN2_HI - k * LN2_LO
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        out[i] = p * r * r + r + np.float32(1.0)
        bits[i] = (np.int32(k) + np.int32(127)) << 23
    scale = bits[:x.shape[0]].view(np.float32)
    for i in range(x.shape[0]):
        out[i] *= scale[i]


@jit_inf
def lse_cols(x: Any, out: Any, top: Any, total: Any, e: Any, bits: Any) -> None:
    """out[j] = cpu_select.lse of column j of x (R, n): -inf where the column is all -inf;
    top, total, e: float32 scratch (n,), bits: int32 (n,)."""
    rows, n = x.shape
    for j in range(n):
        top[j] = x[0, j]
    for r in range(1, rows):
        for j in range(n):
            top[j] = max(top[j], x[r, j])
    for j in range(n):
        out[j] = top[j]
        total[j] = 0.0
        if not np.isfinite(top[j]):
            top[j] = 0.0
    for r in range(rows):
        exp_into(x[r], top, e, bits)
        for j in range(n):
            total[j] += e[j]
    for j in range(n):
        out[j] = np.log(total[j]) + top[j] if out[j] > -np.inf else -np.inf


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
    x = np.empty((rows, n), np.float32)
    top = np.empty(n, np.float32)
    total = np.empty(n, np.float32)
    ex = np.empty(n, np.float32)
    bits = np.empty(n, np.int32)
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
                    x[r, j] = acc - m[h, r]
        lse_cols(x, out[h], top, total, ex, bits)


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
    x = np.empty((rows, n), np.float32)
    top = np.empty(n, np.float32)
    total = np.empty(n, np.float32)
    ex = np.empty(n, np.float32)
    bits = np.empty(n, np.int32)
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
                x[r, j] = best - m0[h, r]
        lse_cols(x, out[h], top, total, ex, bits)


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
    top = np.empty(n * b, np.float32)
    bits = np.empty(n * b, np.int32)
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
            big = -np.inf
            for x in range(n * b):
                big = max(big, p[r, x])
            top[:] = big
            exp_into(p[r], top, p[r], bits)
            total = np.float32(0.0)
            for x in range(n * b):
                total += p[r, x]
            m_out[h, r] = big
            l_out[h, r] = total
            o_out[h, r, :] = 0.0
        for j in range(n):  # weights x values
            for t in range(b):
                v = pv[slots[h, j], h, blk[h, j] * b + t]
                for r in range(rows):
                    w = p[r, j * b + t]
                    for i in range(v.shape[0]):
                        o_out[h, r, i] += w * v[i]


@jit_inf
def page_weights(p: Any, m: Any, total: Any, acc: Any, acc2: Any, shift: Any, bits: Any
                 ) -> None:
    """One page's logits p (R, P) turned into softmax weights in place against each row's
    running max m (R,), their sums added to total (R,): where a row's page max passes m, the
    row's total and its accumulators acc (R, X) and acc2 (R, Y) shrink to the new max first
    (an online softmax). shift: float32 scratch (P,), bits: int32 (P,)."""
    rows, size = p.shape
    for r in range(rows):
        big = p[r, 0]
        for t in range(1, size):
            big = max(big, p[r, t])
        if big > m[r]:
            c = np.exp(m[r] - big)
            total[r] *= c
            for i in range(acc.shape[1]):
                acc[r, i] *= c
            for i in range(acc2.shape[1]):
                acc2[r, i] *= c
            m[r] = big
        shift[:] = m[r]
        exp_into(p[r], shift, p[r], bits)
        s = np.float32(0.0)
        for t in range(size):
            s += p[r, t]
        total[r] += s


@jit_inf
def dense_pages(q: Any, pk: Any, pv: Any, lo: int, hi: int, m_out: Any, l_out: Any,
                o_out: Any) -> None:
    """cpu_kernels.dense_pages into m_out, l_out, o_out: pages [lo, hi) of pk, pv (n, H, P,
    D), one page at a time (online softmax), so that each key and value is read once."""
    heads, rows, dim = q.shape
    size = pk.shape[2]
    dv = pv.shape[3]
    p = np.empty((rows, size), np.float32)
    shift = np.empty(size, np.float32)
    bits = np.empty(size, np.int32)
    qq = np.empty((rows, dim), np.float32)
    o = np.empty((rows, dv), np.float32)  # a local accumulator: LLVM sees it alias nothing
    m = np.empty(rows, np.float32)
    total = np.empty(rows, np.float32)
    none = np.empty((rows, 0), np.float32)
    for h in range(heads):
        for r in range(rows):
            m[r] = -np.inf
            total[r] = 0.0
            qq[r] = q[h, r]
            o[r] = 0.0
        for n in range(lo, hi):
            keys = pk[n, h]
            vals = pv[n, h]
            for t in range(size):
                for r in range(rows):
                    acc = np.float32(0.0)
                    for i in range(dim):
                        acc += qq[r, i] * keys[t, i]
                    p[r, t] = acc
            page_weights(p, m, total, o, none, shift, bits)
            for t in range(size):
                for r in range(rows):
                    w = p[r, t]
                    for i in range(dv):
                        o[r, i] += w * vals[t, i]
        for r in range(rows):
            m_out[h, r] = m[r]
            l_out[h, r] = total[r]
            o_out[h, r] = o[r]


@jit
def codes_into(codes: Any, half: bool, out: Any) -> None:
    """A page's codes (P, W) uint8 as floats into out (2, P, W): at 4 bits (`half`) the low
    nibbles (values 2j) in out[0] and the high ones (2j + 1) in out[1]. (A page a call: a
    call a key cost ~20% of the loop.)"""
    for t in range(codes.shape[0]):
        if half:
            for j in range(codes.shape[1]):
                out[0, t, j] = np.float32(codes[t, j] & 15)
                out[1, t, j] = np.float32(codes[t, j] >> 4)
        else:
            for j in range(codes.shape[1]):
                out[0, t, j] = np.float32(codes[t, j])


@jit_inf
def dense_pages_q(q: Any, kc: Any, ks: Any, kb: Any, vc: Any, vs: Any, vb: Any, bits: int,
                  lo: int, hi: int, m_out: Any, l_out: Any, o_out: Any) -> None:
    """cpu_kernels.dense_pages_q into m_out, l_out, o_out: `dense_pages` over pages quantized
    group-wise (codes kc, vc (n, H, P, D * bits // 8) uint8, low nibble first at 4 bits;
    scales and biases (n, H, P, groups)), read as codes: a key's logit is each group's
    scale x (q . codes) + bias x sum(q); a value's weight goes to the codes and the bias
    apart. A quarter of the keys' and values' bytes at 8 bits, no decoded copy. (Inner
    loops run from 0 with an offset: `range(a, b)` kept LLVM from vectorizing them, 5x.)"""
    heads, rows, dim = q.shape
    size = kc.shape[2]
    groups = ks.shape[3]
    vgroups = vs.shape[3]
    width = kc.shape[3]  # bytes a key
    vwidth = vc.shape[3]
    wk = width // groups  # bytes a group
    wv = vwidth // vgroups
    half = bits == 4
    p = np.empty((rows, size), np.float32)
    shift = np.empty(size, np.float32)
    ebits = np.empty(size, np.int32)
    # A key's codes as floats; at 4 bits byte j holds values 2j (low nibble) and 2j + 1, and
    # the query, a key and the output are kept as even and odd halves so that the loops run
    # over bytes.
    qq = np.zeros((rows, 2, width), np.float32)
    kf = np.zeros((2, size, width), np.float32)  # a page's keys' codes as floats
    vf = np.zeros((2, size, vwidth), np.float32)
    o = np.empty((rows, 2, vwidth), np.float32)
    qsum = np.empty((rows, groups), np.float32)
    ob = np.empty((rows, vgroups), np.float32)  # the values' biases' share
    m = np.empty(rows, np.float32)
    total = np.empty(rows, np.float32)
    for h in range(heads):
        for r in range(rows):
            m[r] = -np.inf
            total[r] = 0.0
            for i in range(dim):
                if half:
                    qq[r, i % 2, i // 2] = q[h, r, i]
                else:
                    qq[r, 0, i] = q[h, r, i]
            for g in range(groups):
                acc = np.float32(0.0)
                base = g * (dim // groups)
                for i in range(dim // groups):
                    acc += q[h, r, base + i]
                qsum[r, g] = acc
            o[r] = 0.0
            ob[r] = 0.0
        for n in range(lo, hi):
            kcn, ksn, kbn = kc[n, h], ks[n, h], kb[n, h]
            vcn, vsn, vbn = vc[n, h], vs[n, h], vb[n, h]
            codes_into(kcn, half, kf)
            for t in range(size):
                for r in range(rows):
                    s = np.float32(0.0)
                    for g in range(groups):
                        base = g * wk
                        acc = np.float32(0.0)
                        for j in range(wk):
                            acc += qq[r, 0, base + j] * kf[0, t, base + j]
                        if half:
                            for j in range(wk):
                                acc += qq[r, 1, base + j] * kf[1, t, base + j]
                        s += ksn[t, g] * acc + kbn[t, g] * qsum[r, g]
                    p[r, t] = s
            page_weights(p, m, total, o.reshape(rows, 2 * vwidth), ob, shift, ebits)
            codes_into(vcn, half, vf)
            for t in range(size):
                for r in range(rows):
                    w = p[r, t]
                    for g in range(vgroups):
                        ws = w * vsn[t, g]
                        ob[r, g] += w * vbn[t, g]
                        base = g * wv
                        for j in range(wv):
                            o[r, 0, base + j] += ws * vf[0, t, base + j]
                        if half:
                            for j in range(wv):
                                o[r, 1, base + j] += ws * vf[1, t, base + j]
        dv = o_out.shape[2]
        for r in range(rows):
            m_out[h, r] = m[r]
            l_out[h, r] = total[r]
            for i in range(dv):
                x = o[r, i % 2, i // 2] if half else o[r, 0, i]
                o_out[h, r, i] = x + ob[r, i // (dv // vgroups)]

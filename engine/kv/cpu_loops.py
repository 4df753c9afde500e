"""The numba loops behind engine.kv.cpu_kernels (imported only there, and only when numba is
installed: importing this module imports numba).

Contract: each function is compiled on first use and cached on disk (`cache=True`); they are
defined at module level because numba caches no function that calls jitted functions held in
a closure (it recompiled each, ~1.2 s, in every process). They check no bounds:
cpu_kernels checks the shapes and indices before calling them. Importing this module turns
on LLVM's SLP vectorizer for every numba compilation in the process (numba's default is
off; Strata's loops are the process's only numba code).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils
from numba.core import types as nbt
from numba.extending import intrinsic, overload

# LLVM's SLP vectorizer (numba leaves it off) packs runs of scalar accumulators into vector
# registers (`weigh_values`); it must be on before the first compilation in the process.
numba.config.SLP_VECTORIZE = 1  # type: ignore[attr-defined]
jit = numba.njit(cache=True, nogil=True, fastmath=True)
# The loops with -inf in them (running maxima, logsumexp) keep IEEE infinities: numba's full
# fastmath lets LLVM assume there are none.
jit_inf = numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "arcp"})
# Sums run in float32 (`np.float32(0.0)`): a float64 accumulator of float32 products kept
# the dot products from vectorizing (the attention loop 0.68 ms against 0.54).


# A decode step's page pass runs right after MLX's matrix products have evicted the caches,
# and the hardware prefetchers stop at every 4 KB page: asking for the pages AHEAD pages on
# while one is attended made a starter step at 16k ~13% faster (docs/benchmarks.md).
AHEAD = 2
# The same for the sparse loops' blocks of 8 keys, each a random read (~0.9 us from DRAM).
BLOCKS_AHEAD = 4


@intrinsic
def _prefetch(typingctx: Any, arr: Any, offset: Any) -> Any:
    """Ask for the cache line at byte `offset` of array arr's data (llvm.prefetch: a read,
    kept in every cache level; never faults, whatever the address)."""
    sig = nbt.void(arr, offset)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        byte = ir.IntType(8).as_pointer()
        at = builder.gep(builder.bitcast(data, byte), [args[1]])
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@jit
def prefetch_part(a: Any, part: int, parts: int) -> None:
    """Prefetch the part-th of `parts` equal runs of cache lines of the C-contiguous array a
    (a page to come, spread over the keys of the one attended now)."""
    lines = (a.size * a.itemsize + 63) // 64
    per = (lines + parts - 1) // parts
    for j in range(part * per, min(lines, (part + 1) * per)):
        _prefetch(a, j * 64)  # type: ignore[call-arg]  # (numba supplies typingctx)


@jit
def prefetch_block(a: Any, slot: int, h: int, t0: int, n: int) -> None:
    """Prefetch rows t0..t0 + n of a[slot, h] (a pool (slots, H, P, D) whose rows are
    contiguous), computed from the strides: a view made for it cost ~40 cycles a block."""
    start = slot * a.strides[0] + h * a.strides[1] + t0 * a.strides[2]
    for off in range(start - start % 64, start + n * a.strides[2], 64):
        _prefetch(a, off)  # type: ignore[call-arg]  # (numba supplies typingctx)


@intrinsic
def _half(typingctx: Any, bits: Any) -> Any:
    """The float16 whose bits are the uint16 `bits`, as float32 (vcvtph2ps on x86-64)."""
    sig = nbt.float32(nbt.uint16)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


def as_f32(x: Any) -> Any:
    """x as float32: float16 bits (uint16) decoded, a float converted (compiled code only)."""
    raise NotImplementedError("as_f32 runs in compiled loops only")


@overload(as_f32)
def _as_f32(x: Any) -> Any:
    if x == nbt.uint16:
        def decoded(x: Any) -> Any:
            return _half(x)  # type: ignore[call-arg]  # (numba supplies typingctx)
        return decoded
    if isinstance(x, nbt.Float):
        def converted(x: Any) -> Any:
            return np.float32(x)
        return converted
    return None


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
def turn_rows(x: Any, c: Any, s: Any, out: Any) -> None:
    """Each row of x (R, D) rotated by angles c, s (halves layout) into out (R, D). Where a
    loop turned row views one by one (`turn(q[r], ...)`), the views cost more than the
    arithmetic: 359 -> 107 cycles for angles and three rows."""
    half = c.shape[0]
    for r in range(x.shape[0]):
        for i in range(half):
            x1 = x[r, i]
            x2 = x[r, i + half]
            out[r, i] = x1 * c[i] - x2 * s[i]
            out[r, i + half] = x1 * s[i] + x2 * c[i]
        for i in range(2 * half, x.shape[1]):
            out[r, i] = x[r, i]


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
def exp_parts(x: Any) -> tuple[Any, Any]:
    """exp(x) for one float32 as (mantissa part, 2^k as int32 bits to view as float32): the
    product is exp(x). Inlined into the callers' loops, which LLVM then vectorizes."""
    t = min(max(x, EXP_LO), EXP_HI)
    k = np.floor(t * LOG2E + np.float32(0.5))
    r = t - k * LN2_HI - k * LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return p * r * r + r + np.float32(1.0), (np.int32(k) + np.int32(127)) << 23


@jit_inf
def exp_into(x: Any, shift: Any, out: Any, bits: Any) -> None:
    """out[i] = exp(x[i] - shift[i]) over 1-d float32 arrays; bits: int32 scratch (n,)."""
    for i in range(x.shape[0]):
        out[i], bits[i] = exp_parts(x[i] - shift[i])
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
    for h in range(out.shape[0]):
        bound_head(bmin, bmax, at[h], q[h], m[h], starts[h if starts.shape[0] > 1 else 0],
                   e, s0, group, split, cl, sl, ch, sh, out[h])


@jit_inf
def bound_head(bmin: Any, bmax: Any, at: Any, q: Any, m: Any, starts: Any, e: int, s0: int,
               group: int, split: int, cl: Any, sl: Any, ch: Any, sh: Any, out: Any) -> None:
    """One head's far bound into out (n,): candidate j has the summaries bmin/bmax[at[j //
    per], j % per] (float32, or float16 as uint16 bits); q (R, D), m (R,), starts (n,); each
    run of `group` candidates scored with q rotated back by its first start's far shift
    (none from E on)."""
    n = out.shape[0]
    per, dim = bmax.shape[1], bmax.shape[2]
    rows = q.shape[0]
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
    # Four candidates' summaries as float32 at a time: their bounds share each load of the
    # rows and run as four sums at once, where one sum a candidate and row waited on its own
    # reduction (138 -> 82 us for a 32k step's 3 x 1,024 blocks, warm).
    hs = np.empty((4, dim), np.float32)
    ls = np.empty((4, dim), np.float32)
    for j0 in range(0, n, group):
        st = starts[j0]
        if st < e:
            angles(-(e + s0 - st), split, cl, sl, ch, sh, c, s)
            turn_rows(q, c, s, qq)
        else:
            qq[:] = q
        for r in range(rows):
            for i in range(dim):
                qp[r, i] = max(qq[r, i], 0.0)
                qn[r, i] = min(qq[r, i], 0.0)
        j1 = min(n, j0 + group)
        for j in range(j0, j1, 4):
            w = min(4, j1 - j)
            for u in range(4):
                if u < w:  # indexed in place: a view a candidate cost more than its sums
                    pg = at[(j + u) // per]
                    t = (j + u) % per
                    for i in range(dim):
                        hs[u, i] = as_f32(bmax[pg, t, i])
                        ls[u, i] = as_f32(bmin[pg, t, i])
                else:
                    hs[u, :] = 0.0
                    ls[u, :] = 0.0
            for r in range(rows):
                a0 = np.float32(0.0)
                a1 = np.float32(0.0)
                a2 = np.float32(0.0)
                a3 = np.float32(0.0)
                for i in range(dim):
                    up = qp[r, i]
                    dn = qn[r, i]
                    a0 += up * hs[0, i] + dn * ls[0, i]
                    a1 += up * hs[1, i] + dn * ls[1, i]
                    a2 += up * hs[2, i] + dn * ls[2, i]
                    a3 += up * hs[3, i] + dn * ls[3, i]
                x[r, j] = a0 - m[r]
                if w > 1:
                    x[r, j + 1] = a1 - m[r]
                if w > 2:
                    x[r, j + 2] = a2 - m[r]
                if w > 3:
                    x[r, j + 3] = a3 - m[r]
    lse_cols(x, out, top, total, ex, bits)


@jit
def key_logits(q: Any, r: int, pk: Any, slot: int, h: int, t0: int, b: int, out: Any,
               row: int, col: int) -> None:
    """Row r of q (R, D) dotted with each of the b keys pk[slot, h, t0:t0 + b] into
    out[row, col:col + b]: four keys' sums at once (they share each load of the row, where
    one sum a key waited on its own reduction), each key indexed in place (a view a key
    cost more than its sums)."""
    dim = q.shape[1]
    t = 0
    while t + 4 <= b:
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        for i in range(dim):
            qv = q[r, i]
            a0 += qv * pk[slot, h, t0 + t, i]
            a1 += qv * pk[slot, h, t0 + t + 1, i]
            a2 += qv * pk[slot, h, t0 + t + 2, i]
            a3 += qv * pk[slot, h, t0 + t + 3, i]
        out[row, col + t] = a0
        out[row, col + t + 1] = a1
        out[row, col + t + 2] = a2
        out[row, col + t + 3] = a3
        t += 4
    while t < b:
        acc = np.float32(0.0)
        for i in range(dim):
            acc += q[r, i] * pk[slot, h, t0 + t, i]
        out[row, col + t] = acc
        t += 1


@jit_inf
def far_rescore(q: Any, pk: Any, slots: Any, blk: Any, at: Any, b: int, m0: Any, e: int,
                s0: int, split: int, cl: Any, sl: Any, ch: Any, sh: Any, out: Any) -> None:
    """cpu_kernels.far_rescore into out (H, m): block j of head h is the b keys
    pk[slots[h, j], h, blk[h, j] * b:...], starting at token at[h, j] * b."""
    for h in range(at.shape[0]):
        rescore_head(q[h], pk, h, slots[h], blk[h], at[h], b, m0[h], e, s0, split, cl, sl,
                     ch, sh, out[h])


@jit_inf
def rescore_head(q: Any, pk: Any, h: int, slots: Any, blk: Any, at: Any, b: int, m0: Any,
                 e: int, s0: int, split: int, cl: Any, sl: Any, ch: Any, sh: Any, out: Any
                 ) -> None:
    """Head h's true logits into out (m,): the logsumexp over rows of q (R, D) of block j's
    largest q.k minus m0 (R,), its b keys pk[slots[j], h, blk[j] * b:...] starting at token
    at[j] * b (q rotated back by its far shift, none from E on)."""
    n = at.shape[0]
    rows, dim = q.shape
    c = np.empty(cl.shape[1], np.float32)
    s = np.empty(cl.shape[1], np.float32)
    qq = np.empty((rows, dim), np.float32)
    x = np.empty((rows, n), np.float32)
    top = np.empty(n, np.float32)
    total = np.empty(n, np.float32)
    ex = np.empty(n, np.float32)
    bits = np.empty(n, np.int32)
    lg = np.empty((1, b), np.float32)
    for j in range(n):
        if j + BLOCKS_AHEAD < n:  # a block's keys are a random 2 KB read: ask early
            a = j + BLOCKS_AHEAD
            prefetch_block(pk, slots[a], h, blk[a] * b, b)
        # rotated back as in bound_head, written out again: a shared helper, even inlined,
        # made `choose` 0.1-0.3 ms a layer slower at 32k (alternated runs)
        st = at[j] * b
        if st < e:
            angles(-(e + s0 - st), split, cl, sl, ch, sh, c, s)
            turn_rows(q, c, s, qq)
        else:
            qq[:] = q
        for r in range(rows):
            key_logits(qq, r, pk, slots[j], h, blk[j] * b, b, lg, 0, 0)
            best = lg[0, 0]
            for t in range(1, b):
                best = max(best, lg[0, t])
            x[r, j] = best - m0[r]
    lse_cols(x, out, top, total, ex, bits)


@jit_inf
def top_k(x: Any, k: int, idx: Any) -> None:
    """The indices of the k largest values of x (n,) into idx[:k], in no set order (ties
    taken first by index): np.argpartition's choice up to ties (numba has no argpartition)."""
    n = x.shape[0]
    if k >= n:
        for i in range(n):
            idx[i] = i
        return
    thr = np.partition(x, n - k)[n - k]  # the k-th largest
    j = 0
    for i in range(n):
        if x[i] > thr:
            idx[j] = i
            j += 1
    for i in range(n):
        if j >= k:
            break
        if x[i] == thr:
            idx[j] = i
            j += 1


@jit_inf
def choose(pmin: Any, pmax: Any, bmin16: Any, bmax16: Any, q: Any, m0: Any, lo: int, c: int,
           n_first: int, page_run: int, nb: int, b: int, e: int, s0: int, split: int,
           cl: Any, sl: Any, ch: Any, sh: Any, voted: Any, n_blocks: int, read_pages: int,
           m: int, pk: Any, slot_of: Any, identity: bool, out: Any) -> None:
    """cpu_kernels.choose into out (H, k). With more than 2 n_first candidate pages, each
    head's n_first best by the page bound (pools pmin/pmax (N H, 1, D): page p of head h is
    row p H + h; far runs of page_run pages), else every page; then `choose_blocks` over
    their blocks' float16 summaries (bmin16/bmax16 (H, N nb D) as uint16 bits), read where
    they lie: a float32 copy of the rows read (the loop's cache before) doubled the bytes a
    step reads and cost conversions whenever the candidates moved."""
    heads = q.shape[0]
    dim = q.shape[2]
    P = nb * b
    n_pick = n_first if c > 2 * n_first else c
    first = np.empty((heads, n_pick), np.int64)
    if n_pick < c:
        prow = np.empty(c, np.int64)
        starts = np.empty(c, np.int64)
        ps = np.empty(c, np.float32)
        for h in range(heads):
            for i in range(c):
                prow[i] = (lo + i) * heads + h
                starts[i] = (lo + i) * P
            bound_head(pmin, pmax, prow, q[h], m0[h], starts, e, s0, page_run, split, cl, sl,
                       ch, sh, ps)
            top_k(ps, n_pick, first[h])
    else:
        for h in range(heads):
            for i in range(c):
                first[h, i] = i
    pages = bmin16.shape[1] // (nb * dim)
    rows = np.empty((heads, n_pick), np.int64)  # head h's page p is row h N + p
    for h in range(heads):
        for i in range(n_pick):
            rows[h, i] = h * pages + first[h, i] + lo
    choose_blocks(bmin16.reshape((heads * pages, nb, dim)),
                  bmax16.reshape((heads * pages, nb, dim)), rows, first, q, m0, lo, nb, b,
                  e, s0, split, cl, sl, ch, sh, voted, n_blocks, read_pages, c, m, pk,
                  slot_of, identity, out)


@jit_inf
def choose_blocks(bmin: Any, bmax: Any, rows: Any, first: Any, q: Any, m0: Any, lo: int,
                  nb: int, b: int, e: int, s0: int, split: int, cl: Any, sl: Any, ch: Any,
                  sh: Any, voted: Any, n_blocks: int, read_pages: int, c: int, m: int,
                  pk: Any, slot_of: Any, identity: bool, out: Any) -> None:
    """`choose` past the page level, into out (H, k): per head, the candidate blocks of pages
    first[h] + lo (their summaries at pools bmin/bmax[rows[h, i]], (X, nb, D)) bounded, the
    voted ones (H, v) and those outside the read_pages best of the c candidate pages dropped
    (-inf), the m best shortlisted, rescored by their true logits against the keys in pool pk
    (slots, H, P, D) and the k best kept: cpu_select's bounded and rescore, one pass."""
    heads, n_first = first.shape
    n = n_first * nb
    k = out.shape[1]
    ninf = np.float32(-np.inf)
    sc = np.empty((heads, n), np.float32)
    starts = np.empty(n, np.int64)
    for h in range(heads):
        for i in range(n_first):
            for t in range(nb):
                starts[i * nb + t] = ((first[h, i] + lo) * nb + t) * b
        bound_head(bmin, bmax, rows[h], q[h], m0[h], starts, e, s0, nb, split, cl, sl, ch,
                   sh, sc[h])
    if voted.shape[1] > 0:  # chosen already: the step chooses among the others
        mark = np.zeros(n_blocks, np.uint8)
        for h in range(heads):
            for v in range(voted.shape[1]):
                mark[voted[h, v]] = 1
            for i in range(n_first):
                base = (first[h, i] + lo) * nb
                for t in range(nb):
                    if mark[base + t]:
                        sc[h, i * nb + t] = ninf
            for v in range(voted.shape[1]):
                mark[voted[h, v]] = 0
    if read_pages < c:  # the pages a step reads: the best by any head's best block
        best = np.full(c, ninf, np.float32)
        for h in range(heads):
            for i in range(n_first):
                top = ninf
                for t in range(nb):
                    top = max(top, sc[h, i * nb + t])
                best[first[h, i]] = max(best[first[h, i]], top)
        keep = np.empty(c, np.int64)
        top_k(best, read_pages, keep)
        chosen = np.zeros(c, np.uint8)
        for i in range(read_pages):
            chosen[keep[i]] = 1
        for h in range(heads):
            for i in range(n_first):
                if not chosen[first[h, i]]:
                    for t in range(nb):
                        sc[h, i * nb + t] = ninf
    m = min(m, n)
    pre = np.empty(n, np.int64)
    at = np.empty(m, np.int64)
    slots = np.empty(m, np.int64)
    blk = np.empty(m, np.int64)
    true = np.empty(m, np.float32)
    pick = np.empty(m, np.int64)
    for h in range(heads):
        top_k(sc[h], m, pre)
        for j in range(m):
            a = (first[h, pre[j] // nb] + lo) * nb + pre[j] % nb
            at[j] = a
            slots[j] = a // nb if identity else slot_of[a // nb]
            blk[j] = a % nb
        rescore_head(q[h], pk, h, slots, blk, at, b, m0[h], e, s0, split, cl, sl, ch, sh,
                     true)
        for j in range(m):
            if sc[h, pre[j]] == ninf:
                true[j] = ninf
        top_k(true, k, pick)
        for j in range(k):
            out[h, j] = at[pick[j]]


@jit_inf
def attend_head(q: Any, pk: Any, pv: Any, h: int, slots: Any, blk: Any, delta: Any, b: int,
                split: int, cl: Any, sl: Any, ch: Any, sh: Any, m_in: Any, l_in: Any,
                o_in: Any, m_out: Any, l_out: Any, o_out: Any) -> None:
    """Head h's softmax partial into m_out, l_out (R,), o_out (R, Dv): queries q (R, D) over
    blocks j (b keys pk/pv[slots[j], h, blk[j] * b:...]), block j's keys turned by delta[j]
    positions, merged with m_in, l_in, o_in. A turned block's logits come from the query
    rows rotated back (rows, not the block's b keys, are rotated); the values are summed a
    block at a time by `weigh_values` straight from the pool, where a loop over the columns
    inside the keys loaded and stored the output row for every key (in a warm cache with
    half the blocks moved, 1.24 -> 0.96 ms for 3 heads x 256 blocks)."""
    rows, dim = q.shape
    n = slots.shape[0]
    dv = pv.shape[3]
    c = np.empty(cl.shape[1], np.float32)
    s = np.empty(cl.shape[1], np.float32)
    p = np.empty((rows, n * b), np.float32)
    top = np.empty(n * b, np.float32)
    bits = np.empty(n * b, np.int32)
    o = np.empty((rows, dv), np.float32)
    qq = np.empty((rows, dim), np.float32)  # local: LLVM sees the logits' stores miss it
    qr = np.empty((rows, dim), np.float32)
    qq[:] = q
    turned = 0  # the shift qr holds the rows turned by (0: none yet)
    for j in range(n):  # logits
        d = delta[j]
        qs = qq
        if d != 0:
            # q . R(d) k = R(-d) q . k: the rows rotated back, not the block's b keys; the
            # sinks share one shift, and so do neighbouring chosen blocks (turned once)
            if d != turned:
                angles(-d, split, cl, sl, ch, sh, c, s)
                turn_rows(qq, c, s, qr)
                turned = d
            qs = qr
        if j + BLOCKS_AHEAD < n:  # keys to come
            a = j + BLOCKS_AHEAD
            prefetch_block(pk, slots[a], h, blk[a] * b, b)
        for r in range(rows):
            key_logits(qs, r, pk, slots[j], h, blk[j] * b, b, p, r, j * b)
    for r in range(rows):  # softmax partial: max, exp, sum, merged with the given one
        big = max(row_max(p, r), m_in[r])
        top[:] = big
        exp_into(p[r], top, p[r], bits)
        total = np.float32(0.0)
        for x in range(n * b):
            total += p[r, x]
        was = np.exp(m_in[r] - big)  # 0 for none (-inf)
        m_out[r] = big
        l_out[r] = l_in[r] * was + total
        for i in range(dv):
            o[r, i] = o_in[r, i] * was
    for j in range(n):  # weights x values, a block at a time read in place
        first = blk[j] * b
        if j + BLOCKS_AHEAD < n:  # values to come (asked for with the keys, 10-16% slower)
            a = j + BLOCKS_AHEAD
            prefetch_block(pv, slots[a], h, blk[a] * b, b)
        weigh_values(p[:, j * b:(j + 1) * b], pv[slots[j], h, first:first + b], 0, dv, o, 0)
    o_out[:] = o


@jit_inf
def attend_chosen(q: Any, pk: Any, pv: Any, chosen: Any, sink: int, hi: int, n_pages: int,
                  nb: int, b: int, turned: bool, reach: bool, end: int, trained: int,
                  slot_of: Any, identity: bool, split: int, cl: Any, sl: Any, ch: Any,
                  sh: Any, m_in: Any, l_in: Any, o_in: Any, m_out: Any, l_out: Any,
                  o_out: Any, h0: int) -> None:
    """cpu_kernels.attend_chosen: per head, the sink pages' blocks, the chosen blocks in
    position order and the window's, placed as remap.block_deltas places them when `turned`
    (LAYOUT "reach" when `reach`, else "infllm"), attended by `attend_head`. Row h of q,
    chosen and the partials is the pools' head h0 + h (a thread's share of the heads)."""
    heads, k = chosen.shape
    n_sink = sink * nb
    n = n_sink + k + (n_pages - hi) * nb
    P = nb * b
    S, K, W0 = sink * P, k * b, hi * P
    E = end - trained
    near = reach and trained > 0 and 0 <= E <= W0 - S - K
    shift = E if near else W0 - S - K
    slots = np.empty(n, np.int64)
    blk = np.empty(n, np.int64)
    delta = np.zeros(n, np.int64)
    for h in range(heads):
        top = np.sort(chosen[h])
        for j in range(n):
            if j < n_sink:
                a = j
            elif j < n_sink + k:
                a = top[j - n_sink]
            else:
                a = hi * nb + j - n_sink - k
            slots[j] = a // nb if identity else slot_of[a // nb]
            blk[j] = a % nb
            if turned:
                if j < n_sink:
                    delta[j] = shift
                elif j < n_sink + k:
                    step = (j - n_sink) * b - top[j - n_sink] * b  # j b - s_j
                    delta[j] = max(step + E + S, 0) if near else step + W0 - K
        attend_head(q[h], pk, pv, h0 + h, slots, blk, delta, b, split, cl, sl, ch, sh,
                    m_in[h], l_in[h], o_in[h], m_out[h], l_out[h], o_out[h])


@jit  # logits are finite
def row_max(p: Any, r: int) -> Any:
    """The largest of row r of p (R, n)."""
    big = p[r, 0]
    for t in range(1, p.shape[1]):
        big = max(big, p[r, t])
    return big


@jit_inf
def page_weights(p: Any, m: Any, total: Any, acc: Any, bits: Any) -> None:
    """One page's logits p (R, P) turned into softmax weights in place against each row's
    running max m (R,), their sums added to total (R,): where a row's page max passes m, the
    row's total and its accumulator acc (R, X) shrink to the new max first
    (an online softmax). bits: int32 scratch (P,). (Rows indexed in place, the exp inlined:
    a call of exp_into on each row's slice cost 3x.)"""
    rows, size = p.shape
    scale = bits[:size].view(np.float32)
    for r in range(rows):
        big = row_max(p, r)
        if big > m[r]:
            c = np.exp(m[r] - big)
            total[r] *= c
            for i in range(acc.shape[1]):
                acc[r, i] *= c
            m[r] = big
        mr = m[r]
        for t in range(size):
            p[r, t], bits[t] = exp_parts(p[r, t] - mr)
        s = np.float32(0.0)
        for t in range(size):
            w = p[r, t] * scale[t]
            p[r, t] = w
            s += w
        total[r] += s


@jit
def weigh_values(w: Any, vals: Any, col: int, width: int, o: Any, ocol: int) -> None:
    """o[:, ocol:ocol + width] (R, width) += w (R, T) @ vals[:, col:col + width] (T, width), each
    row's output in runs of 32 columns held in 32 scalars across the keys (the SLP
    vectorizer packs them into registers), where a loop over the columns inside the keys
    loaded and stored the output row for every key (the exact loop -30%)."""
    rows, size = w.shape
    full = width - width % 32
    for r in range(rows):
        for c in range(col, col + full, 32):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            a4 = np.float32(0.0)
            a5 = np.float32(0.0)
            a6 = np.float32(0.0)
            a7 = np.float32(0.0)
            a8 = np.float32(0.0)
            a9 = np.float32(0.0)
            a10 = np.float32(0.0)
            a11 = np.float32(0.0)
            a12 = np.float32(0.0)
            a13 = np.float32(0.0)
            a14 = np.float32(0.0)
            a15 = np.float32(0.0)
            a16 = np.float32(0.0)
            a17 = np.float32(0.0)
            a18 = np.float32(0.0)
            a19 = np.float32(0.0)
            a20 = np.float32(0.0)
            a21 = np.float32(0.0)
            a22 = np.float32(0.0)
            a23 = np.float32(0.0)
            a24 = np.float32(0.0)
            a25 = np.float32(0.0)
            a26 = np.float32(0.0)
            a27 = np.float32(0.0)
            a28 = np.float32(0.0)
            a29 = np.float32(0.0)
            a30 = np.float32(0.0)
            a31 = np.float32(0.0)
            for t in range(size):
                x = w[r, t]
                v = vals[t]
                a0 += x * v[c + 0]
                a1 += x * v[c + 1]
                a2 += x * v[c + 2]
                a3 += x * v[c + 3]
                a4 += x * v[c + 4]
                a5 += x * v[c + 5]
                a6 += x * v[c + 6]
                a7 += x * v[c + 7]
                a8 += x * v[c + 8]
                a9 += x * v[c + 9]
                a10 += x * v[c + 10]
                a11 += x * v[c + 11]
                a12 += x * v[c + 12]
                a13 += x * v[c + 13]
                a14 += x * v[c + 14]
                a15 += x * v[c + 15]
                a16 += x * v[c + 16]
                a17 += x * v[c + 17]
                a18 += x * v[c + 18]
                a19 += x * v[c + 19]
                a20 += x * v[c + 20]
                a21 += x * v[c + 21]
                a22 += x * v[c + 22]
                a23 += x * v[c + 23]
                a24 += x * v[c + 24]
                a25 += x * v[c + 25]
                a26 += x * v[c + 26]
                a27 += x * v[c + 27]
                a28 += x * v[c + 28]
                a29 += x * v[c + 29]
                a30 += x * v[c + 30]
                a31 += x * v[c + 31]
            oc = ocol + c - col
            o[r, oc + 0] += a0
            o[r, oc + 1] += a1
            o[r, oc + 2] += a2
            o[r, oc + 3] += a3
            o[r, oc + 4] += a4
            o[r, oc + 5] += a5
            o[r, oc + 6] += a6
            o[r, oc + 7] += a7
            o[r, oc + 8] += a8
            o[r, oc + 9] += a9
            o[r, oc + 10] += a10
            o[r, oc + 11] += a11
            o[r, oc + 12] += a12
            o[r, oc + 13] += a13
            o[r, oc + 14] += a14
            o[r, oc + 15] += a15
            o[r, oc + 16] += a16
            o[r, oc + 17] += a17
            o[r, oc + 18] += a18
            o[r, oc + 19] += a19
            o[r, oc + 20] += a20
            o[r, oc + 21] += a21
            o[r, oc + 22] += a22
            o[r, oc + 23] += a23
            o[r, oc + 24] += a24
            o[r, oc + 25] += a25
            o[r, oc + 26] += a26
            o[r, oc + 27] += a27
            o[r, oc + 28] += a28
            o[r, oc + 29] += a29
            o[r, oc + 30] += a30
            o[r, oc + 31] += a31
        base = col + full
        obase = ocol + full
        for t in range(size):  # the columns past the last run of 32
            x = w[r, t]
            for i in range(width - full):
                o[r, obase + i] += x * vals[t, base + i]


@jit_inf
def page_step(qq: Any, keys: Any, vals: Any, p: Any, m: Any, total: Any, o: Any, bits: Any,
              next_k: Any, next_v: Any) -> None:
    """One page of the online softmax: queries qq (R, D) against keys (P, D) and values
    (P, Dv) float32, into the running max m (R,), sum total (R,) and output o (R, Dv).
    p: float32 scratch (R, P), bits: int32 scratch (P,). next_k, next_v: the contiguous
    pages to prefetch meanwhile (any dtype; this page's own when none comes)."""
    rows, dim = qq.shape
    size = keys.shape[0]
    for t in range(size):
        prefetch_part(next_k, t, size)
        prefetch_part(next_v, t, size)
        for r in range(rows):
            acc = np.float32(0.0)
            for i in range(dim):
                acc += qq[r, i] * keys[t, i]
            p[r, t] = acc
    page_weights(p, m, total, o, bits)
    weigh_values(p, vals, 0, vals.shape[1], o, 0)


@jit
def ahead(n: int, h: int, lo: int, hi: int, heads: int) -> tuple[int, int]:
    """The (page, head) AHEAD pages after page n of head h in a pass over pages [lo, hi) of
    each head in turn; (n, h) itself past the last."""
    a = n + AHEAD
    if a < hi:
        return a, h
    if h + 1 < heads:
        return min(lo + a - hi, hi - 1), h + 1
    return n, h


@jit_inf
def dense_pages(q: Any, pk: Any, pv: Any, lo: int, hi: int, m_out: Any, l_out: Any,
                o_out: Any) -> None:
    """cpu_kernels.dense_pages into m_out, l_out, o_out: pages [lo, hi) of pk, pv (n, H, P,
    D), one page at a time (online softmax), so that each key and value is read once."""
    heads, rows, dim = q.shape
    size = pk.shape[2]
    dv = pv.shape[3]
    p = np.empty((rows, size), np.float32)
    bits = np.empty(size, np.int32)
    qq = np.empty((rows, dim), np.float32)
    o = np.empty((rows, dv), np.float32)  # a local accumulator: LLVM sees it alias nothing
    m = np.empty(rows, np.float32)
    total = np.empty(rows, np.float32)
    for h in range(heads):
        for r in range(rows):
            m[r] = -np.inf
            total[r] = 0.0
            qq[r] = q[h, r]
            o[r] = 0.0
        for n in range(lo, hi):
            a, ha = ahead(n, h, lo, hi, heads)
            page_step(qq, pk[n, h], pv[n, h], p, m, total, o, bits, pk[a, ha], pv[a, ha])
        for r in range(rows):
            m_out[h, r] = m[r]
            l_out[h, r] = total[r]
            o_out[h, r] = o[r]


@jit
def nibble_order(i: int, gw: int) -> int:
    """Where dim i sits in a page `dequant_into` decodes at 4 bits, groups of gw values:
    each group's even values first, then its odd ones (the order of the low and high
    nibbles; a dot product or a weighted sum does not mind the order of the dims)."""
    base = i - i % gw
    j = i - base
    return base + (j // 2 if j % 2 == 0 else gw // 2 + j // 2)


@jit
def dequant_into(codes: Any, scales: Any, biases: Any, half: bool, out: Any) -> None:
    """A page's codes (P, W) uint8 with their groups' scales and biases (P, G) decoded into
    out (P, D) float32: code x scale + bias, as MLX's affine dequantize. At 4 bits (`half`)
    byte j of a group holds its values 2j (low nibble) and 2j + 1 (high), decoded in
    `nibble_order` (contiguous stores). (A page into L1 at a time, then the float32 page
    step: reading the codes in the dot products and the value sums took ~1.5x the
    arithmetic at 8 bits.)"""
    size = codes.shape[0]
    groups = scales.shape[1]
    gw = out.shape[1] // groups  # values a group
    hw = gw // 2
    for t in range(size):
        for g in range(groups):
            sc = scales[t, g]
            bi = biases[t, g]
            base = g * gw
            if half:
                cb = g * hw
                for j in range(hw):
                    # the nibbles split in float arithmetic (exact below 256; 15% faster
                    # than integer masks here). Half groups of 16 still run scalar.
                    c = np.float32(codes[t, cb + j])
                    hi = np.floor(c * np.float32(0.0625))
                    out[t, base + j] = (c - hi * np.float32(16.0)) * sc + bi
                    out[t, base + hw + j] = hi * sc + bi
            else:
                for j in range(gw):
                    out[t, base + j] = np.float32(codes[t, base + j]) * sc + bi


@jit_inf
def dense_pages_q(q: Any, kc: Any, ks: Any, kb: Any, vc: Any, vs: Any, vb: Any, bits: int,
                  lo: int, hi: int, m_out: Any, l_out: Any, o_out: Any) -> None:
    """cpu_kernels.dense_pages_q into m_out, l_out, o_out: `dense_pages` over pages quantized
    group-wise (codes kc, vc (n, H, P, D * bits // 8) uint8, low nibble first at 4 bits;
    scales and biases (n, H, P, groups)): each page is decoded into a float32 scratch page
    (`dequant_into`) and attended as `dense_pages` attends one, so a step reads a quarter of
    the bytes at 8 bits and no decoded copy of the context is made."""
    heads, rows, dim = q.shape
    size = kc.shape[2]
    dv = o_out.shape[2]
    half = bits == 4
    kgw = dim // ks.shape[3]  # values a group
    vgw = dv // vs.shape[3]
    p = np.empty((rows, size), np.float32)
    ebits = np.empty(size, np.int32)
    kf = np.empty((size, dim), np.float32)
    vf = np.empty((size, dv), np.float32)
    qq = np.empty((rows, dim), np.float32)
    o = np.empty((rows, dv), np.float32)
    m = np.empty(rows, np.float32)
    total = np.empty(rows, np.float32)
    for h in range(heads):
        for r in range(rows):
            m[r] = -np.inf
            total[r] = 0.0
            for i in range(dim):
                qq[r, nibble_order(i, kgw) if half else i] = q[h, r, i]
            o[r] = 0.0
        for n in range(lo, hi):
            dequant_into(kc[n, h], ks[n, h], kb[n, h], half, kf)
            dequant_into(vc[n, h], vs[n, h], vb[n, h], half, vf)
            a, ha = ahead(n, h, lo, hi, heads)
            page_step(qq, kf, vf, p, m, total, o, ebits, kc[a, ha], vc[a, ha])
        for r in range(rows):
            m_out[h, r] = m[r]
            l_out[h, r] = total[r]
            for i in range(dv):
                o_out[h, r, i] = o[r, nibble_order(i, vgw) if half else i]

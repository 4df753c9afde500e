"""engine.kv.cpu_kernels: the compiled rotation gives numpy's rotation, for every shape the
sparse CPU path hands it, and steps aside where it cannot."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.kv import cpu_kernels, cpu_native, cpu_select, remap

SPEC = remap.RopeSpec(dims=64, traditional=False, base=100000.0, scale=1.0, trained=8192)


def _numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cpu_kernels._state, "loops", None)
    monkeypatch.setitem(cpu_native._state, "lib", None)  # attend.c's exact pass too


def _both(monkeypatch: pytest.MonkeyPatch, k: np.ndarray, delta: np.ndarray,
          spec: remap.RopeSpec = SPEC) -> tuple[np.ndarray, np.ndarray]:
    fast = cpu_kernels.rotate(k, delta, remap._split_tables(spec), remap.SPLIT)
    assert fast is not None
    with monkeypatch.context() as m:
        _numpy_only(m)
        slow = remap.rerotate(k, delta, spec)
    return fast, slow


def test_the_loop_is_what_linux_runs() -> None:
    # numba is a dependency on Linux: a silent fall back to numpy would hide a lost speed-up.
    if sys.platform == "linux":
        assert cpu_kernels.available()


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
def test_rotation_equals_numpys_for_keys_queries_and_slices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    keys = rng.standard_normal((3, 40, 8, 64), np.float32)
    # deltas of both signs, past one table (SPLIT) and near the tables' end
    delta = rng.integers(-200_000, 200_000, (3, 40)).astype(np.int32)
    delta[0, :4] = [0, 1, -1, remap.SPLIT ** 2 - 1]
    q = rng.standard_normal((3, 64, 3), np.float32)
    cases = [
        (keys, delta),                                   # chosen blocks' keys
        (keys[:, :25], delta[:, :25]),                   # a strided slice of them
        (q.swapaxes(-1, -2)[:, None], -delta[:1]),      # the query per far page run: (1, n)
        (q.swapaxes(-1, -2)[:, None], delta.astype(np.int64)),  # per head and block
    ]
    for k, d in cases:
        fast, slow = _both(monkeypatch, k, d)
        assert fast.shape == slow.shape
        np.testing.assert_allclose(fast, slow, rtol=0, atol=2e-5)


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
def test_partial_rotary_dims_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = remap.RopeSpec(dims=32, traditional=False, base=10000.0, scale=0.5, trained=4096)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 5, 4, 64), np.float32)
    d = rng.integers(-9000, 9000, (2, 5))
    fast, slow = _both(monkeypatch, k, d, spec)
    np.testing.assert_allclose(fast, slow, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(fast[..., 32:], k[..., 32:])


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
def test_rotation_equals_mlx_rope() -> None:
    # Rotating a key rotated at p by delta is rotating it at p + delta (mx.fast.rope).
    rng = np.random.default_rng(11)
    raw = rng.standard_normal((1, 6, 1, 64), np.float32)
    pos = rng.integers(15_000, 20_000, 6)
    delta = rng.integers(-15_000, 3_000, (1, 6))

    def rope(at: np.ndarray) -> np.ndarray:
        rows = [mx.fast.rope(mx.array(raw[:, i:i + 1]), 64, traditional=False, base=100000.0,
                             scale=1.0, offset=int(p)) for i, p in enumerate(at)]
        return np.asarray(mx.concatenate(rows, axis=1))

    got = remap.rerotate(rope(pos), delta, SPEC)
    # float32 angles at positions ~2e4 round to ~1e-3 rad in MLX's rope (test_longctx_remap)
    np.testing.assert_allclose(got, rope(pos + delta[0]), rtol=0, atol=5e-3)
    assert float(np.abs(got - rope(pos)).max()) > 0.1  # and it moved something


def test_out_of_place_inputs_take_numpys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    t = remap._split_tables(SPEC)
    k = np.ones((1, 2, 1, 64), np.float32)
    # past the tables, narrower than the rotated dims, not broadcastable, not float32
    assert cpu_kernels.rotate(k, np.array([[remap.SPLIT ** 2, 0]]), t, remap.SPLIT) is None
    assert cpu_kernels.rotate(k[..., :32], np.zeros((1, 2), np.int64), t, remap.SPLIT) is None
    assert cpu_kernels.rotate(k, np.zeros((1, 3), np.int64), t, remap.SPLIT) is None
    assert cpu_kernels.rotate(k.astype(np.float16), np.zeros((1, 2)), t, remap.SPLIT) is None
    _numpy_only(monkeypatch)
    assert cpu_kernels.rotate(k, np.zeros((1, 2), np.int64), t, remap.SPLIT) is None
    np.testing.assert_allclose(remap.rerotate(k, np.zeros((1, 2), np.int64), SPEC), k)


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
@pytest.mark.parametrize("group", [1, 4, 16])
def test_far_bound_equals_numpys_score(monkeypatch: pytest.MonkeyPatch, group: int) -> None:

    rng = np.random.default_rng(group)
    h, n, r, d = 3, 70, 3, 64  # 70: a last, partial run of each group
    keys = rng.standard_normal((h, n, 8, d), np.float32)
    bmin, bmax = keys.min(axis=2), keys.max(axis=2)
    qt = rng.standard_normal((h, d, r), np.float32)
    m = rng.standard_normal((h, r), np.float32) * 3
    starts = (np.arange(n) * 8 * 16)[None]          # blocks of 8 tokens, pages of 16 blocks
    far = (SPEC, 6_000, 128)                         # E inside the range: near ones stay put
    fast = cpu_select.score(bmin, bmax, qt, m, starts, far, group)
    with monkeypatch.context() as mp:
        _numpy_only(mp)
        slow = cpu_select.score(bmin, bmax, qt, m, starts, far, group)
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-4)
    # The rotation matters: scoring as cached gives other numbers.
    assert float(np.abs(cpu_select.score(bmin, bmax, qt, m) - slow).max()) > 0.1
    # The same candidates read in place from pools of 10 a row (rows shuffled), as the block
    # pass reads the kept float32 summaries: loop and numpy alike.
    rows = rng.permutation(h * 7).reshape(h, 7)
    pools = [np.empty((h * 7, 10, d), np.float32) for _ in range(2)]
    for pool, a in zip(pools, (bmin, bmax), strict=True):
        pool[rows] = a.reshape(h, 7, 10, d)
    for numpy_only in (False, True):
        with monkeypatch.context() as mp:
            if numpy_only:
                _numpy_only(mp)
            got = cpu_select.score(pools[0], pools[1], qt, m, starts, far, group, rows)
        np.testing.assert_allclose(got, slow, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
def test_far_rescore_equals_numpys(monkeypatch: pytest.MonkeyPatch) -> None:

    rng = np.random.default_rng(5)
    h, n, b, r, d = 3, 64, 8, 3, 64
    keys = rng.standard_normal((h, n, b, d), np.float32)
    q = rng.standard_normal((h, r, d), np.float32)
    m0 = rng.standard_normal((h, r), np.float32) * 3
    sc = rng.standard_normal((h, n), np.float32)
    sc[0, :5] = -np.inf                              # bound ruled out: never picked
    far = (SPEC, 300, 128)

    def keys_of(at: np.ndarray) -> np.ndarray:
        return keys[np.arange(h)[:, None], at]

    def pick() -> np.ndarray:
        return np.sort(cpu_select.rescore(q, m0, sc, 10, 40, None, 0, 16, b, far, keys_of))

    fast = pick()
    with monkeypatch.context() as mp:
        _numpy_only(mp)
        slow = pick()
    np.testing.assert_array_equal(fast, slow)
    assert not np.isin(np.arange(5), fast[0]).any()
    # and the loop's logits themselves
    at = np.tile(np.arange(n), (h, 1))
    got = cpu_kernels.far_rescore(q, keys, at, b, m0, far, remap._split_tables(SPEC),
                                  remap.SPLIT)
    qr = remap.rerotate(q[:, None], -cpu_select.far_shift(at * b, far), SPEC)
    want = cpu_select.lse((qr @ keys.swapaxes(-1, -2)).max(-1).swapaxes(1, 2)
                          - m0[:, :, None], axis=1)
    assert got is not None
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("numpy_only", [False, True])
def test_a_question_rescores_far_blocks_with_its_keys_turned(
        numpy_only: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With more query rows than a block has keys (a 48-token question: 144 rows), rescore
    turns each block's keys forward by its far shift instead of the rows back: the same
    logits, so the same picks as the rows-turned reference."""
    if numpy_only:
        _numpy_only(monkeypatch)
    elif not cpu_kernels.available():
        pytest.skip("numba not installed here")
    rng = np.random.default_rng(7)
    h, n, b, r, d = 3, 96, 8, 144, 64
    keys = rng.standard_normal((h, n, b, d), np.float32)
    q = rng.standard_normal((h, r, d), np.float32) * 0.3
    m0 = rng.standard_normal((h, r), np.float32) * 3
    sc = rng.standard_normal((h, n), np.float32)
    sc[1, :4] = -np.inf                              # bound ruled out: never picked
    far = (SPEC, 500, 128)                           # blocks 0..62 start before E: moved

    def keys_of(at: np.ndarray) -> np.ndarray:
        return keys[np.arange(h)[:, None], at]

    got = np.sort(cpu_select.rescore(q, m0, sc, 12, n, None, 0, 16, b, far, keys_of))
    at = np.tile(np.arange(n), (h, 1))
    qr = remap.rerotate(q[:, None], -cpu_select.far_shift(at * b, far), SPEC)  # (H, n, R, D)
    want = cpu_select.lse((qr @ keys.swapaxes(-1, -2)).max(-1).swapaxes(1, 2)
                          - m0[:, :, None], axis=1)
    want[1, :4] = -np.inf
    np.testing.assert_array_equal(got, np.sort(np.argpartition(-want, 11, axis=-1)[:, :12]))
    assert (cpu_select.far_shift(at * b, far) != 0).any()


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
@pytest.mark.parametrize("engine", ["attend.c", "numba"])
@pytest.mark.parametrize(("n_first", "moved", "with_votes"),
                         [(8, True, True), (8, False, True), (64, True, False)])
def test_choose_equals_bounded_then_rescore(n_first: int, moved: bool, with_votes: bool,
                                            engine: str, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """The one compiled pass (attend.c's `strata_choose`, or the numba loop where it does not
    run) picks the blocks cpu_select's bounded (two levels, or one with n_first 64) and
    rescore pick, from a RAM pool whose pages sit in shuffled slots, with voted blocks left
    out and the far candidates scored moved (or nothing moved)."""
    from types import SimpleNamespace

    ran: list[bool] = []
    if engine == "numba":
        monkeypatch.setitem(cpu_native._state, "lib", None)
    else:
        if not cpu_native.may_run() or cpu_native._lib() is None:
            pytest.skip(f"attend.c does not run here: {cpu_native.status()}")
        real = cpu_native.choose

        def observed(*a: Any) -> Any:
            out = real(*a)
            ran.append(out is not None)
            return out

        monkeypatch.setattr(cpu_native, "choose", observed)

    rng = np.random.default_rng(n_first)
    h, r, d, P, b, n_pages = 3, 3, 64, 32, 8, 60
    nb = P // b
    lo, hi = 1, 56
    keys = rng.standard_normal((n_pages, h, P, d), np.float32) * np.linspace(0.2, 2, d,
                                                                             dtype=np.float32)
    slot_of = rng.permutation(n_pages + 5)[:n_pages].astype(np.int32)  # page -> slot
    pk = np.zeros((n_pages + 5, h, P, d), np.float32)
    pk[slot_of] = keys
    blocks = keys.reshape(n_pages, h, nb, b, d)
    table = SimpleNamespace(  # the layer's summaries as KVStore keeps them
        page_tokens=P, block_tokens=b, block_pages=n_pages, np_rows=None,
        kmin=keys.min(axis=2), kmax=keys.max(axis=2),
        block_summaries=tuple(a.transpose(1, 0, 2, 3).reshape(h, n_pages * nb, d)
                              .astype(np.float16) for a in (blocks.min(3), blocks.max(3))))
    q = rng.standard_normal((h, r, d), np.float32) * 0.3
    m0 = rng.standard_normal((h, r), np.float32)
    far = (SPEC, 900 if moved else 0, P)
    voted = (np.stack([rng.choice(np.arange(lo * nb, hi * nb), 6, replace=False)
                       for _ in range(h)]) if with_votes else None)
    read_pages, m, k = 20, 24, 10  # enough finite bounds a head: no ties at -inf

    def pool_of(at: np.ndarray) -> cpu_select.Pool:
        return pk, slot_of[at // nb].astype(np.int64), at % nb

    sc, cand = cpu_select.bounded(table, q, m0, n_pages, lo, hi, n_first, read_pages, voted,
                                  far, 4)
    assert (cand is None) == (n_first == 64)

    def keys_of(at: np.ndarray) -> np.ndarray:
        raise AssertionError("the rescoring reads the pool in place")

    want = cpu_select.rescore(q, m0, sc, k, m, cand, lo, nb, b, far, keys_of, pool_of)
    pmin, pmax = (a.reshape(-1, 1, d) for a in (table.kmin, table.kmax))

    def run(slots: np.ndarray) -> np.ndarray | None:
        return cpu_kernels.choose(pmin, pmax, *table.block_summaries, q, m0, lo, hi - lo,
                                  n_first, 4, nb, b, far, remap._split_tables(SPEC),
                                  remap.SPLIT, voted, read_pages, m, k, pk, slots)

    got = run(slot_of)
    assert got is not None and got.shape == (h, k)
    assert ran == ([True] if engine == "attend.c" else [])
    np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(want, axis=1))
    if voted is not None:
        assert not any(np.isin(voted[i], got[i]).any() for i in range(h))
    # a slot past the pool is never read: the loop steps aside
    bad = slot_of.copy()
    bad[lo] = len(pk)
    assert run(bad) is None


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
@pytest.mark.parametrize("layout", ["reach", "infllm", None])
def test_attend_chosen_equals_gather_rotate_and_softmax(monkeypatch: pytest.MonkeyPatch,
                                                       layout: str | None) -> None:
    """The loop lays out sinks, chosen blocks (in position order) and window, turns them as
    remap.block_deltas places them (either layout, or not at all), and attends them from a
    pool whose pages sit in shuffled slots: numpy's gather, rotation and softmax partial,
    merged with a given partial as cpu_select.merge merges."""
    rng = np.random.default_rng(9)
    n_pages, h, p, d, dv, b = 12, 3, 32, 64, 48, 8
    nb = p // b
    sink, hi = 1, 10
    slot_of = rng.permutation(n_pages + 3)[:n_pages].astype(np.int32)
    pk = rng.standard_normal((n_pages + 3, h, p, d), np.float32)
    pv = rng.standard_normal((n_pages + 3, h, p, dv), np.float32)
    q = rng.standard_normal((h, 3, d), np.float32) * 0.3
    chosen = np.stack([rng.choice(np.arange(sink * nb, hi * nb), 9, replace=False)
                       for _ in range(h)])                    # unsorted, as selection gives
    spec = remap.RopeSpec(dims=64, traditional=False, base=100000.0, scale=1.0, trained=200)
    end = n_pages * p + 1
    if layout is not None:
        monkeypatch.setattr(remap, "LAYOUT", layout)
        top, delta = remap.block_deltas(chosen, sink, hi, n_pages, p, b, end, spec.trained)
        turn = np.concatenate([delta[:, :sink * nb], delta[:, delta.shape[1] - 9:]], 1)
    else:
        top, turn = np.sort(chosen, axis=1), None
    blocks = np.concatenate([np.tile(np.arange(sink * nb), (h, 1)), top,
                             np.tile(np.arange(hi * nb, n_pages * nb), (h, 1))], axis=1)
    heads = np.arange(h)[:, None]
    at = slot_of[blocks // nb]
    k = pk.reshape(-1, h, nb, b, d)[at, heads, blocks % nb]
    v = pv.reshape(-1, h, nb, b, dv)[at, heads, blocks % nb]
    if turn is not None:
        assert np.abs(turn).max() > 0  # something moves
        with monkeypatch.context() as mp:
            _numpy_only(mp)
            k[:, :turn.shape[1]] = remap.rerotate(k[:, :turn.shape[1]], turn, spec)
    want = cpu_select._flat_part(q, k.reshape(h, -1, d), v.reshape(h, -1, dv), None)
    place = None if layout is None else (layout == "reach", end, spec.trained)
    tables = remap._split_tables(spec)
    # merged with a given partial (the recent tokens'): none, one whose max passes the
    # blocks' and one below them
    none = (np.full((h, 3), -np.inf, np.float32), np.zeros((h, 3), np.float32),
            np.zeros((h, 3, dv), np.float32))
    for lift in (None, 5.0, -5.0):
        init = none if lift is None else (
            want[0] + np.float32(lift), rng.random((h, 3), np.float32) + 1,
            rng.standard_normal((h, 3, dv), np.float32))
        got = cpu_kernels.attend_chosen(q, pk, pv, chosen, sink, hi, n_pages, nb, b, place,
                                        tables, remap.SPLIT, slot_of, init)
        assert got is not None
        for a, w in zip(got, want if lift is None else cpu_select.merge([init, want]),
                        strict=True):
            np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5)
    # a page past the pool is not read out of place: the loop steps aside
    bad = slot_of.copy()
    bad[0] = len(pk)
    assert cpu_kernels.attend_chosen(q, pk, pv, chosen, sink, hi, n_pages, nb, b, place,
                                     tables, remap.SPLIT, bad, none) is None


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
def test_the_loops_exp_and_logsumexp_equal_numpys() -> None:
    # The loops' own exp (numba calls libm one value at a time; this one vectorizes): within
    # float32's precision where it matters, ~0 (not nan) for -inf, and -inf for a column with
    # nothing in it, as cpu_select.lse gives.
    from engine.kv import cpu_loops  # (imports numba: only past the skip above)

    x = np.concatenate([np.linspace(-100, 0, 2001, dtype=np.float32),
                        np.array([-np.inf, -87.0, -1e-7, 0.0], np.float32)])
    zero = np.zeros_like(x)
    out = np.empty_like(x)
    cpu_loops.exp_into(x, zero, out, np.empty(len(x), np.int32))
    want = np.exp(x.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=3e-7, atol=2e-38)
    assert out[-4] < 1e-37 and out[-1] == 1.0
    rng = np.random.default_rng(3)
    cols = (rng.standard_normal((3, 50)) * 30).astype(np.float32)
    cols[:, 7] = -np.inf                      # nothing: -inf
    cols[1:, 9] = -np.inf                     # one row only
    cols[:, 11] = [80.0, -80.0, 0.0]          # far apart
    got = np.empty(50, np.float32)
    scratch = [np.empty(50, np.float32) for _ in range(3)]
    cpu_loops.lse_cols(cols, got, *scratch, np.empty(50, np.int32))
    np.testing.assert_allclose(got, cpu_select.lse(cols, axis=0), rtol=1e-6, atol=1e-6)
    assert got[7] == -np.inf and got[9] == cols[0, 9]


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
def test_dense_pages_equals_numpys_pages_part(monkeypatch: pytest.MonkeyPatch) -> None:
    # Exact decode over pages in RAM: the loop's page-at-a-time online softmax against
    # numpy's one pass, with logits that grow page by page (the running max moves on every
    # page) and one page far below the rest (its weights underflow).
    rng = np.random.default_rng(11)
    n, h, p, d, dv = 9, 3, 32, 64, 48
    pk = rng.standard_normal((n, h, p, d), np.float32) * np.arange(1, n + 1, dtype=np.float32
                                                                   )[:, None, None, None]
    pk[4] *= -40.0
    pv = rng.standard_normal((n, h, p, dv), np.float32)
    q = rng.standard_normal((h, 5, d), np.float32) * 0.3
    got = cpu_kernels.dense_pages(q, pk, pv, 2, 8)
    assert got is not None
    want = cpu_select._pages_part(q, pk[2:8], pv[2:8])
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=2e-5, atol=1e-5)
    # cpu_select's dense pass (pages cut over the threads) takes the loop and agrees
    with monkeypatch.context() as m:
        _numpy_only(m)
        slow = cpu_select.dense_partial(q, pk, pv, pages=True)
    fast = cpu_select.dense_partial(q, pk, pv, pages=True)
    np.testing.assert_allclose(fast[2] / fast[1][..., None], slow[2] / slow[1][..., None],
                               rtol=1e-5, atol=1e-6)
    # pages past the arrays are not read out of place; numpy's path takes them
    assert cpu_kernels.dense_pages(q, pk, pv, 2, n + 1) is None
    assert cpu_kernels.dense_pages(q, pk, pv[:, :2], 0, n) is None


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
@pytest.mark.parametrize(("bits", "group"), [(8, 64), (8, 32), (4, 32), (4, 64)])
def test_dense_pages_read_as_codes_equal_the_decoded_pages(bits: int, group: int) -> None:
    # Exact decode over quantized pages: the loop reads codes, scales and biases where MLX
    # would decode them first; the same softmax partial as numpy's over the decoded pages.
    from engine.kv.codec import PageCodec  # (only this test quantizes)

    codec = PageCodec(bits, group, "float32")
    rng = np.random.default_rng(bits + group)
    n, h, p, d = 6, 3, 32, 128
    k = mx.array(rng.standard_normal((n, h, p, d), np.float32) * 2)
    v = mx.array(rng.standard_normal((n, h, p, d), np.float32))
    kparts, vparts = codec.encode(k), codec.encode(v)
    q = rng.standard_normal((h, 3, d), np.float32) * 0.2
    got = cpu_kernels.dense_pages_q(q, tuple(np.asarray(a) for a in kparts),
                                    tuple(np.asarray(a) for a in vparts), bits, 1, 5)
    assert got is not None
    dk, dv = (np.asarray(codec.decode(x)) for x in (kparts, vparts))
    want = cpu_select._pages_part(q, dk[1:5], dv[1:5])
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=2e-5, atol=2e-5)
    # through cpu_select, the pages cut over the threads
    both = cpu_select.dense_codes(q, tuple(np.asarray(a) for a in kparts),
                                  tuple(np.asarray(a) for a in vparts), bits)
    whole = cpu_select._pages_part(q, dk, dv)
    assert both is not None
    np.testing.assert_allclose(both[2] / both[1][..., None], whole[2] / whole[1][..., None],
                               rtol=2e-5, atol=2e-5)
    # parts that are not a codec's (the codes' width off) take MLX's path
    bad = (np.asarray(kparts[0])[..., :-1], *(np.asarray(a) for a in kparts[1:]))
    assert cpu_kernels.dense_pages_q(q, bad, tuple(np.asarray(a) for a in vparts), bits,
                                     0, n) is None


def test_spans_cut_work_over_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "THREADS", 3)
    assert cpu_kernels.spans(70) == [(0, 24), (24, 48), (48, 70)]
    assert cpu_kernels.spans(70, least=100) == [(0, 70)]
    assert cpu_kernels.spans(1) == [(0, 1)]


def test_share_takes_every_piece_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "THREADS", 2)
    got = cpu_kernels.share(50, lambda a, b: (a, b))
    assert len(got) == cpu_kernels.PIECES * 2
    cuts = sorted(got)
    assert cuts[0][0] == 0 and cuts[-1][1] == 50
    assert all(x[1] == y[0] and x[0] < x[1] for x, y in zip(cuts, cuts[1:], strict=False))
    assert cpu_kernels.share(50, lambda a, b: (a, b), least=51) == [(0, 50)]
    monkeypatch.setattr(cpu_kernels, "THREADS", 1)
    assert cpu_kernels.share(50, lambda a, b: (a, b)) == [(0, 50)]


def test_share_does_not_wait_for_a_worker_that_never_started(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Every pool worker busy elsewhere: the caller takes every piece and returns at once,
    # where waiting for its helper would hang until the pool freed up.
    import threading  # (only this test blocks the pool)

    pool = cpu_kernels.threads()
    monkeypatch.setattr(cpu_kernels, "THREADS", 2)
    gate = threading.Event()
    busy = [pool.submit(gate.wait, 30) for _ in range(pool._max_workers)]
    try:
        who: set[int] = set()

        def work(a: int, b: int) -> tuple[int, int]:
            who.add(threading.get_ident())
            return a, b

        got = cpu_kernels.share(40, work)
        assert not any(f.done() for f in busy)  # returned with the pool still held
        assert sorted(got)[0][0] == 0 and sorted(got)[-1][1] == 40
        assert who == {threading.get_ident()}
    finally:
        gate.set()
        for f in busy:
            f.result()


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
@pytest.mark.parametrize("width", [64, 80, 16, 128])
def test_weighted_values_in_runs_equal_a_matmul(width: int) -> None:
    # The value sums run 32 columns at a time in scalars, the rest one by one: a column
    # range at an offset, into an output at another, equals numpy's product.
    from engine.kv import cpu_loops  # (imports numba)

    rng = np.random.default_rng(width)
    w = rng.random((3, 40), np.float32)
    vals = rng.standard_normal((40, width + 24), np.float32)
    o = rng.standard_normal((3, width + 10), np.float32)
    want = o.copy()
    want[:, 10:] += w @ vals[:, 8:8 + width]
    cpu_loops.weigh_values(w, vals, 8, width, o, 10)
    np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-5)

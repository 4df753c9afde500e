"""attend.c's exact decode pass (engine.kv.cpu_native): the same partial as numpy's pass and
the numba loop over real arrays, with the recent keys (causal) in the same call, the same
bits whichever thread took which pages, a layer's decode steps through attention.attend
equal to MLX's, refusals that leave the caller's path, and the switch that turns it off, in
a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings, attention, cpu_kernels, cpu_native, cpu_select, remap
from engine.kv.cache import PagedLayerCache
from engine.kv.store import KVStore
from tests.helpers import REPO

on = pytest.mark.skipif(cpu_native._lib() is None,
                        reason=f"attend.c does not run here: {cpu_native.status()}")


def _case(rng: np.random.Generator, n: int, h: int, rows: int, p: int, d: int, dv: int
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Queries (h, rows, d) sharing a direction per head, and pages whose logits grow page by
    page (the running max moves on every page) with one page far below the rest (logits
    about -50: its weights vanish)."""
    common = rng.standard_normal((h, 1, d)).astype(np.float32)
    q = 0.3 * (common + 0.5 * rng.standard_normal((h, rows, d)).astype(np.float32))
    k = rng.standard_normal((n, h, p, d), np.float32) * (
        1 + np.arange(n, dtype=np.float32) / 10)[:, None, None, None]
    k[n // 2] = -3.0 * common + 0.1 * k[n // 2]
    return q, k, rng.standard_normal((n, h, p, dv), np.float32)


def _normed(part: tuple[np.ndarray, ...]) -> np.ndarray:
    return part[2] / part[1][..., None]


@on
@pytest.mark.parametrize(("n", "h", "rows", "p", "d", "dv", "threads"), [
    (40, 3, 3, 128, 64, 64, 2),    # the starter's decode step
    (9, 2, 7, 64, 128, 128, 2),    # a group of 7 query heads, head_dim 128
    (5, 1, 1, 20, 64, 64, 1),      # pages not a multiple of 16 tokens, one thread
    (6, 2, 16, 32, 64, 192, 3),    # blocks of 4 rows, values wider than keys
    (3, 4, 32, 16, 256, 64, 4),    # the most rows, the widest head
])
def test_partial_equals_numpys_pass(n: int, h: int, rows: int, p: int, d: int, dv: int,
                                    threads: int) -> None:
    q, k, v = _case(np.random.default_rng(n * 100 + rows), n, h, rows, p, d, dv)
    got = cpu_native.dense_pages(q, k, v, 1, n, threads)
    assert got is not None
    want = cpu_select._pages_part(q, k[1:], v[1:])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_normed(got), _normed(want), rtol=2e-5, atol=2e-5)
    if cpu_kernels.available():
        loop = cpu_kernels.dense_pages(q, k, v, 1, n)
        assert loop is not None
        np.testing.assert_allclose(_normed(got), _normed(loop), rtol=2e-5, atol=2e-5)


@on
def test_the_same_bits_every_call_and_pool_slots_read_in_place() -> None:
    # a pool's slots (every other one, as a sliced pool's view) are read where they lie; a
    # call's result does not depend on which thread took which pages
    q, pool_k, pool_v = _case(np.random.default_rng(5), 64, 3, 3, 128, 64, 64)
    k, v = pool_k[::2], pool_v[::2]
    assert not k.flags["C_CONTIGUOUS"]
    first = cpu_native.dense_pages(q, k, v, 0, 32, 2)
    assert first is not None
    assert cpu_native.may_run() and cpu_native.status() == "on (AVX-512)"
    assert cpu_native.fits(3, 64, 64, 128) and cpu_native.fits(32, 256, 192, 20)
    assert not any(cpu_native.fits(*bad) for bad in ((33, 64, 64, 128), (3, 80, 80, 128),
                                                     (3, 64, 64, 130), (3, 64, 64, 1024)))
    for _ in range(20):
        again = cpu_native.dense_pages(q, k, v, 0, 32, 2)
        assert again is not None
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    want = cpu_select._pages_part(q, np.ascontiguousarray(k), np.ascontiguousarray(v))
    np.testing.assert_allclose(_normed(first), _normed(want), rtol=2e-5, atol=2e-5)
    # through cpu_select's dense pass, as a decode step takes it
    step = cpu_select.dense_partial(q, k, v, pages=True)
    assert all(np.array_equal(a, b) for a, b in zip(first, step, strict=True))


@on
@pytest.mark.parametrize(("t", "causal", "threads"), [(37, 1, 2), (40, 3, 2), (1, 1, 1),
                                                      (6, 2, 3)])
def test_the_recent_keys_in_the_same_call(t: int, causal: int, threads: int) -> None:
    # a decode step's whole attention: pages, then the tail that ends with the step's own
    # `causal` tokens (rows rep-major, each sees none after its own), in one call
    q, k, v = _case(np.random.default_rng(t), 6, 3, 3 * causal, 64, 64, 64)
    rng = np.random.default_rng(t + 1)
    tk = rng.standard_normal((3, t, 64), np.float32)
    tv = rng.standard_normal((3, t, 64), np.float32)
    got = cpu_native.dense_pages(q, k, v, 0, 6, threads, tail=(tk, tv), causal=causal)
    assert got is not None
    want = cpu_select.merge([cpu_select._pages_part(q, k, v),
                             cpu_select.recent_partial(q, tk, tv, causal)])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(_normed(got), _normed(want), rtol=2e-5, atol=2e-5)
    # the tail alone (no page yet)
    alone = cpu_native.dense_pages(q, k, v, 0, 0, threads, tail=(tk, tv), causal=causal)
    assert alone is not None
    np.testing.assert_allclose(_normed(alone),
                               _normed(cpu_select.recent_partial(q, tk, tv, causal)),
                               rtol=2e-5, atol=2e-5)


@on
@pytest.mark.parametrize(("t", "causal"), [(2000, 1), (129, 3), (50, 2), (1, 1)])
def test_a_contiguous_buffer_read_as_pages_in_place(t: int, causal: int) -> None:
    # per-head keys (a layer's contiguous buffer, sliced from a larger capacity): whole
    # blocks as pages where they lie, the rest as the tail, the last `causal` the queries'
    rng = np.random.default_rng(t)
    kb = rng.standard_normal((3, t + 300, 64), np.float32)
    vb = rng.standard_normal((3, t + 300, 64), np.float32)
    k, v = kb[:, :t], vb[:, :t]
    q = rng.standard_normal((3, 3 * causal, 64), np.float32) * 0.3
    got = cpu_native.dense_flat(q, k, v, causal, 2)
    assert got is not None
    want = cpu_select.recent_partial(q, k, v, causal)
    np.testing.assert_allclose(_normed(got), _normed(want), rtol=2e-5, atol=2e-5)


@on
@pytest.mark.parametrize("buffered", [False, True])
def test_decode_steps_through_attend_c_equal_mlxs(tmp_path: Path, buffered: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One layer (head_dim 64, 3 query heads a KV head) over its pages in RAM or its
    contiguous buffer (`buffered`): a prompt, then decode steps of one token and verify
    steps of 2 and 3 causal tokens, attended through attend.c (every step in one call) and
    through MLX's ops, within 1e-5."""
    import mlx.core as mx

    monkeypatch.setattr(cpu_select, "DENSE_MIN_KEYS", 256)
    monkeypatch.setattr(cpu_select, "CONTIG_DENSE_MIN_KEYS", 256)
    calls: list[int] = []
    name = "dense_flat" if buffered else "dense_pages"
    real = getattr(cpu_native, name)

    def counted(*a: Any, **kw: Any) -> Any:
        got = real(*a, **kw)
        calls.append(int(got is not None))
        return got

    monkeypatch.setattr(cpu_native, name, counted)  # the real one, counted
    outs: list[list[Any]] = []
    for on in (True, False):
        monkeypatch.setattr(cpu_select, "NP_DENSE", on)
        s = KVSettings(mode="exact", page_tokens=64, ssd_dir=tmp_path / f"kv{on}").validate()
        store = KVStore(s, n_layers=1, kv_heads=2, head_dim=64)
        cache = PagedLayerCache(store, 0)
        if not buffered:
            cache.contig_max = 0  # attention reads the pages
        mx.random.seed(4)
        got = []
        try:
            for n in (400, 30, 1, 3, 1, 2, 1):
                k = mx.random.normal((1, 2, n, 64)) * mx.linspace(0.2, 2.0, 64)
                v = mx.random.normal((1, 2, n, 64))
                q = mx.random.normal((1, 6, n, 64))
                k2, v2 = cache.update_and_fetch(k, v)
                got.append(attention.attend(cache, q, k2, v2, 64 ** -0.5))
                mx.eval(got[-1])
            assert (cache.contig is not None) == buffered
        finally:
            store.close()
        outs.append(got)
    assert calls == [1] * 5  # the five decode steps, with it on, each in one call
    for a, b in zip(*outs, strict=True):
        assert float(mx.abs(a - b).max()) < 1e-5


@on
@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
@pytest.mark.parametrize(("h", "rows", "d", "half", "n_first", "votes", "far", "identity"), [
    (3, 3, 64, 32, 12, 6, 700, False),   # the starter's shape, two levels, far candidates
    (2, 6, 128, 16, 200, 0, 900, True),  # partial rotary, two row blocks, one level
    (4, 1, 16, 8, 8, 0, 0, False),       # nothing moves
])
def test_choose_equals_the_loop_on_any_threads(h: int, rows: int, d: int, half: int,
                                               n_first: int, votes: int, far: int,
                                               identity: bool) -> None:
    """attend.c's block choice equals the numba loop's (cpu_loops.choose, the fall-back),
    blocks and order, on 1, 2 and 3 threads: the phases' pieces write apart and the ties are
    broken by index as the loop breaks them."""
    from engine.kv import cpu_loops

    rng = np.random.default_rng(d + rows)
    P, b, n_pages, lo = 32, 8, 70, 1
    nb = P // b
    c = n_pages - 6 - lo
    keys = rng.standard_normal((n_pages, h, P, d), np.float32) * np.linspace(
        0.2, 2, d, dtype=np.float32)
    slot_of = rng.permutation(n_pages + 4)[:n_pages].astype(np.int64)
    pk = np.zeros((n_pages + 4, h, P, d), np.float32)
    pk[np.arange(n_pages) if identity else slot_of] = keys
    blocks = keys.reshape(n_pages, h, nb, b, d)
    pmin, pmax = (np.ascontiguousarray(a.reshape(-1, 1, d))
                  for a in (keys.min(axis=2), keys.max(axis=2)))
    bmin, bmax = (np.ascontiguousarray(a.transpose(1, 0, 2, 3).reshape(h, n_pages * nb, d)
                                       .astype(np.float16))
                  for a in (blocks.min(3), blocks.max(3)))
    q = rng.standard_normal((h, rows, d), np.float32) * 0.3
    m0 = rng.standard_normal((h, rows), np.float32)
    voted = (np.stack([rng.choice(np.arange(lo * nb, (lo + c) * nb), votes, replace=False)
                       for _ in range(h)]) if votes else np.zeros((h, 0), np.int64))
    spec = remap.RopeSpec(2 * half, False, 10000.0, 1.0, 8192)
    tables = remap._split_tables(spec)
    e, s0 = (far, P) if far else (0, 0)
    read_pages, m, k = 30, 40, 16
    n_pick = n_first if c > 2 * n_first else c
    want = np.empty((h, k), np.int64)
    cpu_loops.choose(pmin, pmax, bmin.view(np.uint16).reshape(h, -1),
                     bmax.view(np.uint16).reshape(h, -1), q, m0, lo, c, n_first, 4, nb, b, e,
                     s0, remap.SPLIT, *tables, voted, (lo + c) * nb, read_pages,
                     min(m, n_pick * nb), pk, slot_of, identity, want)
    for threads in (1, 2, 3):
        got = cpu_native.choose(pmin, pmax, bmin, bmax, q, m0, lo, c, n_first, 4, nb, b, e,
                                s0, tables, remap.SPLIT, voted, read_pages,
                                min(m, n_pick * nb), k, pk, None if identity else slot_of,
                                threads)
        assert got is not None
        np.testing.assert_array_equal(got, want)
    assert not any(np.isin(voted[i], want[i]).any() for i in range(h))


@on
@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
@pytest.mark.parametrize(("h", "rows", "d", "dv", "half", "place", "identity"), [
    (3, 3, 64, 64, 32, (True, 9000, 8192), False),    # the starter, reach layout, near
    (3, 3, 64, 64, 32, (True, 40000, 8192), True),    # reach layout, far past the window
    (2, 6, 128, 128, 16, (False, 9000, 1024), False),  # InfLLM layout, partial rotary
    (4, 1, 16, 64, 8, None, True),                     # nothing turned
])
def test_attend_chosen_equals_the_loop_on_any_threads(
        h: int, rows: int, d: int, dv: int, half: int, place: tuple[bool, int, int] | None,
        identity: bool) -> None:
    """attend.c's attention over a sparse step's sinks, chosen blocks and window equals the
    numba loop's (cpu_loops.attend_chosen, the fall-back) within float rounding, merged with
    a given partial, pages in shuffled slots or in place, keys turned as either layout
    places them; and the same bits on 2 and 3 threads (pieces merged in order, whichever
    thread took them)."""
    from engine.kv import cpu_loops

    rng = np.random.default_rng(d + rows + dv)
    P, b, n_pages, sink, hi, k = 32, 8, 60, 1, 56, 24
    nb = P // b
    slots = np.arange(n_pages) if identity else rng.permutation(n_pages + 3)[:n_pages]
    pk = rng.standard_normal((n_pages + 3, h, P, d), np.float32)
    pv = rng.standard_normal((n_pages + 3, h, P, dv), np.float32)
    q = rng.standard_normal((h, rows, d), np.float32) * 0.4
    chosen = np.stack([rng.choice(np.arange(sink * nb, hi * nb), k, replace=False)
                       for _ in range(h)]).astype(np.int64)
    init = (rng.standard_normal((h, rows), np.float32) + 2,
            rng.random((h, rows), np.float32) + 0.5,
            rng.standard_normal((h, rows, dv), np.float32))
    tables = remap._split_tables(remap.RopeSpec(2 * half, False, 10000.0, 1.0, 8192))
    reach, end, trained = place or (False, 0, 0)
    want = tuple(np.empty_like(a) for a in init)
    cpu_loops.attend_chosen(q, pk, pv, chosen, sink, hi, n_pages, nb, b, place is not None,
                            reach, end, trained, slots.astype(np.int64), identity,
                            remap.SPLIT, *tables, *init, *want, 0)
    first = None
    for threads in (1, 2, 3):
        got = cpu_native.attend_chosen(q, pk, pv, chosen, sink, hi, n_pages, nb, b, place,
                                       tables, remap.SPLIT,
                                       None if identity else slots.astype(np.int64), init,
                                       threads)
        assert got is not None
        for a, w in zip(got, want, strict=True):
            np.testing.assert_allclose(a, w, rtol=2e-5, atol=2e-5)
        if threads > 1 and first is not None:
            assert all(np.array_equal(a, f) for a, f in zip(got[:3], first, strict=True))
        first = first if threads == 1 else got
    # the turn matters: the same blocks unturned give another partial
    if place is not None:
        flat = cpu_native.attend_chosen(q, pk, pv, chosen, sink, hi, n_pages, nb, b, None,
                                        tables, remap.SPLIT,
                                        None if identity else slots.astype(np.int64), init, 2)
        assert flat is not None and not np.allclose(flat[2], want[2], atol=1e-3)


@on
def test_sparse_shapes_it_does_not_take_return_none() -> None:
    """Values not a multiple of 64 wide (attend_chosen), a head_dim not a multiple of 16
    (choose) and more than 32 query rows: None, for the numba loop to take."""
    h, n, P, nb, b = 2, 4, 32, 4, 8
    tables = remap._split_tables(remap.RopeSpec(16, False, 10000.0, 1.0, 8192))
    init = (np.zeros((h, 3), np.float32), np.ones((h, 3), np.float32),
            np.zeros((h, 3, 16), np.float32))
    chosen = np.array([[4, 5], [6, 7]], np.int64)
    assert cpu_native.attend_chosen(
        np.zeros((h, 3, 16), np.float32), np.zeros((n, h, P, 16), np.float32),
        np.zeros((n, h, P, 16), np.float32), chosen, 1, 3, n, nb, b, None, tables,
        remap.SPLIT, None, init, 2) is None
    for rows, d in ((3, 20), (33, 16)):
        assert cpu_native.choose(
            np.zeros((n * h, 1, d), np.float32), np.zeros((n * h, 1, d), np.float32),
            np.zeros((h, n * nb, d), np.float16), np.zeros((h, n * nb, d), np.float16),
            np.zeros((h, rows, d), np.float32), np.zeros((h, rows), np.float32), 1, 2, 8, 4,
            nb, b, 0, 0, tables, remap.SPLIT, np.zeros((h, 0), np.int64), 2, 4, 2,
            np.zeros((n, h, P, d), np.float32), None, 2) is None


@on
def test_what_it_does_not_take_is_left_to_the_caller() -> None:
    rng = np.random.default_rng(2)
    q, k, v = _case(rng, 4, 2, 3, 32, 64, 64)
    assert cpu_native.dense_pages(q, k, v, 0, 5, 2) is None            # past the pages
    assert cpu_native.dense_pages(q, k, v, 2, 2, 2) is None            # no page, no tail
    tk = np.zeros((2, 2, 64), np.float32)
    assert cpu_native.dense_pages(q, k, v, 0, 4, 2, tail=(tk, tk), causal=3) is None
    assert cpu_native.dense_pages(q, k, v, 0, 4, 2, tail=(tk[:1], tk[:1])) is None
    assert cpu_native.dense_pages(q, k, v[:, :1], 0, 4, 2) is None     # heads differ
    assert cpu_native.dense_pages(q.astype(np.float16), k, v, 0, 4, 2) is None
    assert cpu_native.dense_pages(q, k[..., ::2], v[..., ::2], 0, 4, 2) is None  # strided rows
    q80, k80, v80 = _case(rng, 4, 2, 3, 32, 80, 80)
    assert cpu_native.dense_pages(q80, k80, v80, 0, 4, 2) is None      # head_dim 80
    many = _case(rng, 4, 2, 33, 32, 64, 64)[0]
    assert cpu_native.dense_pages(many, k, v, 0, 4, 2) is None         # 33 query rows
    # and cpu_select's pass still answers those, through the loops or numpy
    got = cpu_select.dense_partial(many, k, v, pages=True)
    want = cpu_select._pages_part(many, k, v)
    np.testing.assert_allclose(_normed(got), _normed(want), rtol=2e-5, atol=2e-5)


def test_turned_off_the_pass_runs_as_before() -> None:
    # STRATA_NATIVE_KV=0: nothing is compiled or loaded, and the dense pass still answers
    code = """
import json
import numpy as np
import engine
from engine.kv import cpu_native, cpu_select
rng = np.random.default_rng(1)
k = rng.standard_normal((6, 3, 128, 64), np.float32)
v = rng.standard_normal((6, 3, 128, 64), np.float32)
q = rng.standard_normal((3, 3, 64), np.float32)
got = cpu_select.dense_partial(q, k, v, pages=True)
want = cpu_select._pages_part(q, k, v)
err = float(np.abs(got[2] / got[1][..., None] - want[2] / want[1][..., None]).max())
print(json.dumps({"status": cpu_native.status(), "lib": cpu_native._lib() is None,
                  "may": cpu_native.may_run(), "err": err}))
"""
    env = {**os.environ, "STRATA_NATIVE_KV": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["status"] == "off (STRATA_NATIVE_KV=0)" and got["lib"] and not got["may"]
    assert got["err"] < 1e-5

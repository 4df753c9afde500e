"""Sparse decode steps in numpy on the CPU (engine.kv.cpu_select) against the MLX ops they
replace: the same blocks chosen and the same attention output, with two-level selection,
question votes, rescoring, far rotation and remapped positions, every page in RAM or most on
the SSD; and the starter model's logits alike either way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings, attention, cpu_select, remap
from engine.kv.cache import PagedLayerCache
from engine.kv.store import KVStore

P, H, D, REP = 16, 2, 16, 3


def _run(tmp_path: Path, slots: int | None, spec: remap.RopeSpec | None,
         session: str | None = None) -> tuple[KVStore, list[Any], Any]:
    """Prefill chunks of random keys (uneven scale per dimension, so the box bound and the
    true logits disagree) to ~3,000 tokens, then decode steps, through one sparse layer whose
    RAM tier holds `slots` pages (None: all). ~187 candidate pages against a budget of 6
    blocks: two-level selection. Returns the store, every output, the last step's queries."""
    import mlx.core as mx

    s = KVSettings(mode="sparse", page_tokens=P, ssd_dir=tmp_path / "kv", sink_tokens=P,
                   window_tokens=P, budget_tokens=2 * P + 6 * 8).validate()
    store = KVStore(s, n_layers=1, kv_heads=H, head_dim=D, session=session)
    remap.attach(store, spec)
    if slots is not None:
        store.max_slots = slots
    mx.random.seed(11)
    cache = PagedLayerCache(store, 0)
    outs = []
    # 64 and 30 tokens: prompt chunks within MAX_ROWS query rows (numpy selects them too past
    # the trained length); the steps cross a page: the rows kept grow.
    for n in [512] * 5 + [400, 64, 30] + [1] * 20:
        k = mx.random.normal((1, H, n, D)) * mx.linspace(0.2, 3.0, D)
        v = mx.random.normal((1, H, n, D))
        q = mx.random.normal((1, H * REP, n, D))
        k2, v2 = cache.update_and_fetch(k, v)
        outs.append(attention.attend(cache, q, k2, v2, D ** -0.5))
        mx.eval(outs[-1])
    return store, outs, (q * D ** -0.5).reshape(H, REP, D)


@pytest.mark.parametrize("slots", [None, 40])
@pytest.mark.parametrize("trained", [0, 1024])
@pytest.mark.parametrize("loops", ["compiled", "numpy"])
def test_numpy_steps_equal_the_mlx_ops(tmp_path: Path, slots: int | None, trained: int,
                                       loops: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole prefill-and-decode runs with the numpy path on and off: every output within
    1e-5, and the last step's selection the same blocks. trained 1,024 (~3x past it): the
    decode steps score far candidates rotated and attend remapped; 40 slots: most pages on
    the SSD, the shortlist read through the store. `loops`: the numpy path through
    engine.kv.cpu_kernels' compiled loops, attend.c's choice where it runs ("compiled"), or
    numpy's ops alone ("numpy")."""
    import mlx.core as mx

    from engine.kv import cpu_kernels, cpu_native

    if loops == "numpy":
        monkeypatch.setitem(cpu_kernels._state, "loops", None)
        monkeypatch.setitem(cpu_native._state, "lib", None)
    elif not cpu_kernels.available():
        pytest.skip("numba not installed here")
    monkeypatch.setattr(attention, "RESCORE", 4)
    monkeypatch.setattr(attention, "VOTE_SHARE", 0.5)
    spec = remap.RopeSpec(D, False, 10000.0, 1.0, trained) if trained else None
    monkeypatch.setattr(cpu_select, "NP_SELECT", True)
    assert cpu_select.enabled()
    ran: list[str] = []
    real = cpu_select.attend_blocks

    def seen(*a: Any) -> Any:
        out = real(*a)
        ran.append("attended" if out is not None else "fell back")
        return out

    monkeypatch.setattr(cpu_select, "attend_blocks", seen)  # the real one, observed
    looped: set[str] = set()
    run_loop = cpu_kernels._run

    def counted(name: str, *args: Any) -> bool:
        ok = run_loop(name, *args)
        if ok:
            looped.add(name)
        return ok

    monkeypatch.setattr(cpu_kernels, "_run", counted)  # the real loops, observed
    real_choose = cpu_native.choose

    def native(*a: Any) -> Any:
        out = real_choose(*a)
        if out is not None:
            looped.add("choose")
        return out

    monkeypatch.setattr(cpu_native, "choose", native)  # attend.c's choice, observed
    on, outs_np, q = _run(tmp_path / "np", slots, spec)
    if loops != "numpy":  # the steps went through the loops, not numpy's fallback
        if slots is None:  # every page in RAM: one pass chooses, one attends
            # (past the trained length the 30-token chunk is a question, QUESTION_L: it
            # chooses once for all its rows, far candidates bounded moved and, with more
            # rows than a block has keys, rescored with the keys turned: rotate)
            far = {"far_bound", "rotate"} if trained else set()
            assert looped == {"choose", "attend_chosen"} | far
        else:  # the shortlist read through the store
            assert not {"choose", "attend_chosen"} & looped
            assert {"far_bound", "far_rescore"} <= looped if trained else not looped
    else:
        assert not looped
    monkeypatch.setattr(cpu_select, "NP_SELECT", False)
    off, outs_mx, _ = _run(tmp_path / "mx", slots, spec)
    assert ran == (["attended"] * 20 if slots is None else ["fell back"] * 20)
    if slots is not None:
        assert on.tables[0].n_resident < on.tables[0].n_pages
    for a, b in zip(outs_np, outs_mx, strict=True):
        assert float(mx.abs(a - b).max()) < 1e-5
    n = on.tables[0].n_pages
    end = on.tables[0].n_pages * P + 4
    far = None if spec is None else (spec, end - trained, P)
    acc = (mx.zeros((H, REP)), None, None)
    for step_end in (None, end):  # a decode step's (one compiled pass in RAM) or a chunk's
        chosen = []
        for flag, store in ((True, on), (False, off)):
            monkeypatch.setattr(cpu_select, "NP_SELECT", flag)
            got = attention.select_blocks(store, 0, q, n, acc, start=10 ** 9, far=far,
                                          step_end=step_end)
            assert got is not None
            chosen.append(np.sort(np.array(got[0]), axis=-1))
        assert chosen[0].shape == (H, 6) and (chosen[0] == chosen[1]).all()
    for store in (on, off):
        store.close()


def test_starter_logits_alike_with_numpy_steps(starter_lm: Any, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The starter model, a needle prompt of 450 tokens through a sparse paged cache declared
    trained at 256 (its later chunks and the decode step remapped), budget 384: the decode
    step's logits with the numpy path equal those with MLX's ops within 1e-4."""
    import mlx.core as mx

    from engine.bench.needle import facts, needle_prompt
    from engine.kv import close_caches, make_paged_cache

    ids, _ = needle_prompt(starter_lm.tokenizer, 450, 0.3, facts(3)[0], seed=3)
    g = starter_lm.kv_geometry
    spec = remap.RopeSpec(g.rope_dims, g.rope_traditional, g.rope_base, g.rope_scale, 256)
    settings = KVSettings(mode="sparse", page_tokens=16, sink_tokens=16, window_tokens=64,
                          budget_tokens=160, ssd_dir=tmp_path / "kv").validate()
    attended: list[bool] = []
    real = cpu_select.attend_blocks

    def seen(*a: Any) -> Any:
        out = real(*a)
        attended.append(out is not None)
        return out

    monkeypatch.setattr(cpu_select, "attend_blocks", seen)  # the real one, observed
    logits = []
    for flag in (True, False):
        monkeypatch.setattr(cpu_select, "NP_SELECT", flag)
        cache = make_paged_cache(starter_lm.model, settings, g)
        remap.attach(cache[0].store, spec)
        try:
            for i in range(0, len(ids) - 1, 64):
                starter_lm.model(mx.array(ids[i:min(i + 64, len(ids) - 1)])[None], cache=cache)
            out = starter_lm.model(mx.array(ids[-1:])[None], cache=cache)[0, -1]
            mx.eval(out)
            logits.append(out)
        finally:
            close_caches(cache)
    # The numpy path ran for every layer's decode steps (the prompt's last, one-token chunk
    # and the step), and only with it on.
    assert attended == [True] * 2 * starter_lm.kv_geometry.layers
    assert float(mx.abs(logits[0] - logits[1]).max()) < 1e-4


@pytest.mark.parametrize("np_select", [True, False])
def test_a_step_reads_each_cold_page_once(tmp_path: Path, np_select: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every page on the SSD (the run's pages adopted by a new store, as after a restart): a
    sparse decode step's shortlist read takes the sinks and the window along, so the step
    reads the store once and its attention reads nothing more (it had read them a second
    time, and copied the first batch to join them)."""
    import mlx.core as mx

    monkeypatch.setattr(attention, "RESCORE", 4)
    monkeypatch.setattr(attention, "VOTE_SHARE", 0.5)
    monkeypatch.setattr(cpu_select, "NP_SELECT", np_select)
    first, _, _ = _run(tmp_path, 40, None, session="restart")
    n = first.tables[0].n_pages
    first.write_behind(0, n)  # (the resident pages too: every page on the SSD)
    first.save_manifest(n * P)
    first.settings = first.settings.with_(keep_files=True)
    first.close()
    store = KVStore(first.settings, n_layers=1, kv_heads=H, head_dim=D, session="restart")
    try:
        store.adopt(0, n)
        attention._catch_up(store, 0, n)  # block summaries, as a restore maps them
        # RAM for the sinks, the window and little else: the shortlist is read for the step
        # alone, as after a restore (pages read once are not yet admitted).
        store.max_slots = 4
        calls: list[int] = []
        real = store._read_batch

        def counted(layer: int, pages: np.ndarray) -> Any:
            calls.append(len(pages))
            return real(layer, pages)

        monkeypatch.setattr(store, "_read_batch", counted)  # the real reads, counted
        cache = PagedLayerCache(store, 0)
        cache.offset = n * P
        # A question (a prompt chunk: its votes choose blocks the rescoring does not read),
        # then one decode step, whose reads are counted.
        for t in (40, 1):
            calls.clear()
            k = mx.random.normal((1, H, t, D))
            q = mx.random.normal((1, H * REP, t, D))
            k2, v2 = cache.update_and_fetch(k, k)
            mx.eval(attention.attend(cache, q, k2, v2, D ** -0.5))
        assert store.tables[0].votes is not None
        assert len(calls) == 1 and calls[0] > 2, calls
    finally:
        store.close()


def _layer_runs(tmp_path: Path, switch: Callable[[bool], None], sizes: list[int], seed: int,
                buffered: bool = True, mode: str = "exact", spec: remap.RopeSpec | None = None
                ) -> tuple[list[list[Any]], list[Any]]:
    """Chunks of `sizes` random tokens (keys of uneven scale per dimension) through one layer
    in `mode` (sparse: a budget of two pages and 6 blocks), over its contiguous buffer
    (`buffered`) or its pages in RAM, after switch(True) and then after switch(False): each
    run's outputs, and the layer's votes after each chunk of both runs."""
    import mlx.core as mx

    outs: list[list[Any]] = []
    votes: list[Any] = []
    for on in (True, False):
        switch(on)
        s = KVSettings(mode=mode, page_tokens=P, ssd_dir=tmp_path / f"kv{on}", sink_tokens=P,
                       window_tokens=P, budget_tokens=2 * P + 6 * 8).validate()
        store = KVStore(s, n_layers=1, kv_heads=H, head_dim=D)
        if spec is not None:
            remap.attach(store, spec)
        cache = PagedLayerCache(store, 0)
        if not buffered:
            cache.contig_max = 0  # attention reads the pages
        mx.random.seed(seed)
        got = []
        try:
            for n in sizes:
                k = mx.random.normal((1, H, n, D)) * mx.linspace(0.2, 3.0, D)
                v = mx.random.normal((1, H, n, D))
                q = mx.random.normal((1, H * REP, n, D))
                k2, v2 = cache.update_and_fetch(k, v)
                got.append(attention.attend(cache, q, k2, v2, D ** -0.5))
                mx.eval(got[-1])
                if n > 1:
                    votes.append(store.tables[0].votes)
            assert (cache.contig is not None) == buffered
        finally:
            store.close()
        outs.append(got)
    return outs, votes


@pytest.mark.parametrize("buffered", [True, False])
def test_dense_decode_in_numpy_equals_mlx(tmp_path: Path, buffered: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact decode steps (one token, and verify steps of 2 and 3 causal tokens) over the
    layer's contiguous buffer (`buffered`) or over its pages in RAM: attended in numpy on two
    threads (cpu_select.dense_partial) and through MLX, within 1e-5; the numpy path ran for
    every step and only with it on."""
    import mlx.core as mx

    monkeypatch.setattr(cpu_select, "DENSE_MIN_KEYS", 256)
    monkeypatch.setattr(cpu_select, "CONTIG_DENSE_MIN_KEYS", 256)
    monkeypatch.setattr(cpu_select, "THREADS", 2)
    ran: list[int] = []
    real = cpu_select.dense_partial

    def seen(*a: Any, **kw: Any) -> Any:
        ran.append(a[1].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(cpu_select, "dense_partial", seen)  # the real one, observed
    outs, _ = _layer_runs(tmp_path, lambda on: monkeypatch.setattr(cpu_select, "NP_DENSE", on),
                          [512, 300, 1, 3, 1, 2, 1], 3, buffered)
    assert len(ran) == 5  # the five decode steps, numpy on
    for a, b in zip(*outs, strict=True):
        assert float(mx.abs(a - b).max()) < 1e-5


def test_starter_logits_alike_with_numpy_dense_decode(starter_lm: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The starter model, 450 tokens through an exact paged cache, then decode steps: the
    logits with the decode steps' attention over the layer's buffer on the CPU's cores
    (attend.c where it runs, else numpy) equal MLX's fused attention's within 1e-4, and the
    greedy tokens are the same."""
    import mlx.core as mx

    from engine.bench.needle import facts, needle_prompt
    from engine.kv import close_caches, make_paged_cache

    monkeypatch.setattr(cpu_select, "DENSE_MIN_KEYS", 256)
    monkeypatch.setattr(cpu_select, "CONTIG_DENSE_MIN_KEYS", 256)
    ran: list[int] = []
    real = attention._dense_np

    def seen(*a: Any, **kw: Any) -> Any:
        ran.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(attention, "_dense_np", seen)  # the real one, observed
    ids, _ = needle_prompt(starter_lm.tokenizer, 450, 0.3, facts(3)[0], seed=3)
    settings = KVSettings(mode="exact", ssd_dir=tmp_path / "kv").validate()
    runs: list[tuple[list[int], Any]] = []
    for flag in (True, False):
        monkeypatch.setattr(cpu_select, "NP_DENSE", flag)
        cache = make_paged_cache(starter_lm.model, settings, starter_lm.kv_geometry)
        try:
            logits = starter_lm.model(mx.array(ids)[None], cache=cache)[0, -1]
            toks, steps = [], []
            for _ in range(4):
                toks.append(int(mx.argmax(logits).item()))  # type: ignore[arg-type]
                logits = starter_lm.model(mx.array([[toks[-1]]]), cache=cache)[0, -1]
                steps.append(logits)
            mx.eval(steps)
            runs.append((toks, mx.stack(steps)))
        finally:
            close_caches(cache)
    assert len(ran) == 4 * starter_lm.kv_geometry.layers  # every layer's steps, numpy on
    assert runs[0][0] == runs[1][0]
    assert float(mx.abs(runs[0][1] - runs[1][1]).max()) < 1e-4


def test_attention_sinks_merge_after_the_numpy_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse decode step of a model with attention sinks (gpt-oss' per-head logits): the
    numpy steps return their partial as numpy arrays, and `attend` merges the sinks into it
    as into MLX's own (outputs within 1e-5, and the sinks change them)."""
    import mlx.core as mx

    h, d, p = 2, 64, 128
    rng = np.random.default_rng(7)
    s = KVSettings(mode="sparse", page_tokens=p, ssd=False, budget_tokens=768).validate()
    store = KVStore(s, n_layers=1, kv_heads=h, head_dim=d)
    cache = PagedLayerCache(store, 0)

    def arr(*shape: int, scale: float = 1.0) -> Any:
        return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))

    cache.update_and_fetch(arr(1, h, 8192, d), arr(1, h, 8192, d))
    q = arr(1, 3 * h, 1, d, scale=0.125)
    k, v = cache.update_and_fetch(arr(1, h, 1, d), arr(1, h, 1, d))
    sinks = arr(3 * h) + 6.0  # about a quarter of the softmax mass: the merge shows
    outs = {}
    for flag in (True, False):
        monkeypatch.setattr(cpu_select, "NP_SELECT", flag)
        for with_sinks in (True, False):
            got = attention.attend(cache, q, k, v, 1.0, sinks=sinks if with_sinks else None)
            outs[flag, with_sinks] = np.array(got)
    assert outs[True, True].shape == (1, 3 * h, 1, d)
    assert np.abs(outs[True, True] - outs[False, True]).max() < 1e-5
    assert np.abs(outs[True, False] - outs[False, False]).max() < 1e-5
    assert np.abs(outs[True, True] - outs[True, False]).max() > 1e-3
    store.close()


def test_a_question_s_bound_rescoring_and_softmax_in_pieces_equal_the_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A question's chunk after a long context (141 query rows a KV head, 64 dimensions):
    the plain bound over blocks and over pools of pages, the rescoring's true logits and the
    attention's softmax partial are cut into pieces on the threads (`cpu_kernels.share`),
    and each equals the same formula computed whole within 1e-5; the attention's partial
    also equals MLX's (`attention._stats` with numpy off)."""
    import mlx.core as mx

    from engine.kv import cpu_kernels

    monkeypatch.setattr(cpu_select, "THREADS", 2)
    pieces: list[int] = []
    real_share = cpu_kernels.share

    def share(n: int, work: Any, least: int = 2) -> Any:
        pieces.append(n)
        return real_share(n, work, least)

    monkeypatch.setattr(cpu_kernels, "share", share)  # the real one, observed
    rng = np.random.default_rng(5)
    h, r, d = 3, 141, 64

    def arr(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    q, m = arr(h, r, d, scale=0.2), arr(h, r)
    qt = q.swapaxes(-1, -2)

    def whole(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        bound = hi @ np.maximum(qt, 0) + lo @ np.minimum(qt, 0)              # (H, n, R)
        return cpu_select.lse(bound - m[:, None, :], axis=-1)

    bmin = arr(h, 1019, d)
    bmax = bmin + np.abs(arr(h, 1019, d))
    got = cpu_select.score(bmin, bmax, qt, m)
    assert got.shape == (h, 1019)
    assert np.abs(got - whole(bmin, bmax)).max() < 1e-5
    pmin = arr(264, 16, d)
    pmax = pmin + np.abs(arr(264, 16, d))
    rows = rng.permutation(264)[:h * 88].reshape(h, 88)
    got = cpu_select.score(pmin, pmax, qt, m, rows=rows)
    assert got.shape == (h, 88 * 16)
    assert np.abs(got - whole(pmin[rows].reshape(h, -1, d), pmax[rows].reshape(h, -1, d))
                  ).max() < 1e-5
    k = arr(h, 256, 8, d)
    s = (q @ k.reshape(h, 2048, d).swapaxes(-1, -2)).reshape(h, r, 256, 8).max(-1)
    got = cpu_select._true_logits(q, k, m)
    assert np.abs(got - cpu_select.lse(s - m[:, :, None], axis=1)).max() < 1e-5
    logits, v = arr(h, r, 2100, scale=3.0), arr(h, 2100, d)
    want_m = logits.max(-1)
    e = np.exp(logits - want_m[..., None])
    got_m, got_sum, got_o = cpu_select.softmax_stats(logits.copy(), v)
    assert (got_m == want_m).all()
    assert np.abs(got_sum - e.sum(-1)).max() < 1e-5 * float(e.sum(-1).max())
    assert np.abs(got_o - e @ v).max() < 1e-5 * float(np.abs(e @ v).max())
    assert pieces == [1019, 88, 256, r]  # each one cut, none computed whole
    outs = {}
    for np_min in (1, 0):  # numpy past one logit, or MLX's ops throughout
        monkeypatch.setattr(attention, "NP_EXP_MIN", np_min)
        part = attention._stats(mx.array(logits), mx.array(v))
        outs[np_min] = np.array(part[2] / part[1][..., None])
    assert np.abs(outs[1] - outs[0]).max() < 1e-5


def test_chunk_attention_in_pieces_equals_the_causal_softmax(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_select.chunk_attention and chunk_partial, cut into pieces of rows on two threads
    (and those into runs of 3 rows) and whole, against the softmax written out: rows
    rep-major (each query head's L rows in turn), every key before the chunk seen, the
    chunk's own keys up to each row's token; a mask off by one row or one key fails it."""
    rng = np.random.default_rng(5)
    h, rep, n, past, d = 2, 3, 40, 70, 16
    q = rng.standard_normal((h, rep * n, d), dtype=np.float32)
    k = rng.standard_normal((h, past + n, d), dtype=np.float32) * np.linspace(0.2, 3, d,
                                                                               dtype=np.float32)
    v = rng.standard_normal((h, past + n, d), dtype=np.float32)
    want = np.empty_like(q)
    for row in range(rep * n):
        s = np.einsum("hd,htd->ht", q[:, row], k)
        s[:, past + row % n + 1:] = -np.inf
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        want[:, row] = np.einsum("ht,htd->hd", w / w.sum(axis=-1, keepdims=True), v)
    monkeypatch.setattr(cpu_select, "THREADS", 2)
    # pieces on the threads; the same, each cut in 3 rows at a time; one piece
    for macs, rows in ((1, 1 << 22), (1, 3 * h * (past + n)), (1 << 40, 1 << 22)):
        monkeypatch.setattr(cpu_select, "SPLIT_MACS", macs)
        monkeypatch.setattr(cpu_select, "CHUNK_PIECE_LOGITS", rows)
        got = cpu_select.chunk_attention(q, k, v, n)
        assert np.abs(got - want).max() < 1e-5
        m, total, out = cpu_select.chunk_partial(q, k, v, n)
        assert np.abs(out / total[..., None] - want).max() < 1e-5


@pytest.mark.parametrize(("buffered", "fused_past"), [(True, 16384), (False, 16384),
                                                     (False, 600)])
def test_prompt_chunks_in_numpy_equal_mlx_s_fused_attention(
        tmp_path: Path, buffered: bool, fused_past: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt chunks (512, 300 and 64 tokens, then a decode step) over the layer's contiguous
    buffer (`buffered`) or its pages in RAM: attended in numpy (cpu_select.chunk_attention)
    and by MLX's fused attention, within 1e-5; numpy ran for the chunks only, and only on.
    With MLX's fused attention only up to 600 past tokens (FUSED_PAST_MAX), the chunks past
    it are numpy's against MLX's page groups."""
    import mlx.core as mx

    monkeypatch.setattr(attention, "FUSED_PAST_MAX", fused_past)
    ran: list[int] = []
    real = cpu_select.chunk_attention

    def seen(*a: Any, **kw: Any) -> Any:
        ran.append(a[3])
        return real(*a, **kw)

    monkeypatch.setattr(cpu_select, "chunk_attention", seen)  # the real one, observed
    outs, _ = _layer_runs(tmp_path, lambda on: monkeypatch.setattr(cpu_select, "NP_CHUNK", on),
                          [512, 300, 64, 1], 4, buffered)
    assert ran == [512, 300, 64]  # the chunks, numpy on
    for a, b in zip(*outs, strict=True):
        assert float(mx.abs(a - b).max()) < 1e-5


def test_starter_prefill_in_numpy_chunks_answers_as_mlx_s_attention(
        starter_lm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The starter model, a 1,100-token prompt prefilled in 512-token chunks through an exact
    paged cache: with the chunks' attention in numpy the last logits equal MLX's fused
    attention's within 1e-4 and the next 6 greedy tokens are the same."""
    import mlx.core as mx

    from engine.bench.needle import facts, needle_prompt
    from engine.kv import close_caches, make_paged_cache

    ids, _ = needle_prompt(starter_lm.tokenizer, 1100, 0.4, facts(2)[1], seed=5)
    settings = KVSettings(mode="exact", ssd_dir=tmp_path / "kv").validate()
    runs: list[tuple[list[int], Any]] = []
    for flag in (True, False):
        monkeypatch.setattr(cpu_select, "NP_CHUNK", flag)
        cache = make_paged_cache(starter_lm.model, settings, starter_lm.kv_geometry)
        try:
            for i in range(0, len(ids), 512):
                logits = starter_lm.model(mx.array(ids[i:i + 512])[None], cache=cache)[0, -1]
            first = logits
            toks = []
            for _ in range(6):
                toks.append(int(mx.argmax(logits).item()))  # type: ignore[arg-type]
                logits = starter_lm.model(mx.array([[toks[-1]]]), cache=cache)[0, -1]
            mx.eval(first)
            runs.append((toks, first))
        finally:
            close_caches(cache)
    assert runs[0][0] == runs[1][0]
    assert float(mx.abs(runs[0][1] - runs[1][1]).max()) < 1e-4


def test_sparse_prompt_chunks_and_votes_in_numpy_equal_mlx_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sparse mode past a trained length of 256, 512-token prompt chunks then decode steps:
    with the chunks' partials (`_partial_np`: the recent keys, causal, and the sinks, chosen
    blocks and window) and the votes' exp in numpy, and with MLX's ops alone, every output
    within 1e-5, and no question votes (past the trained length the question goes as
    steps, `attention.question_steps`); numpy ran for the chunks' partials only. Inside the
    trained length the votes in numpy are within 1e-5 of their largest of MLX's."""
    import mlx.core as mx

    monkeypatch.setattr(attention, "VOTE_SHARE", 0.5)
    spec = remap.RopeSpec(D, False, 10000.0, 1.0, 256)
    ran: list[int] = []
    real = cpu_select.chunk_partial

    def seen(*a: Any, **kw: Any) -> Any:
        ran.append(a[0].shape[1])
        return real(*a, **kw)

    monkeypatch.setattr(cpu_select, "chunk_partial", seen)  # the real one, observed

    def switch(on: bool) -> None:  # the chunks' partials, and the votes' exp past 65,536
        monkeypatch.setattr(cpu_select, "NP_CHUNK", on)
        monkeypatch.setattr(attention, "NP_EXP_MIN", 1 << 16 if on else 0)

    outs, votes = _layer_runs(tmp_path, switch, [512, 512, 512, 1, 1], 6, buffered=False,
                              mode="sparse", spec=spec)
    assert ran and set(ran) == {REP * 512} and len(ran) >= 3  # the chunks, numpy on
    for a, b in zip(*outs, strict=True):
        assert float(mx.abs(a - b).max()) < 1e-5
    assert len(votes) == 6 and all(v is None for v in votes)
    # Inside the trained length the chunks vote: numpy's exp and MLX's give the same votes.
    _, votes = _layer_runs(tmp_path / "in", switch, [512, 512, 512, 1, 1], 6, buffered=False,
                           mode="sparse")
    for a, b in zip(votes[:3], votes[3:], strict=True):
        assert a is not None and b is not None
        assert float(mx.abs(a - b).max()) <= 1e-5 * float(mx.abs(b).max())

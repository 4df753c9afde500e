"""Positions past the trained length (issue 19, item 2): sparse mode re-rotates the blocks it
reads so that every token it reads sits inside the trained window: by default moving only
what the trained length does not reach (the "reach" layout), else (a budget past the
trained length, or STRATA_SPARSE_REMAP_LAYOUT=infllm) sinks, chosen blocks and window
contiguously (InfLLM's).

The math on random tensors (re-rotating a rotated key equals rotating it at the target), one
attention step over real pages against attention computed at the remapped positions directly,
and the starter model: inside the trained window nothing changes, and a budget as large as
the context still equals exact attention while remapping is on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings, attention, question, remap
from engine.kv.cache import PagedLayerCache
from engine.kv.store import KVStore

H, D, P = 1, 16, 8


def _rope(x: Any, pos: Any, dims: int = D, traditional: bool = False,
          base: float = 10000.0) -> Any:
    """Rows x (N, D) rotated each at its own position pos (N,)."""
    import mlx.core as mx

    return mx.fast.rope(x[:, None], dims, traditional=traditional, base=base, scale=1.0,
                        offset=mx.array(pos, mx.int32))[:, 0]


@pytest.mark.parametrize("traditional", [False, True])
def test_rerotation_equals_rotating_at_the_target(traditional: bool) -> None:
    import mlx.core as mx

    mx.random.seed(1)
    h, n, b, d, dims = 3, 5, 4, 64, 48  # partial rotary: the last 16 dims stay as they are
    x = mx.random.normal((h, n, b, d))
    pos = mx.random.randint(0, 20000, (h, n, b))
    delta = mx.random.randint(-15000, 3000, (h, n))
    spec = remap.RopeSpec(dims, traditional, 100000.0, 1.0, 8192)
    cached = _rope(x.reshape(-1, d), pos.reshape(-1), dims, traditional,
                   100000.0).reshape(h, n, b, d)
    moved = remap.rerotate(cached, delta, spec)
    target = (pos + delta[..., None]).reshape(-1)
    direct = _rope(x.reshape(-1, d), target, dims, traditional, 100000.0).reshape(h, n, b, d)
    # float32 angles at positions ~2e4 round to ~1e-3 rad: the same rounding either way.
    assert float(mx.abs(moved - direct).max()) < 5e-3
    assert float(mx.abs(moved[..., dims:] - x[..., dims:]).max()) == 0.0
    # And it moved something: the cached keys differ from the target ones.
    assert float(mx.abs(cached - direct).max()) > 0.1


def test_block_deltas_place_blocks_between_sinks_and_window() -> None:
    import mlx.core as mx

    # 12 pages of 8 = 96 tokens; sink 1 page, window pages 10-11, chosen blocks 7 and 3.
    top, delta = remap.block_deltas(mx.array([[7, 3]]), 1, 10, 12, 8, 8)
    assert top.tolist() == [[3, 7]]
    starts = [0, 80, 88, 24, 56]                      # sink, window x2, chosen (sorted)
    q_shift = 8 + 16 - 80                             # query: W0 -> S + K
    new = [s + dl + q_shift for s, dl in zip(starts, delta[0].tolist(), strict=True)]
    assert new == [0, 24, 32, 8, 16]                  # sinks 0, chosen 8 and 16, window 24..


def test_reach_layout_moves_only_what_the_trained_length_does_not_reach() -> None:
    import mlx.core as mx

    # As above, the last query at 95 (end 96): trained 90 reaches all but positions 0-5, so
    # only the sink page moves, by 6; trained 40 moves the sink to 56 and packs blocks 3 and
    # 7 after it (64, 72); trained 30 (E = 66 > W0 - S - K = 56) falls back to InfLLM's.
    starts = [0, 80, 88, 24, 56]
    for trained, want in [(90, [6, 80, 88, 24, 56]), (40, [56, 80, 88, 64, 72]),
                          (30, None)]:
        top, delta = remap.block_deltas(mx.array([[7, 3]]), 1, 10, 12, 8, 8, 96, trained)
        assert top.tolist() == [[3, 7]]
        new = [s + dl for s, dl in zip(starts, delta[0].tolist(), strict=True)]
        if want is None:  # InfLLM's deltas (the queries move by S + K - W0 = -56 there)
            _, d0 = remap.block_deltas(mx.array([[7, 3]]), 1, 10, 12, 8, 8)
            assert delta.tolist() == d0.tolist()
        else:
            assert new == want
            assert min(new) >= 96 - trained  # every distance from 95 below `trained`


def _step(tmp_path: Path, spec: remap.RopeSpec | None, L: int,
          moved: Any = None, read: Any = None) -> tuple[Any, Any]:
    """One sparse chunk of L queries over 10 pages whose pages 3 and 6 hold keys aligned with
    the queries (the bound surely chooses them: budget 4 pages = sink, window, 2 blocks).
    Returns (attend's output, attention computed directly at the remapped positions: the
    InfLLM layout's, or `moved`(read positions) with the query at its own; `read`: the
    positions read, if not those)."""
    import mlx.core as mx

    mx.random.seed(0)
    s = KVSettings(mode="sparse", page_tokens=P, ssd_dir=tmp_path / "kv", sink_tokens=P,
                   window_tokens=P, budget_tokens=4 * P).validate()
    store = KVStore(s, n_layers=1, kv_heads=H, head_dim=D)
    remap.attach(store, spec)
    n = 10 * P
    pq = mx.arange(n, n + L)
    uq = mx.random.normal((L, D))                     # queries before rotation
    q = _rope(uq, pq)
    u = 0.3 * mx.random.normal((n + L, D))            # keys before rotation
    for page in (3, 6):
        at = mx.arange(page * P, (page + 1) * P)
        # Rotated, these keys are 2x the chunk's mean query: the largest logits by far.
        want = mx.broadcast_to(2 * q.mean(axis=0), (P, D))
        u[page * P:(page + 1) * P] = _rope(want, -at)
    k = _rope(u, mx.arange(n + L))
    v = mx.random.normal((n + L, D))
    cache = PagedLayerCache(store, 0)
    cache.update_and_fetch(k[None, None, :n], v[None, None, :n])
    kk, vv = cache.update_and_fetch(k[None, None, n:], v[None, None, n:])
    out = attention.attend(cache, q[None, None], kk, vv, 1.0)[0, 0]
    store.close()
    # Directly: the tokens read (sink page, pages 3 and 6, window page 9, the chunk) at
    # positions 0.. in that order when remapped, at their own positions when not.
    if read is None:
        read = mx.concatenate([mx.arange(0, P), mx.arange(3 * P, 4 * P),
                               mx.arange(6 * P, 7 * P), mx.arange(9 * P, n + L)])
    new = read if spec is None else moved(read) if moved is not None else mx.arange(
        read.shape[0])
    kd = _rope(u[read], new)
    qd = _rope(uq, new[-L:])
    sc = qd @ kd.T
    mask = mx.arange(read.shape[0])[None] <= (read.shape[0] - L + mx.arange(L))[:, None]
    sc = mx.where(mask, sc, -mx.inf)
    return out, mx.softmax(sc, axis=-1) @ v[read]


@pytest.mark.parametrize("L", [1, 3])
def test_remapped_step_equals_attention_at_the_new_positions(tmp_path: Path, L: int) -> None:
    import mlx.core as mx

    spec = remap.RopeSpec(D, False, 10000.0, 1.0, 32)  # "trained" at 32 tokens: remap on
    out, direct = _step(tmp_path, spec, L)
    assert float(mx.abs(out - direct).max()) < 1e-4
    # Without remapping the same blocks are read at their own positions: other numbers.
    plain, direct0 = _step(tmp_path / "b", None, L)
    assert float(mx.abs(plain - direct0).max()) < 1e-4
    assert float(mx.abs(plain - out).max()) > 1e-2


@pytest.mark.parametrize("L", [1, 3])
def test_reach_step_equals_attention_at_the_new_positions(tmp_path: Path, L: int,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    import mlx.core as mx

    # Trained at 8 pages + L tokens: the chunk ends at 10 pages + L, so E = 2 pages: the sink
    # page moves to [2P, 3P), right before page 3 (chosen, kept), page 6 and the window stay.
    spec = remap.RopeSpec(D, False, 10000.0, 1.0, 8 * P + L)
    out, direct = _step(tmp_path, spec, L,
                        lambda read: mx.where(read < P, read + 2 * P, read))
    assert float(mx.abs(out - direct).max()) < 1e-4
    # InfLLM's layout packs pages 3 and 6 before the window instead: other numbers.
    monkeypatch.setattr(remap, "LAYOUT", "infllm")
    packed, direct_packed = _step(tmp_path / "b", spec, L)
    assert float(mx.abs(packed - direct_packed).max()) < 1e-4
    assert float(mx.abs(packed - out).max()) > 1e-2


def test_prefill_chunk_past_the_trained_length_reads_the_recent_reach(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk past the trained length (PREFILL_RECENT) reads the sinks and the most
    recent tokens its budget (the trained length less the chunk) holds, all at their own
    distances but the sinks', which move just before them (StreamingLLM inside the trained
    reach): pages 3 and 6, the aligned ones a selection would choose, are not read."""
    import mlx.core as mx

    L = 8  # a prefill chunk; trained 48: budget 40 = sink page, window page, 3 pages chosen
    # (A chunk of at most QUESTION_L tokens is the question, which chooses: this small
    # geometry's chunk stands for the longer chunks of a prompt's prose.)
    monkeypatch.setattr(attention, "QUESTION_L", attention.SPARSE_MAX_L)
    spec = remap.RopeSpec(D, False, 10000.0, 1.0, 48)
    recent = mx.concatenate([mx.arange(0, P), mx.arange(6 * P, 10 * P + L)])
    out, direct = _step(tmp_path, spec, L, lambda read: mx.where(read < P, read + 5 * P, read),
                        read=recent)
    assert float(mx.abs(out - direct).max()) < 1e-4
    monkeypatch.setattr(attention, "PREFILL_RECENT", False)   # chooses: other blocks
    chosen, _ = _step(tmp_path / "b", spec, L, read=recent)
    assert float(mx.abs(chosen - out).max()) > 1e-2


def _far_step(tmp_path: Path, aligned: tuple[int, int] = (265, 273),
              infllm: bool = False) -> tuple[Any, Any]:
    """A decode step at 320 over 40 pages, the spec trained at 64 (E = 257): pages 2 and 5
    hold keys aligned with the query once moved to `aligned` (by default where the reach
    layout puts chosen blocks, E + S = 265 on), and not at their own positions (base 100:
    every frequency turns). Returns (attend's output, attention with pages 2 and 5 read at
    265 and 273, the sinks at 257; `infllm`: the sink page at 0, pages 2 and 5 at 8 and 16,
    the window page and the query after them, InfLLM's frame)."""
    import mlx.core as mx

    mx.random.seed(2)
    base, n = 100.0, 40 * P
    s = KVSettings(mode="sparse", page_tokens=P, ssd_dir=tmp_path / "kv", sink_tokens=P,
                   window_tokens=P, budget_tokens=4 * P).validate()
    store = KVStore(s, n_layers=1, kv_heads=H, head_dim=D)
    spec = remap.RopeSpec(D, False, base, 1.0, 64)
    remap.attach(store, spec)
    uq = mx.random.normal((1, D))
    q = _rope(uq, mx.array([n]), base=base)
    u = 0.3 * mx.random.normal((n + 1, D))
    want = mx.broadcast_to(2 * q[0], (P, D))
    for page, at in zip((2, 5), aligned, strict=True):
        u[page * P:(page + 1) * P] = _rope(want, -mx.arange(at, at + P), base=base)
    k = _rope(u, mx.arange(n + 1), base=base)
    v = mx.random.normal((n + 1, D))
    cache = PagedLayerCache(store, 0)
    cache.update_and_fetch(k[None, None, :n], v[None, None, :n])
    kk, vv = cache.update_and_fetch(k[None, None, n:], v[None, None, n:])
    out = attention.attend(cache, q[None, None], kk, vv, 1.0)[0, 0]
    store.close()
    read = mx.concatenate([mx.arange(0, P), mx.arange(2 * P, 3 * P), mx.arange(5 * P, 6 * P),
                           mx.arange(39 * P, n + 1)])
    new = mx.arange(read.shape[0]) if infllm else mx.concatenate(
        [mx.arange(257, 281), mx.arange(39 * P, n + 1)])
    sc = _rope(uq, new[-1:], base=base) @ _rope(u[read], new, base=base).T
    return out, mx.softmax(sc, axis=-1) @ v[read]


def test_far_candidates_are_scored_where_they_will_be_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FAR_ROTATE: a decode step scores a candidate the trained length does not reach with
    the query rotated back to where the layout would put it, so the blocks that match there
    are chosen (and read there); scored at their own positions they are not."""
    import mlx.core as mx

    out, direct = _far_step(tmp_path)
    assert float(mx.abs(out - direct).max()) < 1e-4
    monkeypatch.setattr(attention, "FAR_ROTATE", False)
    plain, _ = _far_step(tmp_path / "b")
    assert float(mx.abs(plain - direct).max()) > 1e-2


def test_infllm_scores_far_candidates_far_distance_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With InfLLM's layout a decode step scores every candidate further back than
    FAR_DISTANCE as if it sat FAR_DISTANCE before the query (near where that layout reads
    it), not at the trained length's edge: the blocks that match there are chosen and read
    in InfLLM's frame; scored at the edge (the reach layout's rule) they are not."""
    import mlx.core as mx

    monkeypatch.setattr(remap, "LAYOUT", "infllm")
    monkeypatch.setattr(attention, "FAR_DISTANCE", 16)
    spec = remap.RopeSpec(D, False, 100.0, 1.0, 64)
    assert attention.far_of(spec, 321, P) == (spec, 305, 0)
    # Both pages match 16 back from the step's end (321 - 16 = 305 on).
    out, direct = _far_step(tmp_path, (305, 305), infllm=True)
    assert float(mx.abs(out - direct).max()) < 1e-4
    monkeypatch.setattr(attention, "FAR_DISTANCE", 64 - P)  # scored where "reach" puts them
    edge, _ = _far_step(tmp_path / "b", (305, 305), infllm=True)
    assert float(mx.abs(edge - direct).max()) > 1e-2


def test_auto_layout_is_reach_near_the_trained_length_then_infllm(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = remap.RopeSpec(D, False, 100.0, 1.0, 8192)
    monkeypatch.setattr(remap, "LAYOUT", "auto")
    near, far = 8192 + remap.REACH_PAST, 8192 + remap.REACH_PAST + 1
    assert remap.reach(near, 8192) and not remap.reach(far, 8192)
    assert attention.far_of(spec, near, 128) == (spec, near - 8192, 128)
    assert attention.far_of(spec, far, 128) == (spec, far - attention.FAR_DISTANCE, 0)
    monkeypatch.setattr(remap, "LAYOUT", "reach")
    assert remap.reach(10 ** 6, 8192)


def test_far_scores_rotate_once_a_page() -> None:
    """`_score` with far rows in runs of a page's blocks rotates the query once a run: the
    same bound as rotating it for each block by its page's shift."""
    import mlx.core as mx

    mx.random.seed(3)
    h, n, nb, d, r = 3, 64, 16, 64, 3
    bmin = mx.random.normal((h, n, d))
    bmax, qt = bmin + mx.abs(mx.random.normal((h, n, d))), mx.random.normal((h, d, r))
    spec = remap.RopeSpec(d, False, 100000.0, 1.0, 8192)
    far, starts = (spec, 300, 128), (mx.arange(n) * 8)[None]        # pages of 128 tokens
    paged = attention._score(bmin, bmax, qt, mx.zeros((h, r)), starts, far, nb)
    each = attention._score(bmin, bmax, qt, mx.zeros((h, r)), starts // 128 * 128, far)
    plain = attention._score(bmin, bmax, qt, mx.zeros((h, r)))
    assert float(mx.abs(paged - each).max()) < 1e-4
    # Pages 0-2 start before E = 300 and are moved; page 3 is not.
    assert float(mx.abs(paged - plain)[:, :48].max()) > 1e-2
    assert float(mx.abs(paged - plain)[:, 48:].max()) < 1e-5


@pytest.mark.parametrize("run", [1, 4])
def test_far_pages_bound_in_runs_equal_each_page_at_its_run_start(run: int) -> None:
    """The page pass (one row a page) rotates once a run of `run` pages; 10 pages in runs of
    4 leave a partial last run, padded and cut: the same bound as each page shifted by its
    run's first page, and the far pages' bound moves while the near ones' does not."""
    import mlx.core as mx

    mx.random.seed(5)
    h, n, d, r = 2, 10, 64, 4
    bmin = mx.random.normal((h, n, d))
    bmax, qt = bmin + mx.abs(mx.random.normal((h, n, d))), mx.random.normal((h, d, r))
    spec = remap.RopeSpec(d, True, 10000.0, 1.0, 8192)
    starts = (mx.arange(n) * 128)[None]
    far = (spec, 900, 64)                                   # pages 0-7 start before E = 900
    runs = attention._score(bmin, bmax, qt, mx.zeros((h, r)), starts, far, run)
    each = attention._score(bmin, bmax, qt, mx.zeros((h, r)), starts // (run * 128) * (run * 128),
                            far)
    assert runs.shape == (h, n)
    assert float(mx.abs(runs - each).max()) < 1e-4
    import numpy as np

    diff = np.array(mx.abs(runs - attention._score(bmin, bmax, qt, mx.zeros((h, r)))))
    moved = np.array(starts // (run * 128) * (run * 128) < 900)[0]
    assert diff[:, moved].max() > 1e-2
    assert diff[:, ~moved].max() < 1e-5


def test_models_with_their_own_scaling_are_not_remapped(starter_lm: Any) -> None:
    from engine.kv import geometry_of

    g = geometry_of(starter_lm.model)
    assert (g.rope_dims, g.trained_context, g.rope_base) == (64, 8192, 100000.0)
    assert remap.spec_of(g) is not None

    class Args:
        max_position_embeddings = 8192
        rope_scaling = {"rope_type": "yarn", "factor": 2.0}

    class Scaled:
        args = Args()
        layers = starter_lm.model.layers

    assert remap.rope_fields(Scaled()) == {}


# -- the starter model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompt(starter_lm: Any) -> list[int]:
    from engine.bench.needle import facts, needle_prompt

    ids, _ = needle_prompt(starter_lm.tokenizer, 450, 0.3, facts(3)[0], seed=3)
    return ids


def _logits(lm: Any, ids: list[int], settings: KVSettings, spec: Any) -> Any:
    """Last-token logits: all but the last token prefilled in 256-token chunks through a
    paged cache, then the last as a decode step;
    spec: 'geometry' (the model's own, as a session has it), None or a RopeSpec."""
    import mlx.core as mx

    from engine.kv import close_caches, make_paged_cache

    cache = make_paged_cache(lm.model, settings, lm.kv_geometry)
    store = cache[0].store
    if spec != "geometry":
        remap.attach(store, spec)
    try:
        for i in range(0, len(ids) - 1, 256):
            lm.model(mx.array(ids[i:min(i + 256, len(ids) - 1)])[None], cache=cache)
        out = lm.model(mx.array(ids[-1:])[None], cache=cache)  # a decode step
        mx.eval(out)
        return out[0, -1]
    finally:
        close_caches(cache)


def test_inside_the_trained_window_remapping_changes_nothing(
        starter_lm: Any, prompt: list[int], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    calls = []
    real = remap.rerotate

    def counted(k: Any, delta: Any, spec: remap.RopeSpec) -> Any:
        calls.append(k.shape)
        return real(k, delta, spec)

    monkeypatch.setattr(remap, "rerotate", counted)  # the real one, counted
    # The numpy steps lay out and turn the chosen blocks in one compiled loop: a call with a
    # spec is a remapped read too.
    from engine.kv import cpu_select

    attend_blocks = cpu_select.attend_blocks

    def blocks_counted(*a: Any) -> Any:
        if a[8] is not None:
            calls.append(a[4].shape)
        return attend_blocks(*a)

    monkeypatch.setattr(cpu_select, "attend_blocks", blocks_counted)

    base = KVSettings(mode="exact", page_tokens=64, sink_tokens=64, window_tokens=128,
                      budget_tokens=384, ssd_dir=tmp_path / "kv").validate()
    exact = _logits(starter_lm, prompt, base, "geometry")
    sparse = base.with_(mode="sparse")
    on = _logits(starter_lm, prompt, sparse, "geometry")     # 450 < 8,192: not remapped
    off = _logits(starter_lm, prompt, sparse, None)
    assert float(mx.abs(on - off).max()) == 0.0
    assert not calls
    # Remapping on (a spec "trained" at 256, so the prompt's later chunks attend sparsely
    # with remapped positions) with a budget as large as the context: exact attention.
    g = starter_lm.kv_geometry
    spec = remap.RopeSpec(g.rope_dims, g.rope_traditional, g.rope_base, g.rope_scale, 256)
    full = _logits(starter_lm, prompt, sparse.with_(budget_tokens=1024), spec)
    assert float(mx.abs(full - exact).max()) < 1e-4
    assert not calls
    # ... and with a small budget the chunk past 256 attends sparsely, remapped. (At this
    # scale moving blocks by at most ~200 positions changes the logits by ~1e-5 only.)
    small = _logits(starter_lm, prompt, sparse, spec)
    assert calls and float(mx.abs(small - exact).max()) > 0.0


def test_prefill_past_the_trained_length_attends_to_the_trained_reach(
        starter_lm: Any, prompt: list[int], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk past the trained length selects with a budget of the trained length
    less the chunk (PREFILL_REACH), a decode step with the settings' budget: at the decode
    budget the prose past the trained length lost every fact (docs/benchmarks.md, issue 19's
    eighth pass). Over more than PREFILL_REACH_PAST past tokens (a question after a stored
    128k context) a chunk keeps the settings' budget too."""
    import mlx.core as mx

    from engine.kv import close_caches, make_paged_cache

    budgets: list[tuple[int, Any]] = []
    real = attention.select_blocks

    def spied(store: Any, layer: int, qg: Any, *a: Any, **k: Any) -> Any:
        budgets.append((qg.shape[1], a[4] if len(a) > 4 else k.get("budget")))
        return real(store, layer, qg, *a, **k)

    monkeypatch.setattr(attention, "select_blocks", spied)  # the real one, observed
    settings = KVSettings(mode="sparse", page_tokens=64, sink_tokens=64, window_tokens=128,
                          budget_tokens=256, ssd_dir=tmp_path / "kv").validate()
    g = starter_lm.kv_geometry
    trained = 384
    cache = make_paged_cache(starter_lm.model, settings, g)
    remap.attach(cache[0].store, remap.RopeSpec(g.rope_dims, g.rope_traditional, g.rope_base,
                                                g.rope_scale, trained))
    try:
        n = 448
        for i in range(0, n, 64):
            starter_lm.model(mx.array(prompt[i:i + 64])[None], cache=cache)
        mx.eval(starter_lm.model(mx.array(prompt[n:n + 1])[None], cache=cache))
    finally:
        close_caches(cache)
    rows = 3 * 64  # the starter's 9 query heads over 3 KV heads, 64 queries a chunk
    assert (rows, trained - 64) in budgets            # the chunk [384, 448)
    assert any(r == 3 and b is None for r, b in budgets)  # the decode step: the settings'
    for name, value in (("PREFILL_REACH", False), ("PREFILL_REACH_PAST", 0)):
        with monkeypatch.context() as m:
            m.setattr(attention, name, value)
            budgets.clear()
            cache = make_paged_cache(starter_lm.model, settings, g)
            remap.attach(cache[0].store, remap.RopeSpec(
                g.rope_dims, g.rope_traditional, g.rope_base, g.rope_scale, trained))
            try:
                for i in range(0, 448, 64):
                    starter_lm.model(mx.array(prompt[i:i + 64])[None], cache=cache)
            finally:
                close_caches(cache)
            assert budgets and all(b is None for _, b in budgets), name


def test_a_question_past_the_trained_length_chooses_as_one_far_scored_chunk(
        starter_lm: Any, prompt: list[int], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """generate.py prefills a prompt past the trained length (sparse, remapped) in chunks,
    then its last QUESTION_STEPS tokens as chunks of QUESTION_L queries (one chunk), each
    choosing blocks as a decode step does (the decode budget, far candidates scored moved):
    the question must read a fact the trained reach of a chunk does not see, and its tokens'
    weights together rank it better than any one step's (docs/benchmarks.md, issue 19).
    Within the trained length the prompt goes in chunks, and only its last token alone."""
    from engine.runtime.generate import generate
    from engine.runtime.sampling import SamplingParams

    steps: list[tuple[int, int, Any, Any]] = []
    real = attention.select_blocks

    def spied(store: Any, layer: int, qg: Any, n_pages: int, acc: Any, start: int = -1,
              held: Any = None, budget: Any = None, recent_only: bool = False,
              far: Any = None, *a: Any, **k: Any) -> Any:
        if layer == 0:  # 9 query heads over 3 KV heads
            steps.append((qg.shape[1] // 3, start, budget, far))
        return real(store, layer, qg, n_pages, acc, start, held, budget, recent_only, far,
                    *a, **k)

    monkeypatch.setattr(attention, "select_blocks", spied)  # the real one, observed
    from engine.kv import cpu_select

    shortlists: list[tuple[int, int, int]] = []
    real_rescore = cpu_select.rescore

    def rescored(q: Any, m0: Any, sc: Any, k_sel: int, m: int, *a: Any) -> Any:
        shortlists.append((q.shape[1] // 3, k_sel, m))
        return real_rescore(q, m0, sc, k_sel, m, *a)

    monkeypatch.setattr(cpu_select, "rescore", rescored)  # the real one, observed
    old = starter_lm.kv_settings
    starter_lm.kv_settings = KVSettings(mode="sparse", page_tokens=64, sink_tokens=64,
                                        window_tokens=128, budget_tokens=256,
                                        ssd_dir=tmp_path / "kv").validate()
    g = starter_lm.kv_geometry
    n = len(prompt)
    assert attention.QUESTION_L == attention.QUESTION_STEPS  # the default: one chunk
    try:
        for trained, want in ((384, attention.QUESTION_STEPS), (8192, 1)):
            steps.clear()
            pc = starter_lm.new_cache()
            remap.attach(pc.cache[0].store, remap.RopeSpec(
                g.rope_dims, g.rope_traditional, g.rope_base, g.rope_scale, trained))
            out = list(generate(starter_lm, prompt, SamplingParams(temperature=0.0),
                                max_tokens=2, prompt_cache=pc))
            pc.close()
            assert out and out[-1].finish_reason is not None
            asked = [(L, s, b, f) for L, s, b, f in steps
                     if s < n and L <= attention.QUESTION_L and s + L > n - want]
            covered = sorted({s + i for L, s, _, _ in asked for i in range(L)})
            assert covered == list(range(n - want, n)), trained
            if trained == 384:
                # One chunk read twice (engine.kv.ask): at the wide budget, then at the
                # narrow one, far candidates scored moved both times.
                spec = remap.RopeSpec(g.rope_dims, g.rope_traditional, g.rope_base,
                                      g.rope_scale, trained)
                assert [(L, s, b) for L, s, b, _ in asked] == [
                    (want, n - want, question.wide_budget(spec)),
                    (want, n - want, question.narrow_budget(spec, n))]
                assert all(f is not None for _, _, _, f in asked)
                # The wide pass's shortlist is RESCORE x its 20 blocks ((288 - a sink page
                # and a window page of 64) / 8), past the cap a decode step keeps
                # (RESCORE_CAP x the budget: 32 blocks here); the narrow pass's RESCORE x
                # its 2 ((144 - 128) / 8). (Without the numpy path MLX's _rescore
                # shortlists, and nothing is recorded here.)
                cap = int(attention.RESCORE_CAP * 256) // 8
                assert shortlists or not cpu_select.enabled(3 * want)
                if shortlists:
                    assert {(L, m) for L, k, m in shortlists if L == want} == {
                        (want, attention.RESCORE * 20), (want, attention.RESCORE * 2)}
                    assert attention.RESCORE * 20 > cap
            shortlists.clear()
    finally:
        starter_lm.kv_settings = old

"""The question past the trained length read twice (engine.kv.question, attention.ask): the
blocks a wide first pass's weights favour, with their neighbours, are held by the second pass
and the reply within the narrow budget; inside the trained window `ask` is one plain pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings, attention, question, remap
from engine.kv.table import LayerTable


def test_fixed_blocks_best_first_with_neighbours() -> None:
    weights = np.array([[0.1, 0.9, 0.3, 0.0], [0.5, 0.1, 0.2, 0.7]], np.float32)
    blocks = np.array([[20, 10, 11, 40], [5, 30, 31, 7]])
    fixed = question.fixed_blocks(weights, blocks, lo=4, hi=32)
    # Head 0: 10 (9, 10, 11), 11 (12), 20 (19, 20, 21); 40 is past hi. Head 1: 7 (6, 7, 8),
    # 5 (4, 5; 3 is a sink block), 31 (30, 31; 32 is the window's), 30 (29). The shorter
    # row ends in -1.
    assert fixed.tolist() == [[9, 10, 11, 12, 19, 20, 21, -1], [6, 7, 8, 4, 5, 30, 31, 29]]
    assert fixed.dtype == np.int64


def test_held_blocks_come_first_and_the_choice_fills_the_rest() -> None:
    fixed = np.array([[5, 6, -1], [9, 40, -1]])
    top = np.array([[6, 1, 2, 3], [1, 9, 2, 3]])
    # Head 0 keeps 5 and 6 (6 is its own choice too), then 1 and 2; head 1's 40 is past hi.
    held = attention._hold(fixed, top, 0, 32, 4)
    assert held.tolist() == [[5, 6, 1, 2], [9, 1, 2, 3]]


def test_narrow_budget_follows_the_context() -> None:
    spec = remap.RopeSpec(64, False, 10000.0, 1.0, 8192)
    assert question.wide_budget(spec) == 6144
    assert question.narrow_budget(spec, 16384) == 3072   # 2x the trained length
    assert question.narrow_budget(spec, 20480) == 2457
    assert question.narrow_budget(spec, 32768) == 2048   # 4x: the floor
    assert question.narrow_budget(spec, 1 << 20) == 2048
    # Read twice only up to WIDE_MAX x the trained length (measured there).
    assert question.applies(spec, int(question.WIDE_MAX * 8192))
    assert not question.applies(spec, int(question.WIDE_MAX * 8192) + 1)


def test_the_wide_pass_fixes_the_block_its_rows_weigh_most() -> None:
    """`_fix_votes` on keys laid out as `_sparse` lays them (sink blocks, then the chosen
    blocks in `top`'s order): the chosen block whose keys point along the query rows comes
    first, with its neighbours, in the row of that head only."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    h, r, d, b = 2, 6, 16, 8
    sink_blocks, top = 2, np.array([[5, 9, 14, 20], [6, 9, 15, 21]])
    q = rng.standard_normal((h, r, d)).astype(np.float32) * 0.1
    k_rot = rng.standard_normal((h, (sink_blocks + top.shape[1]) * b, d)).astype(np.float32)
    k_rot *= 0.1
    k_win = rng.standard_normal((h, 4 * b, d)).astype(np.float32) * 0.1
    # Head 1's third chosen block (15) holds keys along its rows' mean: it takes their weight.
    at = (sink_blocks + 2) * b
    k_rot[1, at:at + b] = 40 * q[1].mean(axis=0)
    table = LayerTable(16 * b, 1, 4)
    attention._fix_votes(table, mx.array(q), mx.array(k_rot), mx.array(k_win),
                         mx.array(top.astype(np.int32)), 4, 30, start=700)
    assert table.votes_at == 700 and table.votes is None
    assert table.fixed[1, :3].tolist() == [14, 15, 16]
    assert table.fixed[0, 0] != 14


def _prefilled(lm: Any, ids: list[int], tmp_path: Path, trained: int) -> tuple[Any, Any]:
    """A sparse paged cache of the starter declared trained at `trained`, holding all of
    `ids` but the question (its last QUESTION_STEPS tokens before the last one)."""
    import mlx.core as mx

    from engine.kv import make_paged_cache

    g = lm.kv_geometry
    spec = remap.RopeSpec(g.rope_dims, g.rope_traditional, g.rope_base, g.rope_scale, trained)
    settings = KVSettings(mode="sparse", page_tokens=16, sink_tokens=16, window_tokens=64,
                          budget_tokens=160, ssd_dir=tmp_path / "kv").validate()
    cache = make_paged_cache(lm.model, settings, g)
    remap.attach(cache[0].store, spec)
    split = len(ids) - 1 - attention.QUESTION_STEPS
    for i in range(0, split, 64):
        lm.model(mx.array(ids[i:min(i + 64, split)])[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache, spec


def _starts_with_fixed(top: np.ndarray, fixed: np.ndarray) -> None:
    assert top.shape[0] == fixed.shape[0]
    for row, f in zip(top, fixed, strict=True):
        f = f[f >= 0][:len(row)]
        assert len(f) and row[:len(f)].tolist() == f.tolist()


def test_the_question_reads_twice_and_the_reply_holds_its_blocks(
        starter_lm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The starter past a trained length of 512 (a 1,100-token needle prompt): the question's
    chunk runs once at the wide budget (recording every layer's fixed blocks) and once at the
    narrow one holding them; the cache holds it once; the reply's decode step reads the
    narrow budget and chooses the fixed blocks first."""
    import mlx.core as mx

    from engine.bench.needle import facts, needle_prompt
    from engine.kv import ask, close_caches

    ids, _ = needle_prompt(starter_lm.tokenizer, 1100, 0.3, facts(3)[0], seed=3)
    n_layers = starter_lm.kv_geometry.layers
    budgets: list[tuple[int, int | None]] = []
    tops: list[np.ndarray] = []
    real_select = attention.select_blocks

    def select(store: Any, layer: int, qg: Any, n_pages: int, acc: Any, start: int = -1,
               held: Any = None, budget: int | None = None, *a: Any, **k: Any) -> Any:
        out = real_select(store, layer, qg, n_pages, acc, start, held, budget, *a, **k)
        budgets.append((qg.shape[1], budget))
        if out is not None:
            tops.append(np.asarray(out[0]))
        return out

    monkeypatch.setattr(attention, "select_blocks", select)  # the real one, observed
    cache, spec = _prefilled(starter_lm, ids, tmp_path, 512)
    store = cache[0].store
    try:
        budgets.clear()
        tops.clear()
        split = len(ids) - 1 - attention.QUESTION_STEPS
        q = mx.array(ids[split:-1])[None]
        out = ask(lambda x: starter_lm.model(x, cache=cache), cache, q)
        mx.eval(out)
        rows = (attention.QUESTION_STEPS * starter_lm.model.args.num_attention_heads
                // store.kv_heads)
        wide, narrow = question.wide_budget(spec), question.narrow_budget(spec, len(ids) - 1)
        assert (wide, narrow) == (384, 3 * 512 * 512 // (4 * (len(ids) - 1)))
        assert budgets == [(rows, wide)] * n_layers + [(rows, narrow)] * n_layers
        assert all(c.offset == len(ids) - 1 for c in cache)  # the first pass trimmed away
        assert not question.wide(store)
        for layer, table in enumerate(store.tables):
            assert table.votes_at == split
            assert table.fixed is not None and table.fixed.shape[0] == store.kv_heads
            # The second pass chose the fixed blocks first (within its k).
            _starts_with_fixed(tops[n_layers + layer], table.fixed)
        budgets.clear()
        tops.clear()
        logits = starter_lm.model(mx.array(ids[-1:])[None], cache=cache)[0, -1]
        mx.eval(logits)
        assert bool(mx.isfinite(logits).all())
        assert [b for _, b in budgets] == [question.narrow_budget(spec, len(ids))] * n_layers
        for layer, table in enumerate(store.tables):
            _starts_with_fixed(tops[layer], table.fixed)
        # A new prompt's chunk (not this question's) drops them.
        starter_lm.model(mx.array(ids[:40])[None], cache=cache)
        assert all(t.fixed is None for t in store.tables)
    finally:
        close_caches(cache)


def test_inside_the_trained_window_ask_is_one_pass(starter_lm: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    from engine.bench.needle import facts, needle_prompt
    from engine.kv import ask, close_caches

    ids, _ = needle_prompt(starter_lm.tokenizer, 450, 0.3, facts(3)[0], seed=3)
    calls: list[int] = []
    real = attention._fix_votes
    monkeypatch.setattr(attention, "_fix_votes", lambda *a, **k: calls.append(1) or real(
        *a, **k))
    got = []
    for two in (True, False):
        cache, _ = _prefilled(starter_lm, ids, tmp_path / str(two), 8192)
        try:
            q = mx.array(ids[len(ids) - 1 - attention.QUESTION_STEPS:-1])[None]
            out = (ask(lambda x, c=cache: starter_lm.model(x, cache=c), cache, q) if two
                   else starter_lm.model(q, cache=cache))
            mx.eval(out)
            got.append(out)
            assert all(t.fixed is None for t in cache[0].store.tables)
        finally:
            close_caches(cache)
    assert not calls
    assert float(mx.abs(got[0] - got[1]).max()) == 0.0


def test_a_restored_question_is_read_twice_again(starter_lm: Any, tmp_path: Path) -> None:
    """A prompt past the trained length (512 here) stored with its tail: restored into a
    fresh cache, its question is prefilled again (a whole restore would skip the wide pass),
    and the fixed blocks and the greedy reply equal the fresh prefill's. (The tail after the
    last page holds the question here; a question across a page boundary is prefilled only
    from the tail on, as the question's votes are inside the trained length.)"""
    from engine.bench.needle import facts, needle_prompt
    from engine.kv.prefix import PrefixSettings
    from engine.runtime.generate import generate
    from engine.runtime.sampling import SamplingParams

    ids, _ = needle_prompt(starter_lm.tokenizer, 1140, 0.3, facts(3)[0], seed=3)
    assert len(ids) % 64 > attention.QUESTION_STEPS
    g = starter_lm.kv_geometry
    spec = remap.RopeSpec(g.rope_dims, g.rope_traditional, g.rope_base, g.rope_scale, 512)
    old = starter_lm.kv_settings
    runs = []
    try:
        for run in ("fresh", "restored"):
            starter_lm.kv_settings = KVSettings(
                mode="sparse", page_tokens=64, sink_tokens=64, window_tokens=128,
                budget_tokens=256, ssd_dir=tmp_path / run).validate()
            px = starter_lm.enable_prefix_cache(PrefixSettings(folder=tmp_path / "px",
                                                               tails=True))
            pc = starter_lm.new_cache()
            store = pc.cache[0].store  # type: ignore[attr-defined]
            remap.attach(store, spec)
            try:
                events = list(generate(starter_lm, ids, SamplingParams(temperature=0.0),
                                       max_tokens=4, prompt_cache=pc))
                runs.append(([e.token for e in events if e.token is not None],
                             events[-1].cached_tokens, [t.fixed for t in store.tables]))
                px.flush()
            finally:
                pc.close()
                starter_lm.disable_prefix_cache()
    finally:
        starter_lm.kv_settings = old
    (tok_f, cached_f, fixed_f), (tok_r, cached_r, fixed_r) = runs
    assert cached_f == 0
    assert cached_r == len(ids) - attention.QUESTION_STEPS
    assert all(f is not None for f in fixed_f)
    assert all((a == b).all() for a, b in zip(fixed_f, fixed_r, strict=True))
    assert tok_r == tok_f and tok_f

"""Sparse decode steps reuse the bound's shortlist (engine.kv.attention.RESELECT_STEPS): the
step after the one that bounded ranks that step's shortlist by its own true logits (with
the bound alone it reads exactly the blocks that step chose), the next one bounds again,
and a step that does not follow bounds at once. Real pages in a real store; the outputs are
compared with attention computed directly over the tokens read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings, attention
from engine.kv.cache import PagedLayerCache
from engine.kv.store import KVStore

H, D, P = 1, 16, 8


def _steps(tmp_path: Path, queries: list[Any], trim_before: int = -1
           ) -> tuple[list[Any], Any, list[Any]]:
    """Decode steps over 10 pages (sink page, window page, a budget of 2 more blocks), one
    per query, the keys and values of each step random; page 3 holds keys aligned with the
    first query, page 6 with the second. Returns each step's output, (keys, values), and for
    each step that bounded, the two pages its bound ranks best (None for a step that
    reused the bound before it, or that chose in one compiled pass)."""
    import mlx.core as mx
    import numpy as np

    mx.random.seed(7)
    s = KVSettings(mode="sparse", page_tokens=P, ssd_dir=tmp_path / "kv", sink_tokens=P,
                   window_tokens=P, budget_tokens=4 * P).validate()
    store = KVStore(s, n_layers=1, kv_heads=H, head_dim=D)
    n = 10 * P
    k = 0.3 * mx.random.normal((n + len(queries), D))
    k[3 * P:4 * P] = mx.broadcast_to(2 * queries[0], (P, D))
    k[6 * P:7 * P] = mx.broadcast_to(2 * queries[1], (P, D))
    v = mx.random.normal((n + len(queries), D))
    cache = PagedLayerCache(store, 0)
    cache.update_and_fetch(k[None, None, :n], v[None, None, :n])
    outs, best = [], []
    for i, q in enumerate(queries):
        if i == trim_before:  # the step starts where the one before did (a trim)
            cache.trim(1)
        kk, vv = cache.update_and_fetch(k[None, None, n + i:n + i + 1],
                                        v[None, None, n + i:n + i + 1])
        outs.append(attention.attend(cache, q[None, None, None], kk, vv, 1.0)[0, 0, 0])
        last = store.tables[0].chosen  # (key, next, steps served, (bound, candidates))
        if last is None:  # chosen in one compiled pass (cpu_select.choose): nothing kept
            best.append(None)
            continue
        bound = np.array(last[3][0][0])  # candidates: pages 1..8, one block each
        best.append(sorted((np.argsort(-bound)[:2] + 1).tolist()) if last[2] == 1 else None)
    store.close()
    return outs, (k, v), best


def _direct(q: Any, kv: Any, pages: list[int], tail: list[int]) -> Any:
    """Attention of q over the sink page, `pages` (one block each here), the window page 9
    and the tail tokens `tail` (indices into the keys and values)."""
    import mlx.core as mx

    k, v = kv
    read = mx.concatenate([mx.arange(0, P), *[mx.arange(p * P, (p + 1) * P) for p in pages],
                           mx.arange(9 * P, 10 * P), mx.array(tail)])
    return mx.softmax(q[None] @ k[read].T, axis=-1)[0] @ v[read]


def _queries() -> tuple[Any, Any]:
    import mlx.core as mx

    mx.random.seed(1)
    return mx.random.normal((D,)), mx.random.normal((D,))


def test_the_next_step_reuses_the_bound_then_bounds_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    a, b = _queries()
    monkeypatch.setattr(attention, "RESCORE", 1)  # the bound alone chooses
    monkeypatch.setattr(attention, "RESELECT_STEPS", 2)
    outs, kv, best = _steps(tmp_path, [a, b, b])
    assert 3 in best[0] and 6 not in best[0]      # step 1's bound wants page 3
    assert best[1] is None                        # step 2 reused it ...
    assert float(mx.abs(outs[1] - _direct(b, kv, best[0], [80, 81])).max()) < 1e-5
    assert best[2] is not None and 6 in best[2]   # ... step 3 bounded again
    monkeypatch.setattr(attention, "RESELECT_STEPS", 1)
    every, _, fresh = _steps(tmp_path / "b", [a, b, b])
    assert fresh[1] is not None and 6 in fresh[1]
    assert float(mx.abs(every[1] - outs[1]).max()) > 1e-2
    assert float(mx.abs(every[2] - outs[2]).max()) < 1e-5


def test_the_reused_shortlist_is_ranked_by_each_step_s_query(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the true logits ranking (RESCORE 4) a shortlist of every candidate (no cap):
    the step that reuses the bound reads what a step that bounds reads, page 6, not step
    1's choice."""
    import mlx.core as mx

    a, b = _queries()
    monkeypatch.setattr(attention, "RESCORE", 4)
    monkeypatch.setattr(attention, "RESCORE_CAP", 0.0)
    monkeypatch.setattr(attention, "RESELECT_STEPS", 4)
    outs, kv, best = _steps(tmp_path, [a, b])
    assert best[1] is None
    monkeypatch.setattr(attention, "RESELECT_STEPS", 1)
    every, _, fresh = _steps(tmp_path / "b", [a, b])
    assert float(mx.abs(every[1] - outs[1]).max()) < 1e-5
    assert float(mx.abs(outs[1] - _direct(b, kv, best[0], [80, 81])).max()) > 1e-2


def test_a_step_that_does_not_follow_bounds_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    a, b = _queries()
    monkeypatch.setattr(attention, "RESCORE", 1)
    monkeypatch.setattr(attention, "RESELECT_STEPS", 4)
    # The second step replaces the first's token (a trim): it starts where the first did.
    outs, kv, best = _steps(tmp_path, [a, b], trim_before=1)
    assert best[1] is not None and 6 in best[1]
    assert float(mx.abs(outs[1] - _direct(b, kv, best[1], [81])).max()) < 1e-5

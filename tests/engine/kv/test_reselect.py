"""Sparse decode steps reuse a choice (engine.kv.attention.RESELECT_STEPS): the step after the
one that chose reads exactly the blocks that step chose, the next one chooses again, and a
new page or a step that does not follow chooses at once. Real pages in a real store; the
outputs are compared with attention computed directly over the tokens read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings, attention
from engine.kv.cache import PagedLayerCache
from engine.kv.store import KVStore

H, D, P = 1, 16, 8


def _steps(tmp_path: Path, queries: list[Any], trim_before: int = -1) -> tuple[list[Any], Any]:
    """Decode steps over 10 pages (sink page, window page, a budget of 2 more blocks), one
    per query, the keys and values of each step random; page 3 holds keys aligned with the
    first query, page 6 with the others. Returns each step's output and (keys, values,
    each step's chosen blocks)."""
    import mlx.core as mx

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
    outs, chosen = [], []
    for i, q in enumerate(queries):
        if i == trim_before:  # the step starts where the one before did (a trim)
            cache.trim(1)
        kk, vv = cache.update_and_fetch(k[None, None, n + i:n + i + 1],
                                        v[None, None, n + i:n + i + 1])
        outs.append(attention.attend(cache, q[None, None, None], kk, vv, 1.0)[0, 0, 0])
        last = store.tables[0].chosen
        chosen.append(None if last is None else last[3][0])
    store.close()
    return outs, (k, v, chosen)


def _direct(q: Any, k: Any, v: Any, blocks: Any, tail: list[int]) -> Any:
    """Attention of q over the sink page, `blocks` (one block a page here), the window page
    9 and the tail tokens `tail` (indices into k, v)."""
    import mlx.core as mx

    read = mx.concatenate([mx.arange(0, P), *[mx.arange(int(b) * P, (int(b) + 1) * P)
                                             for b in blocks.tolist()],
                           mx.arange(9 * P, 10 * P), mx.array(tail)])
    return mx.softmax(q[None] @ k[read].T, axis=-1)[0] @ v[read]


def test_the_next_step_reads_the_choice_then_chooses_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    mx.random.seed(1)
    a, b = mx.random.normal((D,)), mx.random.normal((D,))
    monkeypatch.setattr(attention, "RESELECT_STEPS", 2)
    outs, (k, v, chosen) = _steps(tmp_path, [a, b, b])
    top = chosen[0][0]                                   # (blocks,) of the one KV head
    assert 3 in top.tolist() and 6 not in top.tolist()   # step 1 wants page 3
    # Step 2 wants page 6, but reads step 1's choice.
    assert float(mx.abs(outs[1] - _direct(b, k, v, top, [80, 81])).max()) < 1e-5
    # Step 3 chooses again: page 6, as a step that always chooses does.
    assert 6 in chosen[2][0].tolist()
    monkeypatch.setattr(attention, "RESELECT_STEPS", 1)
    every, (_, _, fresh) = _steps(tmp_path / "b", [a, b, b])
    assert 6 in fresh[1][0].tolist()
    assert float(mx.abs(every[1] - outs[1]).max()) > 1e-2
    assert float(mx.abs(every[2] - outs[2]).max()) < 1e-5


def test_a_step_that_does_not_follow_chooses_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    mx.random.seed(1)
    a, b = mx.random.normal((D,)), mx.random.normal((D,))
    monkeypatch.setattr(attention, "RESELECT_STEPS", 4)
    # The second step replaces the first's token (a trim): it starts where the first did.
    outs, (k, v, chosen) = _steps(tmp_path, [a, b], trim_before=1)
    assert 6 in chosen[1][0].tolist()
    assert float(mx.abs(outs[1] - _direct(b, k, v, chosen[1][0], [81])).max()) < 1e-5

"""Sparse selection that holds on natural text (issue 19): blocks chosen by their true
largest logit among the bound's best, where the box bound alone ranks decoys first."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings, attention
from engine.kv.cache import PagedLayerCache
from engine.kv.store import KVStore

H, D, P = 1, 16, 8


def _decode_over_decoys(tmp_path: Path) -> float:
    """One decode step over pages: a sink, three decoy blocks (each key large in one other
    dimension: box bound 8a, true logit a), the block that matters (every key q.k = 3a, value
    1), three empty blocks, the window. The budget chooses 2 blocks of the 7 candidates.
    Returns the output (1 when all weight is on the block that matters)."""
    import mlx.core as mx

    s = KVSettings(mode="sparse", page_tokens=P, ssd_dir=tmp_path / "kv", sink_tokens=P,
                   window_tokens=P, budget_tokens=4 * P).validate()
    store = KVStore(s, n_layers=1, kv_heads=H, head_dim=D)
    a = 3.0
    zero = mx.zeros((1, H, P, D))
    decoy = a * mx.eye(P, D)[None, None]                              # key i: a * e_i
    hot = mx.full((1, H, P, D), 3 * a / D)                            # q.k = 3a for q = 1
    keys = [zero, decoy, decoy, decoy, hot, zero, zero, zero, zero]
    vals = [zero, zero, zero, zero, mx.ones((1, H, P, D)), zero, zero, zero, zero]
    cache = PagedLayerCache(store, 0)
    cache.update_and_fetch(mx.concatenate(keys, axis=2), mx.concatenate(vals, axis=2))
    z = mx.zeros((1, H, 1, D))
    k, v = cache.update_and_fetch(z, z)
    out = attention.attend(cache, mx.ones((1, H, 1, D)), k, v, 1.0)
    store.close()
    return float(out.mean())


def test_true_logits_find_the_block_the_bound_ranks_last(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Exact attention puts ~0.99 of the weight on the hot block (logit 9 against 3 and 0).
    monkeypatch.setattr(attention, "RESCORE", 4)  # STRATA_SPARSE_RESCORE=4
    assert _decode_over_decoys(tmp_path) > 0.95


def test_the_bound_alone_chooses_the_decoys(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the rescoring exists: by the bound alone the two chosen blocks are decoys."""
    monkeypatch.setattr(attention, "RESCORE", 1)
    assert _decode_over_decoys(tmp_path) < 0.05

"""Sparse mode within the trained length: the top DENSE_TOP share of the layers attends
exactly (at 8k the starter's answers needed their broad attention), the others select; past
DENSE_TOP_PAST tokens, or with the share 0, every layer selects."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings, attention
from engine.kv.cache import PagedLayerCache
from engine.kv.store import KVStore

LAYERS, H, D, P, PAGES = 4, 2, 16, 8, 12


def _step_against_exact(tmp_path: Path) -> list[float]:
    """Per layer, max |sparse step - exact attention| for one decode step over PAGES random
    pages (the same keys, values and query in every layer), budget 4 pages."""
    import mlx.core as mx

    s = KVSettings(mode="sparse", page_tokens=P, ssd_dir=tmp_path / "kv", sink_tokens=P,
                   window_tokens=P, budget_tokens=4 * P).validate()
    store = KVStore(s, n_layers=LAYERS, kv_heads=H, head_dim=D)
    rng = np.random.default_rng(0)
    keys = mx.array(rng.normal(size=(1, H, PAGES * P, D)).astype(np.float32) * 2)
    vals = mx.array(rng.normal(size=(1, H, PAGES * P, D)).astype(np.float32))
    q = mx.array(rng.normal(size=(1, H, 1, D)).astype(np.float32))
    z = mx.zeros((1, H, 1, D))
    gaps = []
    for layer in range(LAYERS):
        cache = PagedLayerCache(store, layer)
        cache.update_and_fetch(keys, vals)
        k, v = cache.update_and_fetch(z, z)
        out = attention.attend(cache, q, k, v, 1.0)
        ka, va = mx.concatenate([keys, z], axis=2), mx.concatenate([vals, z], axis=2)
        w = mx.softmax(q @ ka.swapaxes(-1, -2), axis=-1)
        gaps.append(float(mx.abs(out - w @ va).max()))
    store.close()
    return gaps


def test_the_top_layers_attend_exactly_the_others_select(tmp_path: Path) -> None:
    gaps = _step_against_exact(tmp_path)
    assert gaps[-1] < 1e-5           # int(0.25 * 4 + 0.5) = 1 layer: the top one is exact
    assert min(gaps[:-1]) > 1e-3     # the others chose 2 of 10 candidate pages' blocks


@pytest.mark.parametrize("switch", ["share", "past"])
def test_every_layer_selects_with_no_share_or_past_the_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    if switch == "share":
        monkeypatch.setattr(attention, "DENSE_TOP", 0.0)
    else:
        monkeypatch.setattr(attention, "DENSE_TOP_PAST", PAGES * P - 1)
    assert min(_step_against_exact(tmp_path)) > 1e-3

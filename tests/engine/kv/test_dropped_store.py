"""A page store dropped without close() is collected: its KV memory and session tier go.

Its writer thread once held the store's bound methods, so a dropped PromptCache kept its
whole KV in MLX memory for the life of the process (176 MB in `strata bench quick`)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings
from engine.kv.cache import PagedLayerCache
from engine.kv.store import KVStore

H, D, P = 2, 16, 8


def _fill(tmp_path: Path, tokens: int, pages_in_ram: int) -> tuple[weakref.ref, Path]:
    import mlx.core as mx

    s = KVSettings(mode="exact", page_tokens=P, ssd_dir=tmp_path / "kv", sink_tokens=P,
                   window_tokens=2 * P, budget_tokens=6 * P).validate()
    store = KVStore(s, n_layers=1, kv_heads=H, head_dim=D)
    store.max_slots = pages_in_ram
    cache = PagedLayerCache(store, 0)
    k = mx.random.normal((1, H, tokens, D))
    cache.update_and_fetch(k, k + 1)
    mx.eval(cache.state)
    store.flush()
    assert store.folder is not None and store.folder.is_dir()
    return weakref.ref(store), store.folder


def test_a_dropped_store_is_collected_and_its_tier_removed(tmp_path: Path) -> None:
    import mlx.core as mx

    gc.collect()
    before = mx.get_active_memory()
    # Buffered (a chat's start) and paged through slots and the SSD tier (past the RAM tier).
    for tokens, ram in ((4 * P, 64), (12 * P, 4)):
        ref, folder = _fill(tmp_path, tokens, ram)
        gc.collect()
        assert ref() is None, "the store outlived every reference to it"
        assert not folder.exists()
    gc.collect()
    # The KV was 8-24 KB; MLX keeps a few bytes of its own (the random key).
    assert mx.get_active_memory() - before < 1024

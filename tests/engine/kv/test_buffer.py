"""A buffered layer (positions in the cache's contiguous buffer): the buffer is the RAM tier.

No second copy of its pages in RAM (measured with MLX's active memory), none written to the
SSD tier until the buffer goes, every page still readable as the store's (page_np,
page_parts), attention exact through trims, a commit from outside and the buffer's drop past
its limit.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings
from engine.kv.attention import attend
from engine.kv.cache import PagedLayerCache
from engine.kv.store import KVStore

H, D, P, REP = 2, 16, 8, 3


def _store(tmp_path: Path, head_dim: int = D, page: int = P) -> KVStore:
    s = KVSettings(mode="exact", page_tokens=page, ssd_dir=tmp_path / "kv", sink_tokens=page,
                   window_tokens=2 * page, budget_tokens=6 * page).validate()
    return KVStore(s, n_layers=1, kv_heads=H, head_dim=head_dim)


class _Feed:
    """Chunks into one cache, each attended and checked against MLX's fused attention."""

    def __init__(self, cache: PagedLayerCache) -> None:
        self.cache = cache
        self.ks: list[Any] = []
        self.vs: list[Any] = []

    def __call__(self, n: int) -> float:
        import mlx.core as mx

        k, v = mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))
        q = mx.random.normal((1, H * REP, n, D))
        self.ks.append(k)
        self.vs.append(v)
        k2, v2 = self.cache.update_and_fetch(k, v)
        out = attend(self.cache, q, k2, v2, D ** -0.5)
        kk, vv = self.keys(), self.values()
        L, T = n, kk.shape[2]
        mask = (mx.arange(L)[:, None] + T - L) >= mx.arange(T)[None]
        ref = mx.fast.scaled_dot_product_attention(q, kk, vv, scale=D ** -0.5, mask=mask)
        return float(mx.abs(out - ref).max())

    def keys(self) -> Any:
        import mlx.core as mx

        return mx.concatenate(self.ks, axis=2)

    def values(self) -> Any:
        import mlx.core as mx

        return mx.concatenate(self.vs, axis=2)

    def trim(self, n: int) -> None:
        import mlx.core as mx

        self.cache.trim(n)
        k, v = self.keys()[:, :, :-n], self.values()[:, :, :-n]
        self.ks, self.vs = [k], [v]
        mx.eval(k, v)


def _pages_match(store: KVStore, feed: _Feed) -> None:
    k, v = np.array(feed.keys()[0]), np.array(feed.values()[0])
    for i in range(store.tables[0].n_pages):
        pk, pv = store.page_np(0, i)
        assert np.array_equal(np.array(pk), k[:, i * P:(i + 1) * P])
        assert np.array_equal(np.array(pv), v[:, i * P:(i + 1) * P])
        (ck,), (cv,) = store.page_parts(0, i)
        assert np.array_equal(ck, k[:, i * P:(i + 1) * P])
        assert np.array_equal(cv, v[:, i * P:(i + 1) * P])


def test_buffered_pages_are_one_copy_and_still_the_stores(tmp_path: Path) -> None:
    import mlx.core as mx

    mx.random.seed(1)
    store = _store(tmp_path)
    cache = PagedLayerCache(store, 0)
    feed = _Feed(cache)
    for n in (13, 8, 40, 1, 1, 1, 30, 1):
        assert feed(n) < 1e-5
    table = store.tables[0]
    assert store.buffered(0) and table.n_pages == 95 // P
    # The RAM tier keeps no slots for the layer: the buffer is all the RAM it holds.
    assert store.pool_k[0] is None and store.pool_v[0] is None
    assert cache.nbytes == int(cache.buf_k.nbytes) + int(cache.buf_v.nbytes)
    st = store.stats()
    assert st["pages_ram"] == table.n_pages
    _pages_match(store, feed)
    # Trims (rejected drafts) keep the buffer; the pages past the cut go.
    feed.trim(20)
    assert store.buffered(0) and table.n_pages == 75 // P and cache.offset == 75
    for n in (1, 9, 1):
        assert feed(n) < 1e-5
    _pages_match(store, feed)
    # Nothing went to the SSD tier meanwhile: a buffered page is never evicted, and a stored
    # prompt's pages are written once, into the prefix cache's run.
    store.flush()
    assert store.stats()["pages_written"] == store.stats()["pages_ssd"] == 0
    # A page committed from outside gets a slot: the buffer goes first, its pages copied
    # into the tier and the tail kept, and attention stays exact.
    tail = int(cache.offset - table.n_pages * P)
    k0, v0 = store.page_np(0, 0)
    before = cache.offset
    store.commit(0, k0, v0)
    assert not store.buffered(0) and cache.buf_k is None and store.pool_k[0] is not None
    assert cache.tail_k is not None and cache.tail_k.shape[2] == tail
    assert cache.offset == before  # the cache's own bookkeeping is the caller's to mend
    store.flush()  # the buffer's pages were written through as they moved into slots
    assert store.stats()["pages_written"] == table.n_on_disk == table.n_pages
    store.truncate(0, table.n_pages - 1)
    for n in (1, 1):
        assert feed(n) < 1e-5
    store.close()


def test_buffer_dropped_past_its_limit_moves_pages_into_the_tier(tmp_path: Path) -> None:
    import mlx.core as mx

    mx.random.seed(2)
    store = _store(tmp_path)
    cache = PagedLayerCache(store, 0)
    cache.contig_max = 6 * P
    feed = _Feed(cache)
    for n in (20, 1, 1, 10):
        assert feed(n) < 1e-5
    assert store.buffered(0)
    for n in (17, 1, 1):  # past 48 positions: pages from the tier's slots (or the SSD)
        assert feed(n) < 1e-5
    assert not store.buffered(0) and cache.buf_k is None
    assert store.tables[0].n_resident == store.tables[0].n_pages
    store.flush()
    assert store.tables[0].n_on_disk == store.tables[0].n_pages
    _pages_match(store, feed)
    # Trimmed back under the limit, the buffer is rebuilt from the pages, the slots freed.
    feed.trim(30)
    assert feed(1) < 1e-5
    assert store.buffered(0) and store.pool_k[0] is None
    _pages_match(store, feed)
    store.close()


def test_buffered_kv_is_held_once_in_ram(tmp_path: Path) -> None:
    """MLX's active memory grows by the buffer, not by the buffer and the RAM tier's pages
    (which is what it held before the tier became the buffer)."""
    import mlx.core as mx

    d, page, n = 64, 128, 4096
    mx.random.seed(3)
    k = mx.random.normal((1, H, n, d))
    v = mx.random.normal((1, H, n, d))
    mx.eval(k, v)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    store = _store(tmp_path, head_dim=d, page=page)
    cache = PagedLayerCache(store, 0)
    for i in range(0, n, 512):
        cache.update_and_fetch(k[:, :, i:i + 512], v[:, :, i:i + 512])
        mx.eval(cache.state)
    for _ in range(3):  # decode steps
        cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
        mx.eval(cache.state)
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - before
    kv = 2 * H * (n + 3) * d * 4
    assert store.buffered(0) and store.tables[0].n_pages == n // page
    assert cache.nbytes >= kv
    assert held <= 1.25 * kv, f"{held} bytes held for {kv} bytes of KV"
    store.close()

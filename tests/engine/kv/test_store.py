"""Paged KV store without a model: attention against MLX's, tiers, eviction, checksums, faults."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.errors import StrataError
from engine.kv import KVSettings
from engine.kv.attention import attend
from engine.kv.cache import PagedLayerCache
from engine.kv.pagefile import KVStoreError, PageCorrupt
from engine.kv.store import KVRamFull, KVStore

H, D, P, REP = 2, 16, 8, 3
PAGE_BYTES = 2 * H * P * D * 4


def _settings(tmp_path: Path, **kw: object) -> KVSettings:
    base = dict(mode="exact", page_tokens=P, ssd_dir=tmp_path / "kv", sink_tokens=P,
                window_tokens=2 * P, budget_tokens=6 * P)
    base.update(kw)
    return KVSettings(**base).validate()  # type: ignore[arg-type]


def _store(tmp_path: Path, pages_in_ram: int | None = None, **kw: object) -> KVStore:
    s = _settings(tmp_path, **kw)
    store = KVStore(s, n_layers=1, kv_heads=H, head_dim=D)
    if pages_in_ram is not None:
        store.max_slots = pages_in_ram
    return store


def test_ram_tier_grows_by_a_quarter_not_doubling(tmp_path: Path) -> None:
    """A layer's pool holds at most a quarter more slots than its pages (16 at least), and
    stops at the RAM budget: doubling held up to twice the pages' bytes in zeroed slots."""
    import mlx.core as mx

    store = _store(tmp_path, ssd=False)
    k = mx.ones((H, P, D))
    for n in range(1, 301):
        store.commit(0, k * n, k * -n)
        cap = store.pool_k[0][0].shape[0]
        assert n <= cap <= n - 1 + max(16, (n - 1) // 4), (n, cap)
    assert float(store.pool_k[0][0][299, 0, 0, 0]) == 300.0
    assert float(store.pool_v[0][0][0, 0, 0, 0]) == -1.0
    capped = _store(tmp_path, pages_in_ram=40, ssd=False)
    for _ in range(40):
        capped.commit(0, k, k)
    assert capped.pool_k[0][0].shape[0] == 40
    store.close()
    capped.close()


def test_pages_read_into_ram_together_grow_the_pool_once(tmp_path: Path) -> None:
    """Cold pages brought into RAM in one batch grow the layer's pool once, to hold them all:
    each growth copies the pool, and a quarter at a time 60 pages cost four copies (after a
    128k restore a decode step admits ~90 pages a layer)."""
    import mlx.core as mx

    store = _store(tmp_path, pages_in_ram=20)
    k = mx.ones((H, P, D))
    for n in range(80):
        store.commit(0, k * n, k * -n)
    store.flush()
    assert store.pool_k[0][0].shape[0] == 20
    store.max_slots = 200
    cold = np.flatnonzero(~store.tables[0].resident(np.arange(80)))
    slots = store.ensure_resident(0, cold)
    assert slots is not None and len(cold) == 60
    assert store.pool_k[0][0].shape[0] == 80  # 20 + 60 in one growth (a quarter: 85)
    assert [float(store.pool_v[0][0][s, 0, 0, 0]) for s in slots] == [-float(c) for c in cold]
    store.close()


def _reference(q, ks, vs):  # noqa: ANN001, ANN202
    import mlx.core as mx

    k, v = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
    L, T = q.shape[2], k.shape[2]
    mask = (mx.arange(L)[:, None] + T - L) >= mx.arange(T)[None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)


def _run(store: KVStore, chunks: list[int], seed: int = 0) -> float:
    """Feed chunks of the given lengths; return the worst |paged - reference| over them."""
    import mlx.core as mx

    mx.random.seed(seed)
    cache = PagedLayerCache(store, 0)
    ks, vs, worst = [], [], 0.0
    for n in chunks:
        k = mx.random.normal((1, H, n, D))
        v = mx.random.normal((1, H, n, D))
        q = mx.random.normal((1, H * REP, n, D))
        ks.append(k)
        vs.append(v)
        k2, v2 = cache.update_and_fetch(k, v)
        out = attend(cache, q, k2, v2, D ** -0.5)
        ref = _reference(q, ks, vs)
        worst = max(worst, float(mx.abs(out - ref).max()))
    assert cache.offset == sum(chunks)
    return worst


def test_exact_attention_matches_mlx_in_ram_and_from_ssd(tmp_path: Path) -> None:
    chunks = [13, 8, 40, 1, 1, 1, 30, 1, 1]
    assert _run(_store(tmp_path), chunks) < 1e-5
    # Four slots of RAM: most pages are read back from the SSD tier during attention.
    store = _store(tmp_path, pages_in_ram=5)
    assert _run(store, chunks) < 1e-5
    st = store.stats()
    assert st["evictions"] > 0 and st["ssd_reads"] > 0
    store.close()


def test_numpy_exp_partials_match_mlx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past NP_EXP_MIN logits a partial's softmax runs in numpy (MLX's CPU exp is ~10x
    slower): page-wise attention of long chunks, in RAM and from the SSD tier, and the
    statistics themselves, equal MLX's within float32 rounding."""
    import mlx.core as mx

    from engine.kv import attention

    monkeypatch.setattr(attention, "FUSED_PAST_MAX", 0)  # the page-wise path, not MLX's kernel
    # The threshold scaled to this store's shapes: the long chunks' partials cross it.
    monkeypatch.setattr(attention, "NP_EXP_MIN", 1 << 16)
    chunks = [200, 300, 1, 1, 250]  # logits of the long chunks: 2 x 750 x 500+ >= 2**16
    assert _run(_store(tmp_path), chunks) < 1e-5
    store = _store(tmp_path, pages_in_ram=5)
    assert _run(store, chunks) < 1e-5
    store.close()
    mx.random.seed(1)
    for shape_s, shape_v in [((H, 600, 300), (H, 300, D)), ((7, H, 600, P), (7, H, P, D))]:
        s, v = mx.random.normal(shape_s) * 4, mx.random.normal(shape_v)
        monkeypatch.setattr(attention, "NP_EXP_MIN", 1)
        ours = attention._stats(s, v)
        monkeypatch.setattr(attention, "NP_EXP_MIN", 0)
        ref = attention._stats(s, v)
        for a, b in zip(ours, ref, strict=True):
            assert a.shape == b.shape and float(mx.abs(a - b).max()) <= 1e-4 * float(
                mx.abs(b).max())


def test_sparse_with_full_budget_is_exact(tmp_path: Path) -> None:
    chunks = [60, 1, 1, 1]
    assert _run(_store(tmp_path, mode="sparse", budget_tokens=64 * P), chunks) < 1e-5


def test_sparse_attends_within_budget(tmp_path: Path) -> None:
    import mlx.core as mx

    store = _store(tmp_path, mode="sparse", budget_tokens=5 * P)
    cache = PagedLayerCache(store, 0)
    k = mx.random.normal((1, H, 20 * P, D))
    cache.update_and_fetch(k, k)
    q = mx.random.normal((1, H * REP, 1, D))
    k1 = mx.random.normal((1, H, 1, D))
    k2, v2 = cache.update_and_fetch(k1, k1)
    out = attend(cache, q, k2, v2, D ** -0.5)
    assert out.shape == (1, H * REP, 1, D) and bool(mx.isfinite(out).all())
    # A key that dominates one page is found through the page's min/max summary.
    hot = mx.zeros((1, H, P, D))
    store2 = _store(tmp_path, mode="sparse", budget_tokens=4 * P)
    c2 = PagedLayerCache(store2, 0)
    qv = mx.ones((1, H * REP, 1, D))
    parts = [mx.zeros((1, H, 5 * P, D)), hot + 3.0, mx.zeros((1, H, 6 * P, D))]
    vals = [mx.zeros((1, H, 5 * P, D)), hot + 1.0, mx.zeros((1, H, 6 * P, D))]
    c2.update_and_fetch(mx.concatenate(parts, axis=2), mx.concatenate(vals, axis=2))
    z = mx.zeros((1, H, 1, D))
    k2, v2 = c2.update_and_fetch(z, z)
    out = attend(c2, qv, k2, v2, 1.0)
    assert float(out.min()) > 0.99  # all the weight on the one hot page


def test_eviction_is_lru_with_sinks_and_window_pinned(tmp_path: Path) -> None:
    import mlx.core as mx

    store = _store(tmp_path, pages_in_ram=5)
    for _ in range(5):
        store.commit(0, mx.ones((H, P, D)), mx.ones((H, P, D)))
    store.flush()
    table = store.tables[0]
    # page 0 is a sink, pages 3-4 the window: 1 and 2 are evictable, 1 the older.
    assert list(table.lru) == [1, 2]
    table.touch([1])
    store.commit(0, mx.ones((H, P, D)), mx.ones((H, P, D)))
    assert table.slot_of[2] == -1 and table.slot_of[1] >= 0  # LRU page 2 left, not 1
    assert table.slot_of[0] >= 0 and table.slot_of[4] >= 0 and table.slot_of[5] >= 0
    assert table.on_disk[2]
    store.close()


def test_corrupt_page_is_never_used(tmp_path: Path) -> None:
    import mlx.core as mx

    store = _store(tmp_path, pages_in_ram=4)
    cache = PagedLayerCache(store, 0)
    cache.update_and_fetch(mx.random.normal((1, H, 10 * P, D)),
                           mx.random.normal((1, H, 10 * P, D)))
    store.flush()
    cold = int(np.flatnonzero(store.tables[0].slot_of[:10] < 0)[0])
    f = store._file(0)
    with open(f.path, "r+b") as fh:
        fh.seek(cold * f.size + 200)
        b = fh.read(1)
        fh.seek(cold * f.size + 200)
        fh.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(PageCorrupt, match=f"page {cold}: checksum mismatch"):
        f.read(cold)
    q = mx.random.normal((1, H * REP, 1, D))
    k1 = mx.random.normal((1, H, 1, D))
    k2, v2 = cache.update_and_fetch(k1, k1)
    with pytest.raises(PageCorrupt):
        mx.eval(attend(cache, q, k2, v2, D ** -0.5))
    store.close()


def test_store_restarts_from_its_files(tmp_path: Path) -> None:
    import mlx.core as mx

    s = _settings(tmp_path, keep_files=True)
    a = KVStore(s, n_layers=1, kv_heads=H, head_dim=D, session="restart")
    pages = [mx.random.normal((H, P, D)) for _ in range(4)]
    for p in pages:
        a.commit(0, p, p * 2)
    a.save_manifest(4 * P)
    a.close()
    assert (tmp_path / "kv" / "restart" / "manifest.json").is_file()
    b = KVStore(s, n_layers=1, kv_heads=H, head_dim=D, session="restart")
    b.adopt(0, 4)
    for i, p in enumerate(pages):
        k, v = b.page_np(0, i)
        assert bool(mx.array_equal(k, p)) and bool(mx.array_equal(v, p * 2))
    assert b.stats()["ssd_reads"] >= 4
    assert bool(mx.allclose(b.tables[0].kmax[2], pages[2].max(axis=1)))
    b.close()


@pytest.mark.parametrize("bits", [16, 4])
def test_a_step_reads_cold_pages_into_one_batch_checked_record_by_record(
        tmp_path: Path, bits: int) -> None:
    """`_read_batch` (the cold pages of a step, read straight into MLX buffers on the read
    threads): the same bytes as reading page by page, in the order asked, at 16 and 4 bits;
    a flipped byte or a truncated file is refused, naming the page."""
    import mlx.core as mx

    d = 64 if bits != 16 else D  # a quantization group is at least 32 values
    store = KVStore(_settings(tmp_path, keep_files=True, bits=bits), 1, H, d)
    pages = [mx.random.normal((H, P, d)) for _ in range(6)]
    for p in pages:
        store.commit(0, p, p * 2)
    store.flush()
    order = np.array([4, 0, 5, 2])
    k, v = store._read_batch(0, order)
    for row, page in enumerate(order):
        want_k, want_v = store._read_np(0, int(page))
        for got, want in zip(k + v, want_k + want_v, strict=True):
            assert np.array_equal(np.array(got[row]), want), (row, page)
    assert store.counters["ssd_reads"] >= len(order)
    f = store._file(0)
    with open(f.path, "r+b") as fh:
        fh.seek(5 * f.size + 300)
        b = fh.read(1)
        fh.seek(5 * f.size + 300)
        fh.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(PageCorrupt, match="page 5: checksum mismatch"):
        store._read_batch(0, np.array([1, 5, 3]))
    with open(f.path, "r+b") as fh:
        fh.truncate(3 * f.size + 100)
    with pytest.raises(PageCorrupt, match="page 3: truncated record"):
        store._read_batch(0, np.array([2, 3]))
    store.close()


def test_unwritable_folder_is_a_clear_error_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(KVStoreError) as err:
        KVStore(_settings(tmp_path, ssd_dir=blocker / "kv"), 1, H, D)
    msg = str(err.value)
    assert "\n" not in msg and "not writable" in msg and str(blocker) in msg
    assert isinstance(err.value, StrataError)


def test_stores_opening_at_once_on_one_folder_all_find_it_writable(tmp_path: Path) -> None:
    # The ranks of a split model open their stores on one folder at the same moment: a
    # probe file of one shared name was removed by one under another (the fresh-clone run).
    import threading

    from engine.kv.pagefile import check_writable

    errors: list[str] = []

    def check() -> None:
        for _ in range(300):
            try:
                check_writable(tmp_path)
            except KVStoreError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=check) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and list(tmp_path.iterdir()) == []  # no probe left behind


def test_full_ssd_budget_stops_spilling_then_ends_cleanly(tmp_path: Path) -> None:
    import mlx.core as mx

    # An SSD budget of 2 MB holds 3 pages of just over 0.5 MB; RAM holds 6.
    store = KVStore(_settings(tmp_path, ssd_mb=2), 1, 64, 128)
    store.max_slots = 6
    big = mx.ones((64, P, 128))
    for _ in range(6):
        store.commit(0, big, big)
    store.flush()
    assert store.ssd_full_reason and "budget" in store.ssd_full_reason
    assert store.tables[0].n_on_disk == 3
    # Pages 1 and 2 can leave RAM (on disk; 0 is a sink); then a clear error, no crash.
    with pytest.raises(KVRamFull, match="RAM budget .* is full"):
        for _ in range(4):
            store.commit(0, big, big)
    assert store.stats()["evictions"] >= 1
    store.close()


def test_trim_reopens_a_page_into_the_tail(tmp_path: Path) -> None:
    import mlx.core as mx

    store = _store(tmp_path)
    cache = PagedLayerCache(store, 0)
    k = mx.random.normal((1, H, 3 * P + 3, D))
    cache.update_and_fetch(k, k)
    assert cache.trim(P) == P and cache.offset == 2 * P + 3
    assert store.tables[0].n_pages == 2 and cache.tail_k.shape[2] == 3
    assert bool(mx.array_equal(cache.tail_k, k[:, :, 2 * P:2 * P + 3]))
    store.close()


def test_pages_of_a_buffer_let_go_are_written_behind_the_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Crossing the buffer's limit does not queue every page's write in that step: a few a
    step follow; an eviction, a manifest and a close with its files kept write the rest; all
    of them end on the disk, readable by a store opened on the files afterwards."""
    import mlx.core as mx

    import engine.kv.store as store_mod

    monkeypatch.setattr(store_mod, "WRITE_BEHIND_PAGES", 2)
    mx.random.seed(4)
    s = _settings(tmp_path, keep_files=True)
    store = KVStore(s, n_layers=1, kv_heads=H, head_dim=D, session="behind")
    cache = PagedLayerCache(store, 0)
    cache.contig_max = 12 * P
    ks, vs = [], []

    def step(n: int) -> float:
        k, v = mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))
        q = mx.random.normal((1, H * REP, n, D))
        ks.append(k)
        vs.append(v)
        k2, v2 = cache.update_and_fetch(k, v)
        out = attend(cache, q, k2, v2, D ** -0.5)
        return float(mx.abs(out - _reference(q, ks, vs)).max())

    assert step(12 * P - 1) < 1e-5
    assert store.buffered(0) and store.stats()["pages_written"] == 0
    assert step(1) < 1e-5 and step(1) < 1e-5  # the second step crosses: the buffer goes
    table = store.tables[0]
    assert not store.buffered(0) and table.n_pages == 12
    store.writer.flush()  # type: ignore[union-attr]  (only what was queued is written)
    written = table.n_on_disk
    assert 0 < written <= 2  # this step queued two, ten wait behind
    assert step(1) < 1e-5
    store.writer.flush()  # type: ignore[union-attr]
    assert table.n_on_disk == written + 2
    # An eviction needs its pages on the disk: it writes what is behind first.
    store.max_slots = table.n_pages
    k = mx.random.normal((H, P, D))
    store.commit(0, k, k * 2)
    assert store.stats()["evictions"] == 1
    store.flush()
    assert table.n_on_disk == table.n_pages == 13
    store.save_manifest(13 * P)
    store.close()

    other = KVStore(s, n_layers=1, kv_heads=H, head_dim=D, session="behind")
    other.adopt(0, 13)
    keys = mx.concatenate(ks, axis=2)[0]
    for p in range(12):
        got, _ = other.page_np(0, p)
        assert bool(mx.array_equal(got, keys[:, p * P:(p + 1) * P])), p
    got, got_v = other.page_np(0, 12)
    assert bool(mx.array_equal(got, k)) and bool(mx.array_equal(got_v, k * 2))
    other.close()

"""A full disk under each writer: the KV SSD tier, the prefix cache, an import, the chat DB.

Each test mounts a 2 MB tmpfs (root only; skipped with the reason otherwise), fills it, and
checks: a clear message, the work finishes or stops cleanly, nothing already saved is lost,
and writing works again once space returns.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ImportFailed
from tests.reliability.common import (
    new_prefix_cache,
    prefix_prompt,
    read_prefix_page,
    write_prefix_pages,
    write_tiny_gguf,
)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB tmpfs at tmp_path/disk, unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill the disk up to `leave` free bytes with one file; delete it to free the space."""
    filler = disk / "filler"
    with open(filler, "ab") as fh:
        while True:
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            if free <= leave:
                break
            try:
                fh.write(b"\0" * max(1, min(free - leave, 1 << 16)))
                fh.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
    return filler


def test_kv_ssd_tier_stops_spilling_with_a_clear_reason(small_disk: Path) -> None:
    import mlx.core as mx

    from engine.kv import KVSettings
    from engine.kv.store import KVRamFull, KVStore

    P, H, D = 128, 2, 64  # 128 KB records: the 2 MB disk holds about 15
    base: dict[str, Any] = dict(mode="exact", page_tokens=P, ssd_dir=small_disk / "kv",
                                sink_tokens=P, window_tokens=P, budget_tokens=4 * P)
    pages = [mx.random.normal((H, P, D)) for _ in range(24)]
    # Enough RAM: the tier stops spilling and the reply goes on from RAM.
    store = KVStore(KVSettings(**base, ram_mb=64), n_layers=1, kv_heads=H, head_dim=D)
    for p in pages:
        store.commit(0, p, -p)
    store.flush()
    assert store.ssd_full_reason is not None and "No space left" in store.ssd_full_reason
    for i, p in enumerate(pages):
        k, v = store.page_np(0, i)
        assert bool(mx.array_equal(k, p)) and bool(mx.array_equal(v, -p))
    store.close()
    # Too little RAM as well: a clear one-line error, not a hang or a crash.
    filler = fill(small_disk, leave=300_000)
    store = KVStore(KVSettings(**base, ram_mb=1), n_layers=1, kv_heads=H, head_dim=D)
    with pytest.raises(KVRamFull, match="No space left") as err:
        for p in pages:
            store.commit(0, p, -p)
    assert "\n" not in str(err.value)
    store.close()
    # Space returns: a new store spills again.
    filler.unlink()
    store = KVStore(KVSettings(**base, ram_mb=1), n_layers=1, kv_heads=H, head_dim=D)
    for p in pages[:8]:
        store.commit(0, p, -p)
    store.flush()
    assert store.ssd_full_reason is None and store.stats()["pages_written"] == 8
    store.close()


def test_prefix_cache_skips_storing_on_a_full_disk(small_disk: Path) -> None:
    folder = small_disk / "prefix"
    cache = new_prefix_cache(folder)
    kept = prefix_prompt(2, seed=1)
    write_prefix_pages(cache, kept, 2, seed=1)  # saved before the disk fills
    filler = fill(small_disk, leave=2000)
    prompt = prefix_prompt(2, seed=2)
    with pytest.raises(OSError) as err:
        write_prefix_pages(cache, prompt, 2, seed=2)
    assert err.value.errno == errno.ENOSPC
    assert not list(folder.glob(".tmp-*")), "a failed write leaves no temp file"
    assert cache.lookup(prompt).hit_pages == 0
    assert all(read_prefix_page(cache, kept, d)[0] for d in range(2)), "saved pages lost"
    filler.unlink()
    write_prefix_pages(cache, prompt, 2, seed=2)
    assert cache.lookup(prompt + [1]).hit_pages == 2
    cache.close()


def test_generation_with_prefix_cache_on_a_full_disk_is_unchanged(
        starter_lm: Any, small_disk: Path) -> None:
    from engine.kv.prefix import PrefixSettings
    from engine.runtime.generate import generate
    from engine.runtime.sampling import SamplingParams

    lm = starter_lm
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": "Name three colours. " * 8}])
    greedy = SamplingParams(temperature=0.0)
    plain = [e.token for e in generate(lm, ids, greedy, max_tokens=8, prefix_cache=False)]
    filler = fill(small_disk, leave=4000)
    cache = lm.enable_prefix_cache(PrefixSettings(folder=small_disk / "prefix",
                                                  page_tokens=32))
    try:
        got = [e.token for e in generate(lm, ids, greedy, max_tokens=8)]
        cache.flush()
        assert got == plain
        assert cache.stats.write_errors and "No space left" in cache.stats.write_errors[0]
        assert not list((small_disk / "prefix").glob(".tmp-*"))
        filler.unlink()  # space returns: the next reply stores its pages
        assert [e.token for e in generate(lm, ids, greedy, max_tokens=8)] == plain
        cache.flush()
        assert cache.lookup(ids).hit_pages > 0
    finally:
        cache.close()
        lm.prefix_cache = None


def test_import_on_a_full_disk_is_refused_and_library_unchanged(small_disk: Path,
                                                                tmp_path: Path) -> None:
    from engine.importers import import_path
    from engine.library.store import Library

    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    library = Library(small_disk / "home")
    first = import_path(library, source, name="first")
    filler = fill(small_disk, leave=20_000)
    with pytest.raises(ImportFailed, match="full") as err:
        import_path(library, source, name="second")
    assert "\n" not in str(err.value)
    assert [m["name"] for m in library.manifests()] == ["first"]
    assert not [p for p in library.models_dir.iterdir() if p.name.startswith(".tmp-")]
    assert library.get("first")["fingerprint"] == first["fingerprint"]
    filler.unlink()
    import_path(library, source, name="second")
    assert [m["name"] for m in library.manifests()] == ["first", "second"]


def test_chat_database_on_a_full_disk_keeps_what_was_saved(small_disk: Path) -> None:
    from app.chat.store import ChatStore

    store = ChatStore(small_disk / "chats.sqlite3")
    chat = store.create_chat(model="m")
    saved = [store.add_message(chat.id, "user", f"message {i}").id for i in range(20)]
    filler = fill(small_disk, leave=0)
    with pytest.raises(sqlite3.OperationalError, match="full"):
        for i in range(200):
            store.add_message(chat.id, "assistant", "x" * 4000 + str(i))
    # Nothing already saved is lost, in this connection or a new one.
    assert [m.id for m in store.messages(chat.id)][:20] == saved
    again = ChatStore(small_disk / "chats.sqlite3")
    assert [m.content for m in again.messages(chat.id)][:20] == [f"message {i}"
                                                               for i in range(20)]
    again.close()
    filler.unlink()
    m = store.add_message(chat.id, "user", "after the disk had room again")
    assert store.message(m.id) is not None
    assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store.close()

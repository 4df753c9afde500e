"""One page store on the disk: stored runs at the top of one folder, live sessions' SSD tiers
in its `sessions` folder, one budget over both (runs make room for live sessions, never the
other way), and the one-time move of earlier versions' `prefix` folder into it. Real files,
real writer threads, real processes for the dead session."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.kv import KVSettings
from engine.kv.prefix import folder_summary
from engine.kv.settings import SESSIONS_DIR, store_root
from engine.kv.store import KVStore
from tests.reliability.common import (
    HEAD_DIM,
    KV_HEADS,
    PAGE,
    new_prefix_cache,
    prefix_pages,
    prefix_prompt,
    write_prefix_pages,
)


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True, check=True)
    return int(p.stdout)


def test_the_old_prefix_folder_moves_into_the_page_store(tmp_path: Path) -> None:
    home = tmp_path / "home"
    old = new_prefix_cache(home / "prefix")
    x = prefix_prompt(3, seed=1)
    try:
        write_prefix_pages(old, x, 3, seed=1)
    finally:
        old.close()
    dead = home / "kv" / f"{_dead_pid()}-0123abcd"  # an earlier version's crashed session
    dead.mkdir(parents=True)
    (dead / "layer-00.kvp").write_bytes(b"\0" * 4096)

    root = store_root(home)
    assert root == home / "pages" and not (home / "prefix").exists()
    assert not (home / "kv").exists(), "the dead session's tier was swept"
    assert store_root(home) == root  # a second call moves nothing
    moved = new_prefix_cache(root)
    try:
        assert moved.lookup(x).hit_pages == 3  # the same runs, found where they went
    finally:
        moved.close()


def test_a_live_session_makes_the_stored_runs_give_way(tmp_path: Path) -> None:
    root = tmp_path / "pages"
    pc = new_prefix_cache(root)
    session = None
    try:
        old, new = prefix_prompt(2, seed=1), prefix_prompt(2, seed=2)
        write_prefix_pages(pc, old, 2, seed=1)
        write_prefix_pages(pc, new, 2, seed=2)
        pc.flush()
        pc.table.touch(pc.lookup(old).hashes, time.time_ns() - 10**9)  # least recent
        runs_bytes = pc.disk_bytes()
        # A paged session in the store's own folder, its pages written to its SSD tier.
        kv = KVSettings(mode="exact", page_tokens=PAGE, ssd_dir=root / SESSIONS_DIR,
                        sink_tokens=PAGE, window_tokens=2 * PAGE, budget_tokens=6 * PAGE)
        session = KVStore(kv.validate(), n_layers=1, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
        for i in range(8):
            k = mx.random.normal((KV_HEADS, PAGE, HEAD_DIM), key=mx.random.key(i))
            session.commit(0, k, -k)
        session.flush()
        summary = folder_summary(root)
        assert summary["sessions"] == 1 and summary["session_bytes"] > 0
        assert summary["bytes"] == runs_bytes  # a session's tier is not a stored run
        # One byte short of both runs and the session: the older run's leaf page goes (the
        # chain stays prefix-closed), the session stays.
        live = summary["session_bytes"]
        pc.settings = replace(pc.settings, budget_mb=(runs_bytes + live - 1) / (1 << 20))
        pc._evict()
        assert pc.lookup(old).hit_pages == 1 and pc.lookup(new).hit_pages == 2
        assert pc.stats.evicted_pages == 1 and pc.stats.evicted_runs == 0
        assert folder_summary(root)["session_bytes"] == summary["session_bytes"]
        session.close()
        session = None
        assert folder_summary(root)["sessions"] == 0
    finally:
        if session is not None:
            session.close()
        pc.close()


# -- the page table: shared pages, references, LRU, damage, clearing --------------------------
def _prompt_after(common: list[int], own_pages: int, seed: int) -> list[int]:
    """`common` (whole pages) followed by `own_pages` pages of its own and one more token."""
    own = prefix_prompt(own_pages, seed=seed)
    return common + own


def _store(pc: Any, prompt: list[int], pages: int, seed: int) -> int:
    """Store the prompt's first `pages` pages as the runtime would: whatever is stored
    already is referenced, the rest is written (synthetic keys and values)."""
    plan = pc.lookup(prompt)
    start = plan.hit_pages
    ks, vs = prefix_pages(pages, seed=seed)
    n = pc.store_pages(prompt, plan, start, [k[:, start * PAGE:pages * PAGE] for k in ks],
                       [v[:, start * PAGE:pages * PAGE] for v in vs])
    pc.flush()
    return n


def test_a_common_prefix_is_stored_once_and_a_third_prompt_hits_both(tmp_path: Path) -> None:
    pc = new_prefix_cache(tmp_path / "pages")
    try:
        common = prefix_prompt(3, seed=7)[:3 * PAGE]
        a, b = _prompt_after(common, 1, seed=8), _prompt_after(common, 2, seed=9)
        assert _store(pc, a, 4, seed=1) == 4
        one = pc.disk_bytes()
        # B shares A's first three pages: only its own two are written.
        assert _store(pc, b, 5, seed=1) == 2
        assert pc.disk_bytes() - one == 2 * pc.page_bytes + pc.run_head_bytes(2)
        summary = folder_summary(pc.folder)
        assert summary["pages"] == 6 and summary["shared_pages"] == 3
        assert summary["prompts"] == 2
        # A third prompt continuing B finds its pages in both files, in order.
        c = b[:5 * PAGE] + prefix_prompt(1, seed=10)
        plan = pc.lookup(c)
        assert plan.hit_pages == 5 and [r.first for r in plan.runs] == [0, 3]
        assert [r.path.name for r in plan.runs] == [pc.path(plan.hashes[0]).name,
                                                    pc.path(plan.hashes[3]).name]
        pc.flush()
        s = folder_summary(pc.folder)  # pages asked for and found since the store was made
        assert s["asked_pages"] >= 5 + 4 + 5 and s["found_pages"] >= 3 + 5
        assert 0 < s["hit_rate"] < 1
    finally:
        pc.close()


def test_a_page_a_live_session_maps_is_never_evicted(tmp_path: Path) -> None:
    """A paged restore holds its pages in the page table: a budget of nothing leaves them,
    and they go once the session's store closes."""
    from engine.kv.cache import PagedLayerCache

    pc = new_prefix_cache(tmp_path / "pages")
    store = None
    try:
        x, y = prefix_prompt(3, seed=1), prefix_prompt(2, seed=2)
        _store(pc, x, 3, seed=1)
        _store(pc, y, 2, seed=2)
        kv = KVSettings(mode="exact", page_tokens=PAGE, ssd_dir=tmp_path / "pages" / SESSIONS_DIR,
                        sink_tokens=PAGE, window_tokens=2 * PAGE, budget_tokens=6 * PAGE)
        store = KVStore(kv.validate(), n_layers=2, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
        caches = [PagedLayerCache(store, i) for i in range(2)]
        plan = pc.lookup(x)
        assert pc.restore(caches, x, plan, 0) == 3 * PAGE
        assert store.mapped_pages == 3 * 2
        pc.flush()  # (the writer thread records the holds)
        assert folder_summary(pc.folder)["held_pages"] == 3
        pc.set_budget(0)
        pc.flush()
        assert pc.lookup(x).hit_pages == 3, "held pages stay"
        assert pc.lookup(y).hit_pages == 0, "the rest went"
        store.close()
        store = None
        pc.set_budget(0)
        pc.flush()
        assert pc.lookup(x).hit_pages == 0 and not list(pc.folder.glob("*.kvp"))
        assert folder_summary(pc.folder)["held_pages"] == 0
    finally:
        if store is not None:
            store.close()
        pc.close()


def test_the_least_recently_used_chain_gives_way_page_by_page(tmp_path: Path) -> None:
    pc = new_prefix_cache(tmp_path / "pages")
    try:
        x, y, z = (prefix_prompt(3, seed=s) for s in (1, 2, 3))
        for p, s in ((x, 1), (y, 2), (z, 3)):
            _store(pc, p, 3, seed=s)
        now = time.time_ns()
        # Uses, oldest first: y, then x (z is the most recent).
        pc.table.touch(pc.lookup(y).hashes[:3], now - 3 * 10**9)
        pc.table.touch(pc.lookup(x).hashes[:3], now - 2 * 10**9)
        pc.table.touch(pc.lookup(z).hashes[:3], now - 1 * 10**9)
        pc.flush()  # (the lookups' own touches are queued; none of them: no restore ran)
        size = pc.disk_bytes()
        budget = size - 4 * pc.page_bytes - pc.run_head_bytes(3) - 1  # five pages must go
        pc.set_budget(budget / (1 << 20))
        pc.flush()
        assert [pc.lookup(p).hit_pages for p in (x, y, z)] == [1, 0, 3]
        assert pc.stats.evicted_pages == 5 and pc.stats.evicted_runs == 1
    finally:
        pc.close()


def test_a_truncated_run_cuts_the_chain_and_the_table_follows(tmp_path: Path) -> None:
    pc = new_prefix_cache(tmp_path / "pages")
    try:
        x = prefix_prompt(4, seed=1)
        _store(pc, x, 4, seed=1)
        run = pc.path(pc.lookup(x).hashes[0])
        with open(run, "r+b") as f:  # a crash in the middle of page 2
            f.truncate(pc.run_head_bytes(4) + 2 * pc.page_bytes + pc.page_bytes // 2)
        assert pc.lookup(x).hit_pages == 2
        assert folder_summary(pc.folder)["pages"] == 2
        # The next store writes pages 2 and 3 again, continuing the cut chain.
        assert _store(pc, x, 4, seed=1) == 2
        assert pc.lookup(x).hit_pages == 4 and folder_summary(pc.folder)["pages"] == 4
    finally:
        pc.close()


def test_runs_from_before_the_table_are_indexed_and_clear_empties_it(tmp_path: Path) -> None:
    folder = tmp_path / "pages"
    pc = new_prefix_cache(folder)
    x = prefix_prompt(3, seed=1)
    try:
        write_prefix_pages(pc, x, 3, seed=1)
    finally:
        pc.close()
    for p in folder.glob("pages.db*"):
        p.unlink()  # format-4 runs as the last version left them: no table
    summary = folder_summary(folder)
    assert summary["pages"] == 3 and summary["runs"] == 1
    pc = new_prefix_cache(folder)
    try:
        assert pc.lookup(x).hit_pages == 3
        pc.flush()
        assert pc.table.summary()["pages"] == 3
        assert pc.clear()[0] == 1
        s = folder_summary(folder)
        assert (s["pages"], s["asked_pages"], s["hit_rate"], s["bytes"]) == (0, 0, None, 0)
    finally:
        pc.close()


@pytest.mark.parametrize(("mode", "bits"), [("exact", 16), ("sparse", 8), ("exact", 4),
                                            ("sparse", 4)])
def test_paged_sessions_share_stored_pages_in_every_mode_and_width(
        tmp_path: Path, mode: str, bits: int) -> None:
    """Two sessions' prompts with a common prefix, stored from real paged stores (pages as
    the store encodes them at 16, 8 or 4 bits): the common pages once, and a third session
    maps the pages of both files as the first store held them."""
    from engine.kv.cache import PagedLayerCache
    from engine.kv.prefix import PrefixCache, PrefixSettings

    layers, heads, dim, page = 2, 2, 64, 16
    kv = KVSettings(mode=mode, bits=bits, page_tokens=page, ssd_dir=tmp_path / "pages" /
                    SESSIONS_DIR, sink_tokens=page, window_tokens=2 * page,
                    budget_tokens=4 * page).validate()
    pc = PrefixCache(b"q" * 32, layers, heads, dim, "float32",
                     PrefixSettings(folder=tmp_path / "pages", page_tokens=page, tails=False),
                     bits=bits, group=kv.group())
    stores: list[KVStore] = []

    def session(seed: int, pages: int) -> list[PagedLayerCache]:
        store = KVStore(kv, n_layers=layers, kv_heads=heads, head_dim=dim)
        stores.append(store)
        caches = [PagedLayerCache(store, i) for i in range(layers)]
        for i, c in enumerate(caches):
            for p in range(pages):
                k = mx.random.normal((heads, page, dim), key=mx.random.key(100 * i + p + seed))
                store.commit(i, k, 0.5 * k)
            c.offset = pages * page
        return caches

    try:
        rng = np.random.default_rng(3)
        common = [int(t) for t in rng.integers(0, 50_000, 3 * page)]
        a = common + [int(t) for t in rng.integers(0, 50_000, page + 1)]
        b = common + [int(t) for t in rng.integers(0, 50_000, page + 1)]
        sa = session(0, 4)
        assert pc.store(sa, a, pc.lookup(a)) == 4
        pc.flush()
        one = pc.disk_bytes()
        sb = session(0, 4)  # the same common pages (same prefix, same KV), its own last one
        assert pc.store(sb, b, pc.lookup(b)) == 1
        pc.flush()
        assert pc.disk_bytes() - one == pc.page_bytes + pc.run_head_bytes(1)
        assert folder_summary(pc.folder)["shared_pages"] == 3
        sc = session(7, 0)
        c = b[:4 * page] + [5]
        plan = pc.lookup(c)
        assert [r.first for r in plan.runs] == [0, 3]
        assert pc.restore(sc, c, plan, 0) == 4 * page
        for layer in range(layers):
            for p in (0, 3):
                want = sb[0].store.page_np(layer, p)
                got = sc[0].store.page_np(layer, p)
                assert np.array_equal(np.asarray(want[0]), np.asarray(got[0]))
                assert np.array_equal(np.asarray(want[1]), np.asarray(got[1]))
        pc.flush()
        assert folder_summary(pc.folder)["held_pages"] == 4
    finally:
        for s in stores:
            s.close()
        pc.close()


_WRITER = """
import sys
from pathlib import Path
from tests.reliability.common import new_prefix_cache, prefix_pages, prefix_prompt, PAGE
from dataclasses import replace
folder, seed = Path(sys.argv[1]), int(sys.argv[2])
pc = new_prefix_cache(folder)
pc.settings = replace(pc.settings, budget_mb=float(sys.argv[3]))
common = prefix_prompt(2, seed=99)[:2 * PAGE]
for i in range(12):
    own = prefix_prompt(2, seed=1000 * seed + i)
    prompt = common + own
    plan = pc.lookup(prompt)
    s = plan.hit_pages
    ks, vs = prefix_pages(4, seed=seed)
    pc.store_pages(prompt, plan, s, [k[:, s * PAGE:] for k in ks], [v[:, s * PAGE:] for v in vs])
pc.close()
"""


def test_processes_storing_and_evicting_at_once_leave_a_table_that_matches_the_files(
        tmp_path: Path) -> None:
    folder = tmp_path / "pages"
    probe = new_prefix_cache(folder)
    budget = (10 * probe.page_bytes + 8 * probe.run_head_bytes(2)) / (1 << 20)
    probe.close()
    repo = Path(__file__).resolve().parents[3]
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(folder), str(seed),
                               str(budget)], cwd=repo) for seed in (1, 2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    pc = new_prefix_cache(folder)
    try:
        pc.flush()
        # Every page the table lists is in its file, and every run file is listed.
        from engine.kv.prefix_table import run_header

        files = {p.name: run_header(p) for p in folder.glob("*.kvp")}
        rows = list(pc.table.db.execute("SELECT run, COUNT(*) FROM pages GROUP BY run"))
        assert {r: n for r, n in rows} == {name: len(h[6]) for name, h in files.items()
                                           if h is not None}
        assert pc.disk_bytes() <= budget * (1 << 20)
        # The common prefix is stored once and still leads somewhere.
        common = prefix_prompt(2, seed=99)[:2 * PAGE] + [1]
        assert pc.lookup(common).hit_pages == 2
        assert len([h for h in files.values() if h is not None and h[2] == 0]) == 1
    finally:
        pc.close()


def test_eviction_leaves_a_run_alone_whose_file_is_not_the_one_the_table_listed(
        tmp_path: Path) -> None:
    # ext4 hands a freed inode to the next new file, so a run another process replaced can
    # carry the inode eviction's query saw. Here the file is rewritten in place (the same
    # inode for certain) as a longer run: a drop planned on the old listing must not cut it.
    from engine.kv.prefix_table import run_header

    folder = tmp_path / "pages"
    pc = new_prefix_cache(folder)
    try:
        prompt = prefix_prompt(3, seed=5)
        write_prefix_pages(pc, prompt[:2 * PAGE], 2)
        pc.flush()
        run = next(folder.glob("*.kvp"))
        ino, head, pbytes = (list(pc.table.db.execute(
            "SELECT ino, head, pbytes FROM runs WHERE name=?", (run.name,)))[0])
        longer = tmp_path / "longer"
        longer.mkdir()
        other = new_prefix_cache(longer)
        write_prefix_pages(other, prompt, 3)
        other.close()
        data = next(longer.glob("*.kvp")).read_bytes()
        with open(run, "r+b") as f:  # same inode, the 3-page run's bytes
            f.write(data)
        assert run.stat().st_ino == ino
        assert not pc.table._drop(run.name, 1, ino, head, pbytes)
        assert run.read_bytes() == data  # not cut at the old layout's page boundary
        h = run_header(run)
        assert h is not None and len(h[6]) == 3
        rows = list(pc.table.db.execute("SELECT COUNT(*) FROM pages WHERE run=?", (run.name,)))
        assert rows[0][0] == 3  # and the table lists what the file holds
    finally:
        pc.close()

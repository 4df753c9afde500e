"""One page store on the disk: stored runs at the top of one folder, live sessions' SSD tiers
in its `sessions` folder, one budget over both (runs make room for live sessions, never the
other way), and the one-time move of earlier versions' `prefix` folder into it. Real files,
real writer threads, real processes for the dead session."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from engine.kv import KVSettings
from engine.kv.prefix import folder_summary
from engine.kv.settings import SESSIONS_DIR, store_root
from engine.kv.store import KVStore
from tests.reliability.common import (
    HEAD_DIM,
    KV_HEADS,
    PAGE,
    new_prefix_cache,
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
        stamp = time.time_ns() - 10**9
        os.utime(pc.path(pc.lookup(old).hashes[0]), ns=(stamp, stamp))  # least recent
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
        # One byte short of both runs and the session: the older run goes, the session stays.
        live = summary["session_bytes"]
        pc.settings = replace(pc.settings, budget_mb=(runs_bytes + live - 1) / (1 << 20))
        pc._evict()
        assert pc.lookup(old).hit_pages == 0 and pc.lookup(new).hit_pages == 2
        assert folder_summary(root)["session_bytes"] == summary["session_bytes"]
        session.close()
        session = None
        assert folder_summary(root)["sessions"] == 0
    finally:
        if session is not None:
            session.close()
        pc.close()

"""kill -9 at random points while Strata writes: KV pages, prefix-cache pages, an import into
the library, the chat database. Real child processes (tests.reliability.kill_child).

Contract checked after every kill: no torn page or entry is ever returned (readers verify and
reject), caches recover (dead sessions and temp files are swept), the library lists only
complete models (and a model being replaced is never lost), and every finished chat message
is kept. STRATA_KILL_ITERATIONS sets the kills per target (default 50).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.kv.pagefile import PageCorrupt, RecordFile
from engine.library.store import Library, fingerprint
from tests.conftest import REPO
from tests.reliability.common import (
    PAGE,
    new_prefix_cache,
    page_arrays,
    prefix_pages,
    prefix_prompt,
    read_prefix_page,
    write_tiny_gguf,
)

ITERATIONS = int(os.environ.get("STRATA_KILL_ITERATIONS", "50"))


def kill_at_random(target: str, folder: Path, rng: random.Random, longest: float
                   ) -> list[str]:
    """Start a child, wait for READY, SIGKILL it after a random delay; its stdout lines."""
    child = subprocess.Popen([sys.executable, "-m", "tests.reliability.kill_child", target,
                              str(folder)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, STRATA_HOME=str(folder.parent / "home")))
    assert child.stdout is not None and child.stderr is not None
    lines: list[str] = []
    try:
        while True:
            line = child.stdout.readline()
            if not line:
                raise AssertionError(f"child died before READY: {child.stderr.read()[-2000:]}")
            lines.append(line.strip())
            if line.startswith("READY"):
                break
        time.sleep(rng.uniform(0, longest))
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        lines += child.stdout.read().split()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
    return lines


def test_kill_during_kv_page_writes(tmp_path: Path) -> None:
    from engine.kv import KVSettings
    from engine.kv.store import KVStore

    rng = random.Random(1)
    root = tmp_path / "kv"
    P, H, D = 128, 2, 64
    checked = corrupt = 0
    for _ in range(ITERATIONS):
        lines = kill_at_random("kv", root, rng, 0.15)
        session = Path(next(x for x in lines if x.startswith("SESSION")).split(" ", 1)[1])
        records = RecordFile(session / "layer-00.kvp", 0, H, D, P, np.dtype(np.float32))
        n = os.path.getsize(records.path) // records.size + 1
        for i in range(n):
            try:
                head, k, v = records.read(i)
            except PageCorrupt:
                corrupt += 1
                continue
            want_k, want_v = page_arrays(0, i, 0, (H, P, D))
            assert np.array_equal(k, want_k) and np.array_equal(v, want_v), f"page {i}"
            checked += 1
        records.close()
        # A new store (the next session) sweeps the dead one's files.
        settings = KVSettings(mode="exact", page_tokens=P, ssd_dir=root, ram_mb=1,
                              sink_tokens=P, window_tokens=P, budget_tokens=4 * P)
        store = KVStore(settings, n_layers=1, kv_heads=H, head_dim=D)
        assert not session.exists()
        store.close()
        assert list(root.iterdir()) == []
    assert checked > 0
    print(f"kv: {ITERATIONS} kills, {checked} pages verified, {corrupt} rejected")


def test_kill_during_prefix_cache_writes(tmp_path: Path) -> None:
    rng = random.Random(2)
    folder = tmp_path / "prefix"
    restored = rejected = 0
    for _ in range(ITERATIONS):
        lines = kill_at_random("prefix", folder, rng, 0.15)
        done = [int(x) for x in lines if x.isdigit()]
        cache = new_prefix_cache(folder)  # sweeps the dead writer's temp files
        try:
            assert not list(folder.glob(".tmp-*"))
            names = {p.name for p in folder.glob("*.kvp")}
            for seed in range(max(done, default=0) + 3):
                prompt = prefix_prompt(4, seed)
                plan = cache.lookup(prompt)
                for depth in range(plan.hit_pages):
                    ok, got_k, got_v = read_prefix_page(cache, prompt, depth)
                    names.discard(plan.hashes[depth].hex() + ".kvp")
                    if not ok:
                        rejected += 1
                        continue
                    ks, vs = prefix_pages(4, seed)
                    sl = slice(depth * PAGE, (depth + 1) * PAGE)
                    for layer in range(len(ks)):
                        assert np.array_equal(got_k[layer][0], ks[layer][:, sl])
                        assert np.array_equal(got_v[layer][0], vs[layer][:, sl])
                    restored += 1
                if seed in done:
                    assert plan.hit_pages == 4, f"finished prefix {seed} lost"
            # Pages past a gap in a chain are unreachable but harmless; none may be foreign.
            assert all(len(n) == 68 for n in names)
        finally:
            cache.close()
    assert restored > 0
    print(f"prefix: {ITERATIONS} kills, {restored} pages verified, {rejected} rejected")


def test_kill_during_import(tmp_path: Path) -> None:
    rng = random.Random(3)
    home = tmp_path / "home"
    write_tiny_gguf(tmp_path / "tiny.gguf")
    fixed_ever = False
    for _ in range(ITERATIONS):
        lines = kill_at_random("import", home, rng, 0.4)
        fixed_ever = fixed_ever or "fixed" in lines
        library = Library(home)  # sweeps the dead import's temp folder
        leftovers = [p.name for p in library.models_dir.iterdir()
                     if p.name.startswith(".tmp-")]
        assert not leftovers, leftovers
        manifests = library.manifests()
        folders = {p.name for p in library.models_dir.iterdir() if not p.name.startswith(".")}
        assert folders == {m["name"] for m in manifests}, "a model folder without manifest"
        for m in manifests:
            assert fingerprint(Path(m["path"])) == m["fingerprint"], m["name"]
            json.loads((Path(m["path"]) / "config.json").read_text())
        for name in lines:
            if name.startswith("m") and name[1:].isdigit():
                assert library.find(name) is not None, f"finished import {name} lost"
        if fixed_ever:  # a replacement killed half way keeps the model it replaced
            assert library.find("fixed") is not None
    print(f"import: {ITERATIONS} kills, {len(Library(home).manifests())} models listed")


def test_kill_during_chat_writes(tmp_path: Path) -> None:
    from app.chat.store import ChatStore

    rng = random.Random(4)
    db = tmp_path / "chats.sqlite3"
    finished: dict[int, int] = {}
    for _ in range(ITERATIONS):
        lines = kill_at_random("chat", db, rng, 0.1)
        it = iter(lines)
        for word in it:
            if word == "DONE":
                mid, i = int(next(it)), int(next(it))
                finished[mid] = i
        store = ChatStore(db)
        try:
            for mid, i in finished.items():
                m = store.message(mid)
                assert m is not None and m.status == "complete", mid
                want = "".join(f"part {j} of reply {i}. " for j in range(5))
                assert m.content == want and m.stats == {"n": i}
            assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            statuses = {r[0] for r in store._db.execute("SELECT status FROM messages")}
            assert "streaming" not in statuses
        finally:
            store.close()
    assert finished
    print(f"chat: {ITERATIONS} kills, {len(finished)} finished replies all kept")


@pytest.mark.slow
def test_greedy_output_after_killed_prefix_write_equals_uncached(
        starter: dict[str, Any], tmp_path: Path) -> None:
    """A child that is killed while writing the starter model's prefix pages leaves a cache
    whose restore gives the same greedy tokens as a run without any cache."""
    prompt_text = "Strata keeps prompt prefixes on disk. " * 40 + "What is the capital of France?"
    folder = tmp_path / "prefix"
    code = f"""
import sys, time
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.sampling import SamplingParams
from engine.kv.prefix import PrefixSettings
lm = LoadedModel.load({starter["path"]!r})
cache = lm.enable_prefix_cache(PrefixSettings(folder={str(folder)!r}, page_tokens=32))
ids = lm.tokenizer.encode_chat([{{"role": "user", "content": {prompt_text!r}}}])
first = lm.tokenizer.encode_chat([{{"role": "user", "content": {prompt_text[:600]!r}}}])
for ev in generate(lm, first, SamplingParams(temperature=0.0), max_tokens=2):
    pass
cache.flush()
print("RUN", flush=True)  # one run on disk; the next one is killed while it is written
orig = cache._page_record
def slow(*a, **k):
    print("PAGE", flush=True)
    time.sleep(0.05)
    return orig(*a, **k)
cache._page_record = slow
for ev in generate(lm, ids, SamplingParams(temperature=0.0), max_tokens=2):
    pass
time.sleep(60)
"""
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    assert child.stdout is not None
    try:
        assert child.stdout.readline().startswith("RUN")
        for _ in range(3):  # a run is on disk, the next one is being written
            assert child.stdout.readline().startswith("PAGE")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
    # Tear a page inside the stored run as a torn write would: it must be rejected, not used.
    runs = sorted(folder.glob("*.kvp"))
    assert len(runs) == 1
    with open(runs[0], "r+b") as fh:
        fh.seek(os.path.getsize(runs[0]) // 2)
        fh.write(b"\xff" * 64)

    from engine.kv.prefix import PrefixSettings
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams

    lm = LoadedModel.load(starter["path"])
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": prompt_text}])
    greedy = SamplingParams(temperature=0.0)
    plain = [e.token for e in generate(lm, ids, greedy, max_tokens=12, prefix_cache=False)]
    cache = lm.enable_prefix_cache(PrefixSettings(folder=folder, page_tokens=32))
    assert not list(folder.glob(".tmp-*"))
    events = list(generate(lm, ids, greedy, max_tokens=12))
    assert [e.token for e in events] == plain
    cache.flush()
    again = list(generate(lm, ids, greedy, max_tokens=12))
    assert [e.token for e in again] == plain
    assert again[-1].cached_tokens > 0
    cache.close()

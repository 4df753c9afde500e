"""The SSD prefix cache on the real starter model: restart reuse, keys, corruption, divergence,
eviction. In-process tests use 32-token pages so short prompts span several pages. Full
pages only (tails off, in this process and the ones it starts): test_tail.py covers the
partial last page."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.kv.prefix import PrefixCache, PrefixCacheError, PrefixSettings, model_key
from engine.platform import ComputeProfile
from engine.runtime.generate import generate
from engine.runtime.model import model_identity
from engine.runtime.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(temperature=0)
SYSTEM = ("You are the archivist of a small maritime museum. " + "The archive keeps letters, "
          "maps, tide tables and ledgers from the old harbour office, sorted by year. " * 40)


@pytest.fixture(autouse=True)
def _full_pages_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_PREFIX_TAILS", "0")


def _run(lm: Any, ids: list[int], **kw: Any) -> tuple[list[int], Any]:
    tokens, last = [], None
    for ev in generate(lm, ids, GREEDY, 6, **kw):
        if ev.token is not None:
            tokens.append(ev.token)
        last = ev
    return tokens, last




def _ids(lm: Any, n: int, salt: str = "") -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(lm.tokenizer.encode(salt + SYSTEM, add_bos=False))
    return ids[:n]


# -- restart -------------------------------------------------------------------------------
def test_an_unreadable_system_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    r = subprocess.run([sys.executable, "-m", "app", "generate", "--system-file", str(missing),
                        "--prompt", "hi"], capture_output=True, text=True, cwd=REPO,
                       env=dict(os.environ, STRATA_HOME=str(tmp_path / "home")), timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "system prompt" in lines[0]


def test_restart_reuses_the_prefix_and_output_is_unchanged(starter: Any, tmp_path: Path
                                                           ) -> None:
    env = dict(os.environ, STRATA_PREFIX_DIR=str(tmp_path / "px"))
    cmd = [sys.executable, "-m", "app", "generate", "--model", starter["name"],
           "--system", SYSTEM, "--prompt", "What does the archive keep?", "--temp", "0",
           "--max-tokens", "8", "--json", "--timeline"]

    def run() -> tuple[dict[str, Any], str]:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout), r.stderr

    first, _ = run()
    assert first["cached_tokens"] == 0 and first["prompt_tokens"] > 600
    assert len(list((tmp_path / "px").glob("*.kvp"))) == 1, "the first process left no run"
    # The same system prompt from a file (--system-file) finds the same stored prefix.
    (tmp_path / "system.txt").write_text(SYSTEM)
    at = cmd.index("--system")
    cmd[at:at + 2] = ["--system-file", str(tmp_path / "system.txt")]
    second, timeline = run()
    assert second["cached_tokens"] >= first["prompt_tokens"] - 128
    assert second["text"] == first["text"]
    for phase in ("interpreter and imports", "weights", "tokenizer", "warm-up", "cache lookup",
                  "cache restore", "prefill", "first decode"):
        assert phase in timeline, phase
    # `strata cache` shows the run; --clear removes it, and nothing is left to restore.
    show = [sys.executable, "-m", "app", "cache", "--json"]
    r = subprocess.run(show, capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["runs"] == 1 and info["bytes"] > 0 and info["folder"] == str(tmp_path / "px")
    (model,) = info["models"]  # per model: named from the labels the process wrote
    assert model["name"] == starter["name"] and model["pages"] == info["pages"] > 0
    text = subprocess.run(show[:-1], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=60).stdout
    assert f"{starter['name']}: {info['pages']} pages (0 shared) in 1 runs" in text
    assert f"hit rate: {info['pages']} of {2 * info['pages']} pages asked for" in text
    r = subprocess.run([*show, "--clear"], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=60)
    assert json.loads(r.stdout)["removed_runs"] == 1
    assert not list((tmp_path / "px").glob("*.kvp"))
    bad = subprocess.run(show, capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={**env, "STRATA_PREFIX_MB": "lots"})
    assert bad.returncode == 1 and "STRATA_PREFIX_MB" not in bad.stdout
    assert bad.stderr.strip().count("\n") == 0 and "not a whole number" in bad.stderr


# -- keys ----------------------------------------------------------------------------------
def test_any_change_of_model_or_setting_changes_the_key(starter_lm: Any) -> None:
    def key(manifest: Any = None, config: Any = None, profile: Any = None, bits: int = 16
            ) -> bytes:
        return model_key(model_identity(manifest or starter_lm.manifest,
                                        config or starter_lm.config,
                                        profile or starter_lm.profile, bits))

    base = key()
    assert starter_lm.prefix_key() == base  # the loaded model keys its pages the same way
    variants: list[dict[str, Any]] = [
        {"manifest": {**starter_lm.manifest, "fingerprint": "sha256:other"}},
        {"config": {**starter_lm.config, "rope_theta": 10000.0}},
        {"config": {**starter_lm.config, "quantization": {"group_size": 64, "bits": 8}}},
        {"profile": ComputeProfile("native", dequantize=False, dtype="float32")},
        {"profile": replace(starter_lm.profile, dtype="float16")},
        {"bits": 8},
    ]
    for v in variants:
        assert key(**v) != base, v


def test_a_different_model_key_never_reuses(starter_lm: Any, prefix: PrefixCache) -> None:
    ids = _ids(starter_lm, 100)
    _run(starter_lm, ids)
    prefix.flush()
    assert prefix.lookup(ids).hit_pages == 3
    other = PrefixCache(b"\x01" * 32, prefix.n_layers, prefix.kv_heads, prefix.head_dim,
                        prefix.dtype_name, prefix.settings)
    try:
        starter_lm.prefix_cache = other
        assert other.lookup(ids).hit_pages == 0
        _, last = _run(starter_lm, ids)
        assert last.cached_tokens == 0
    finally:
        starter_lm.prefix_cache = prefix
        other.close()


# -- integrity -----------------------------------------------------------------------------
def _one_run(prefix: PrefixCache, ids: list[int], pages: int) -> Path:
    plan = prefix.lookup(ids)
    assert plan.hit_pages == pages and len(plan.runs) == 1
    return plan.runs[0].path


def _stored(lm: Any, prefix: PrefixCache, n: int, pages: int, salt: str = ""
            ) -> tuple[list[int], list[int], Path]:
    """n prompt tokens, their uncached greedy output, and the one run their pages went to."""
    ids = _ids(lm, n, salt=salt)
    want, last = _run(lm, ids, prefix_cache=False)
    assert last.cached_tokens == 0
    _run(lm, ids)
    prefix.flush()
    return ids, want, _one_run(prefix, ids, pages)


def test_a_corrupt_page_inside_a_run_is_rejected_and_rebuilt(starter_lm: Any,
                                                             prefix: PrefixCache) -> None:
    ids, want, run = _stored(starter_lm, prefix, 140, 4)  # 4 full pages of 32, one run
    head = prefix.run_head_bytes(4)
    data = bytearray(run.read_bytes())
    assert len(data) == head + 4 * prefix.page_bytes
    data[head + 2 * prefix.page_bytes + prefix.page_bytes // 2] ^= 0xFF  # page 2's records
    run.write_bytes(bytes(data))
    got, last = _run(starter_lm, ids)
    assert last.cached_tokens == 64  # pages 0 and 1: the match ends at the corrupt page
    assert got == want
    prefix.flush()
    assert prefix.stats.corrupt_pages == 1
    # The run was cut before the bad page; the store wrote pages 2 and 3 as a new run that
    # refers to the first one, whose two good pages were not written again.
    assert run.stat().st_size == head + 2 * prefix.page_bytes
    plan = prefix.lookup(ids)
    assert plan.hit_pages == 4 and [r.first for r in plan.runs] == [0, 2]
    assert prefix.disk_bytes() == head + prefix.run_head_bytes(2) + 4 * prefix.page_bytes
    got, last = _run(starter_lm, ids)
    assert last.cached_tokens == 128 and got == want


def test_a_truncated_run_uses_only_its_whole_pages(starter_lm: Any, prefix: PrefixCache
                                                   ) -> None:
    ids, want, run = _stored(starter_lm, prefix, 140, 4, salt="Torn. ")
    with open(run, "r+b") as f:  # a torn write: page 1 is half there
        f.truncate(prefix.run_head_bytes(4) + prefix.page_bytes + prefix.page_bytes // 2)
    assert prefix.lookup(ids).hit_pages == 1
    got, last = _run(starter_lm, ids)
    assert last.cached_tokens == 32 and got == want
    prefix.flush()
    assert prefix.lookup(ids).hit_pages == 4
    got, last = _run(starter_lm, ids)
    assert last.cached_tokens == 128 and got == want


def test_a_damaged_run_header_is_ignored_and_replaced(starter_lm: Any, prefix: PrefixCache
                                                      ) -> None:
    ids, want, run = _stored(starter_lm, prefix, 100, 3, salt="Header. ")
    data = bytearray(run.read_bytes())
    data[40] ^= 0x01  # inside the run header's list of page hashes
    run.write_bytes(bytes(data))
    assert prefix.lookup(ids).hit_pages == 0
    got, last = _run(starter_lm, ids)
    assert last.cached_tokens == 0 and got == want
    prefix.flush()
    assert _one_run(prefix, ids, 3) == run  # rewritten under the same name


def test_restore_matches_prefill_exactly(starter_lm: Any, prefix: PrefixCache) -> None:
    ids = _ids(starter_lm, 200, salt="Exactly. ")
    want, _ = _run(starter_lm, ids, prefix_cache=False)
    _run(starter_lm, ids)
    prefix.flush()
    got, last = _run(starter_lm, ids)
    assert last.cached_tokens == 192 and got == want


# -- divergence ----------------------------------------------------------------------------
def test_divergence_mid_page_reuses_only_the_pages_before(starter_lm: Any,
                                                          prefix: PrefixCache) -> None:
    a = _ids(starter_lm, 140, salt="Divergence. ")
    _run(starter_lm, a)
    prefix.flush()
    b = a[:70] + starter_lm.tokenizer.encode(" Something else entirely, about ships and "
                                             "storms and the long winter of that year.",
                                             add_bos=False) * 3
    want, _ = _run(starter_lm, b, prefix_cache=False)
    got, last = _run(starter_lm, b)
    assert last.cached_tokens == 64  # pages 0 and 1; page 2 (64..95) diverges at 70
    assert got == want


def test_a_second_prompt_reuses_the_shared_pages_without_copying_them(
        starter_lm: Any, prefix: PrefixCache) -> None:
    a = _ids(starter_lm, 140, salt="Shared. ")  # 4 pages
    _run(starter_lm, a)
    prefix.flush()
    assert prefix.stats.pages_written == 4 and prefix.stats.runs_written == 1
    # Diverges inside page 2: pages 0 and 1 are reused, pages 2.. are its own.
    b = a[:70] + _ids(starter_lm, 90, salt="Another text. ")
    want_b, _ = _run(starter_lm, b, prefix_cache=False)
    got, last = _run(starter_lm, b)
    assert last.cached_tokens == 64 and got == want_b
    prefix.flush()
    n_b = (len(b) - 1) // 32
    assert prefix.stats.pages_written == 4 + n_b - 2 and prefix.stats.runs_written == 2
    # Extends the first prompt: only the new pages are written, as a run after page 3.
    c = a + _ids(starter_lm, 100, salt="More. ")
    want_c, _ = _run(starter_lm, c, prefix_cache=False)
    got, last = _run(starter_lm, c)
    assert last.cached_tokens == 128 and got == want_c
    prefix.flush()
    n_c = (len(c) - 1) // 32
    assert prefix.stats.pages_written == 4 + (n_b - 2) + (n_c - 4)
    pages = 4 + (n_b - 2) + (n_c - 4)
    heads = prefix.run_head_bytes(4) + prefix.run_head_bytes(n_b - 2) + prefix.run_head_bytes(
        n_c - 4)
    assert prefix.disk_bytes() == heads + pages * prefix.page_bytes  # no page twice
    plan = prefix.lookup(c)
    assert plan.hit_pages == n_c and [r.first for r in plan.runs] == [0, 4]
    assert [r.first for r in prefix.lookup(b).runs] == [0, 2]
    got, last = _run(starter_lm, c)
    assert last.cached_tokens == n_c * 32 and got == want_c


# -- eviction ------------------------------------------------------------------------------
def test_eviction_under_a_tiny_budget_keeps_the_most_recent(starter_lm: Any,
                                                            tmp_path: Path) -> None:
    probe = starter_lm.new_prefix_cache(PrefixSettings(folder=tmp_path / "e", tails=False,
                                                             page_tokens=32))
    budget = (2.5 * probe.page_bytes + 2 * probe.run_head_bytes(2)) / (1 << 20)  # one run
    probe.close()
    pc = starter_lm.new_prefix_cache(PrefixSettings(folder=tmp_path / "e", tails=False,
                                                          page_tokens=32, budget_mb=budget))
    starter_lm.prefix_cache = pc
    try:
        x = _ids(starter_lm, 70, salt="First. ")
        y = _ids(starter_lm, 70, salt="Second. ")
        _run(starter_lm, x)
        pc.flush()
        assert pc.lookup(x).hit_pages == 2
        _run(starter_lm, y)
        pc.flush()
        assert pc.lookup(y).hit_pages == 2
        assert pc.lookup(x).hit_pages == 0
        assert pc.disk_bytes() <= budget * (1 << 20)
        assert pc.stats.evicted_pages == 2 and pc.stats.evicted_runs == 1
    finally:
        starter_lm.prefix_cache = None
        pc.close()


def test_a_new_budget_evicts_and_clear_empties_the_folder(starter_lm: Any,
                                                          prefix: PrefixCache) -> None:
    x, y = _ids(starter_lm, 70, salt="First. "), _ids(starter_lm, 70, salt="Second. ")
    _run(starter_lm, x)
    _run(starter_lm, y)
    prefix.flush()
    assert prefix.lookup(x).hit_pages == prefix.lookup(y).hit_pages == 2
    one_run = prefix.disk_bytes() / 2 / (1 << 20)
    prefix.set_budget(one_run * 1.5)  # room for one of the two runs: the older leaves
    prefix.flush()
    assert prefix.lookup(x).hit_pages == 0 and prefix.lookup(y).hit_pages == 2
    assert prefix.settings.budget_mb == one_run * 1.5
    with pytest.raises(PrefixCacheError, match="negative"):
        prefix.set_budget(-1)
    prefix.set_budget(4096)
    _run(starter_lm, x)  # queued, then written by clear() before it removes everything
    assert prefix.clear()[0] == 2
    assert prefix.disk_bytes() == 0 and prefix.lookup(y).hit_pages == 0


def test_eviction_takes_leaf_pages_least_recent_first_and_keeps_chains_whole(
        tmp_path: Path) -> None:
    from tests.reliability.common import PAGE, new_prefix_cache, prefix_prompt, write_prefix_pages

    pc = new_prefix_cache(tmp_path / "ev")
    try:
        x = prefix_prompt(4, seed=1)
        write_prefix_pages(pc, x, 2, seed=1)  # run X: pages 0-1
        plan = pc.lookup(x)
        assert plan.hit_pages == 2
        # Run Y continues X with pages 2-3 (what a store after a restore of X writes).
        from engine.kv.prefix import _Job
        from tests.reliability.common import prefix_pages

        ks, vs = prefix_pages(4, seed=1)
        pages = [(d, plan.hashes[d - 1], plan.hashes[d],
                  np.asarray(x[d * PAGE:(d + 1) * PAGE], "<u4")) for d in (2, 3)]
        pc._write_run(_Job(pages, [k[:, 2 * PAGE:] for k in ks], [v[:, 2 * PAGE:] for v in vs],
                           2))
        assert [r.first for r in pc.lookup(x).runs] == [0, 2]
        z = prefix_prompt(2, seed=2)
        write_prefix_pages(pc, z, 2, seed=2)
        # X's chain (X, then Y) is the least recently used. Eviction takes leaves only: Y's
        # pages 3 and 2 (Y's file goes), then X's page 1 before any of Z's, never X's page 0
        # while page 1 is stored (a page whose parent is gone could never be reached).
        pc.flush()
        pc.table.touch(pc.lookup(x).hashes, time.time_ns() - 10**9)
        pc.settings = replace(pc.settings, budget_mb=(pc.disk_bytes() - 2 * pc.page_bytes
                                                      - pc.run_head_bytes(2) - 1) / (1 << 20))
        pc._evict()
        assert pc.stats.evicted_runs == 1 and pc.stats.evicted_pages == 3
        assert sorted(p.name for p in pc.folder.glob("*.kvp")) == sorted(
            pc.path(h).name for h in (plan.hashes[0], pc.lookup(z).hashes[0]))
        assert pc.lookup(x).hit_pages == 1 and pc.lookup(z).hit_pages == 2
    finally:
        pc.close()


def test_format_2_files_are_never_used_and_go_first(tmp_path: Path) -> None:
    from tests.reliability.common import new_prefix_cache, prefix_prompt, write_prefix_pages

    pc = new_prefix_cache(tmp_path / "old")
    try:
        x = prefix_prompt(2, seed=3)
        write_prefix_pages(pc, x, 2, seed=3)
        stale = pc.folder / ("ab" * 32 + ".kvp")  # a format-2 page file: another header
        stale.write_bytes(b"STRATAPX" + b"\x02\x00" + bytes(1000))
        os.utime(stale, ns=(time.time_ns() + 10**9,) * 2)  # even if it looks recent
        assert pc.lookup(x).hit_pages == 2
        pc.settings = replace(pc.settings, budget_mb=(pc.disk_bytes() - 1) / (1 << 20))
        pc._evict()
        assert not stale.exists() and pc.lookup(x).hit_pages == 2
    finally:
        pc.close()

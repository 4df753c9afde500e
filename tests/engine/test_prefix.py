"""The SSD prefix cache on the real starter model: restart reuse, keys, corruption, divergence,
eviction. In-process tests use 32-token pages so short prompts span several pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.kv.prefix import PrefixCache, PrefixSettings, model_key
from engine.platform import ComputeProfile
from engine.runtime.generate import generate
from engine.runtime.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0)
SYSTEM = ("You are the archivist of a small maritime museum. " + "The archive keeps letters, "
          "maps, tide tables and ledgers from the old harbour office, sorted by year. " * 40)


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
def test_restart_reuses_the_prefix_and_output_is_unchanged(starter: Any, tmp_path: Path
                                                           ) -> None:
    env = dict(os.environ, STRATA_PREFIX_DIR=str(tmp_path / "px"))
    cmd = [sys.executable, "-m", "engine", "generate", "--model", starter["name"],
           "--system", SYSTEM, "--prompt", "What does the archive keep?", "--temp", "0",
           "--max-tokens", "8", "--json", "--timeline"]

    def run() -> tuple[dict[str, Any], str]:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout), r.stderr

    first, _ = run()
    assert first["cached_tokens"] == 0 and first["prompt_tokens"] > 600
    assert list((tmp_path / "px").glob("*.kvp")), "the first process left no pages"
    second, timeline = run()
    assert second["cached_tokens"] >= first["prompt_tokens"] - 128
    assert second["text"] == first["text"]
    for phase in ("interpreter and imports", "weights", "tokenizer", "warm-up", "cache lookup",
                  "cache restore", "prefill", "first decode"):
        assert phase in timeline, phase


# -- keys ----------------------------------------------------------------------------------
def test_any_change_of_model_or_setting_changes_the_key(starter_lm: Any) -> None:
    base = model_key(starter_lm)
    fake = types.SimpleNamespace(manifest=dict(starter_lm.manifest), config=starter_lm.config,
                                 profile=starter_lm.profile)
    assert model_key(fake) == base
    variants: list[dict[str, Any]] = [
        {"manifest": {**starter_lm.manifest, "fingerprint": "sha256:other"}},
        {"config": {**starter_lm.config, "rope_theta": 10000.0}},
        {"config": {**starter_lm.config, "quantization": {"group_size": 64, "bits": 8}}},
        {"profile": ComputeProfile("native", dequantize=False, dtype="float32")},
        {"profile": replace(starter_lm.profile, dtype="float16")},
    ]
    for v in variants:
        other = types.SimpleNamespace(**{**vars(fake), **v})
        assert model_key(other) != base, v
    assert model_key(starter_lm, kv_bits=8) != base


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
def test_corrupt_and_truncated_pages_are_ignored_and_rebuilt(starter_lm: Any,
                                                             prefix: PrefixCache) -> None:
    ids = _ids(starter_lm, 140)  # 4 full pages of 32
    want, last = _run(starter_lm, ids, prefix_cache=False)
    assert last.cached_tokens == 0
    _run(starter_lm, ids)
    prefix.flush()
    plan = prefix.lookup(ids)
    assert plan.hit_pages == 4
    p1, p2 = prefix.path(plan.hashes[1]), prefix.path(plan.hashes[2])
    data = bytearray(p1.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in the keys of some layer
    p1.write_bytes(bytes(data))
    with open(p2, "r+b") as f:
        f.truncate(p2.stat().st_size - 100)
    got, last = _run(starter_lm, ids)
    assert last.cached_tokens == 32  # page 0 only: the match ends at the corrupt page
    assert got == want
    prefix.flush()
    assert prefix.stats.corrupt_pages == 2
    assert p1.read_bytes() != bytes(data), "a corrupt page must be removed and rewritten"
    assert prefix.lookup(ids).hit_pages == 4  # rebuilt by the store after that prefill
    got, last = _run(starter_lm, ids)
    assert last.cached_tokens == 128 and got == want


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


# -- eviction ------------------------------------------------------------------------------
def test_eviction_under_a_tiny_budget_keeps_the_most_recent(starter_lm: Any,
                                                            tmp_path: Path) -> None:
    probe = PrefixCache.for_model(starter_lm, PrefixSettings(folder=tmp_path / "e",
                                                             page_tokens=32))
    budget = 2.5 * probe.file_bytes / (1 << 20)  # room for two pages
    probe.close()
    pc = PrefixCache.for_model(starter_lm, PrefixSettings(folder=tmp_path / "e",
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
        assert pc.stats.evicted_pages == 2
    finally:
        starter_lm.prefix_cache = None
        pc.close()

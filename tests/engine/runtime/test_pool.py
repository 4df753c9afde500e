"""engine.runtime.pool: the one owner of the loaded model and its caches, on the real starter."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.errors import StrataError
from engine.kv import KVSettings
from engine.library import Library
from engine.runtime.pool import MIN_SHARED, ModelPool, PoolSettings, settings_from_options
from engine.runtime.sampling import SamplingParams

SYSTEM = "You are a terse assistant who answers in one short sentence about geography."


@pytest.fixture(scope="module")
def pool(library: Library, starter: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[ModelPool]:
    folder = tmp_path_factory.mktemp("pool-prefix")
    p = ModelPool(library, PoolSettings(prefix_dir=folder), sessions=2, caches=2)
    p.get(starter["name"])
    yield p
    p.close()


def test_get_loads_once_and_reports_the_load(library: Library, starter: dict[str, Any]
                                              ) -> None:
    heard: list[Any] = []
    p = ModelPool(library, PoolSettings(prefix_cache=False))
    p.on_loading, p.on_loaded = heard.append, heard.append
    try:
        lm = p.get("starter")  # an alias
        assert p.get(starter["name"]) is lm and p.lm is lm
        assert heard[0] == starter["name"] and heard[1]["name"] == starter["name"]
        assert len(heard) == 2  # the second get loaded nothing
        assert heard[1]["weights_bytes"] == p.weights_bytes > 0
        assert lm.prefix_cache is None and lm.kv_settings is None
    finally:
        p.close()
    assert p.lm is None


def test_prompt_caches_are_picked_by_shared_prefix(pool: ModelPool) -> None:
    lm = pool.lm
    assert lm is not None
    pool.forget()
    a = list(range(100))
    b = [7] * 100
    ca = pool.cache_for(lm, a)
    ca.tokens = a[:]
    cb = pool.cache_for(lm, b)  # shares nothing with `a`: a cache of its own
    cb.tokens = b[:]
    assert cb is not ca
    assert pool.cache_for(lm, a[:MIN_SHARED + 5] + [999]) is ca  # a long shared prefix
    # Full: a stranger takes the least recently used cache (b's), not a's warm prefix.
    assert pool.cache_for(lm, [5] * 50) is cb
    assert pool.status()["prompt_caches"][0]["tokens"] == 100
    pool.forget()
    assert pool.caches == []


def test_chat_sessions_are_kept_least_recently_used_first(pool: ModelPool) -> None:
    pool.forget()
    s1, s2 = pool.session(1), pool.session(2)
    assert pool.session(1) is s1  # now the most recent
    pool.session(3)  # over the limit of 2: chat 2 goes
    assert list(pool.sessions) == [1, 3] and pool.session(1) is s1
    assert pool.session(2) is not s2
    pool.forget(1)
    assert 1 not in pool.sessions
    pool.forget()
    assert not pool.sessions


def test_prewarm_prefills_the_system_prompt_once(pool: ModelPool) -> None:
    lm = pool.lm
    assert lm is not None
    pool.forget()
    first = pool.prewarm(7, lm.manifest["name"], SYSTEM)
    assert first is not None and first["tokens"] > 10 and first["prefilled"] >= 1
    again = pool.prewarm(7, lm.manifest["name"], SYSTEM)
    assert again is not None and again["cached"] >= again["tokens"] - 1  # nothing to do
    assert pool.prewarm(7, "another-model", SYSTEM) is None
    # The chat's first message reuses the warmed prefix.
    session = pool.session(7)
    session.messages = [{"role": "system", "content": SYSTEM}]
    last = None
    for ev in session.send("Where is Paris?", SamplingParams(temperature=0.0), 4):
        last = ev
    assert last is not None and last.cached_tokens >= first["tokens"] - 1
    pool.forget()


def test_configure_applies_kv_settings_and_drops_old_caches(pool: ModelPool,
                                                            tmp_path: Path) -> None:
    lm = pool.lm
    assert lm is not None
    before = pool.settings
    pool.session(1)
    try:
        pool.configure(settings_from_options({"kv_mode": "exact", "kv_bits": 8}, tmp_path))
        assert not pool.sessions  # made under the old settings: gone
        assert lm.kv_settings is not None and (lm.kv_settings.mode, lm.kv_settings.bits) == (
            "exact", 8)
        assert lm.kv_settings.ssd_dir == tmp_path / "pages" / "sessions"
        session = pool.session(1)
        for _ in session.send("Hi", SamplingParams(temperature=0.0), 2):
            pass
        snap = pool.memory()
        assert snap.kv_ram_bytes is not None and snap.kv_ram_bytes == session.cache.nbytes
        assert snap.weights_bytes == pool.weights_bytes
        with pytest.raises(StrataError, match="KV mode 'fast' is unknown"):
            settings_from_options({"kv_mode": "fast"}, tmp_path)
        # The draft setting alone changes no KV: the chat's session and its KV stay.
        pool.configure(replace(pool.settings, draft="off"))
        assert pool.sessions.get(1) is session and pool.drafter(lm) == "off"
    finally:
        pool.configure(before)
    assert lm.kv_settings is None or lm.kv_settings == before.kv


def test_the_prefix_cache_follows_the_settings(pool: ModelPool) -> None:
    lm = pool.lm
    assert lm is not None and lm.prefix_cache is not None
    before = pool.settings
    try:
        pool.configure(PoolSettings(prefix_cache=False, prefix_dir=before.prefix_dir))
        assert lm.prefix_cache is None
        assert pool.memory().prefix_disk_reason == "prefix cache off in the settings"
        pool.configure(PoolSettings(prefix_mb=1.5, prefix_dir=before.prefix_dir))
        assert lm.prefix_cache is not None and lm.prefix_cache.settings.budget_mb == 1.5
        assert pool.clear_prefix()[0] >= 0
    finally:
        pool.configure(before)


def test_kv_settings_reach_caches_made_after_them(pool: ModelPool) -> None:
    lm = pool.lm
    assert lm is not None
    before = pool.settings
    try:
        pool.configure(PoolSettings(kv=KVSettings(mode="sparse", budget_tokens=1024),
                                    prefix_dir=before.prefix_dir))
        assert lm.paged and pool.session(2).cache.cache[0].__class__.__name__ == (
            "PagedLayerCache")
    finally:
        pool.configure(before)
    assert not lm.paged


def test_a_chat_reply_follows_the_callers_record_and_reuses_its_kv(pool: ModelPool) -> None:
    lm = pool.lm
    assert lm is not None
    pool.forget()
    greedy = SamplingParams(temperature=0.0)
    first = list(pool.reply(4, lm.manifest["name"], "What is the capital of France?",
                            params=greedy, max_tokens=8))
    answer = "".join(ev.text for ev in first)
    assert "Paris" in answer
    history = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": answer}]
    second = list(pool.reply(4, lm.manifest["name"], "And of Italy?", history=history,
                             params=greedy, max_tokens=8))
    # The second turn prefills only what is new: the first turn's tokens are still held.
    assert second[-1].cached_tokens >= first[-1].prompt_tokens
    assert pool.sessions[4].messages[:2] == history
    pool.forget()

"""The prefix cache in the paged KV modes (exact and sparse, 16, 8 and 4 bits) on the real
starter model and real files: a ~1,500-token system prompt prefilled in one mode is restored
into a fresh paged store, in this process and after a restart (the real command line), as
exactly the pages (and key summaries) the prefilling store held, in either paged mode, and
the greedy reply is the prefilling process's; a prompt that diverges reuses the pages before
the divergence; a corrupt or truncated record is refused and the answer stays the same; a
sliding-window model restores its windows into the paged mode's window caches; two processes
storing one prefix at once leave a store a third process restores from."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.kv import KVSettings, attention, prefix_restore
from engine.kv import store as kv_store
from engine.kv.prefix import PrefixCache, PrefixSettings
from engine.runtime import generate as generate_mod
from engine.runtime.generate import LoadedModel, PromptCache, generate
from engine.runtime.sampling import SamplingParams
from tests.helpers import run_strata

GREEDY = SamplingParams(temperature=0)
REPLY = 8
PAGE = 128  # the paged store's default page: the prefix cache follows it
# Sparse mode attends to 768 tokens per step (sinks 128, window 512, one selected page): the
# ~1,500-token prompt has 6 candidate pages, so the key summaries decide what is read.
BUDGET = 768
QUESTION = "Which ledgers mention the schooner?"
SHIPS = ["Marten", "Halcyon", "Bittern", "Osprey", "Kestrel", "Petrel", "Curlew", "Tern"]
CARGO = ["salt cod", "oak staves", "tar", "slate", "wool", "copper ore", "lamp oil", "rope"]


def _system(ledgers: int, start: int = 0) -> str:
    """A system prompt of natural text, about 32 tokens per ledger."""
    return "You are the archivist of a small maritime museum. " + " ".join(
        f"Ledger {i} of the harbour office records {CARGO[i % 8]} landed by the "
        f"{SHIPS[(3 * i) % 8]} in {1850 + i}, and notes that the pilot was paid "
        f"{5 + i % 7} shillings for the passage across the bar."
        for i in range(start, start + ledgers))


SYSTEM = _system(34)  # ~1,500 tokens with the template and the question


def _kv(mode: str, bits: int, tmp: Path) -> KVSettings:
    return KVSettings(mode=mode, bits=bits, budget_tokens=BUDGET, ssd_dir=tmp / "kv")


@contextmanager
def _paged(lm: LoadedModel, settings: KVSettings, folder: Path) -> Iterator[PrefixCache]:
    """The shared model in a paged mode with a prefix cache on `folder`, undone after."""
    old = lm.kv_settings
    lm.kv_settings = settings
    pc = lm.enable_prefix_cache(PrefixSettings(folder=folder, tails=False))
    try:
        yield pc
    finally:
        lm.disable_prefix_cache()
        lm.kv_settings = old


def _reply(lm: LoadedModel, ids: list[int], cache: PromptCache | None = None,
           n: int = REPLY, **kw: Any) -> tuple[list[int], str, Any]:
    tokens, text, last = [], [], None
    for ev in generate(lm, ids, GREEDY, n, prompt_cache=cache, **kw):
        text.append(ev.text)
        if ev.token is not None:
            tokens.append(ev.token)
        last = ev
    return tokens, "".join(text), last


def _same_pages(a: PromptCache, b: PromptCache, n_pages: int) -> None:
    """Every layer's pages [0, n_pages) hold the same encoded bytes and the same block
    summaries, what sparse selection reads."""
    sa, sb = a.cache[0].store, b.cache[0].store  # type: ignore[attr-defined]
    assert sa.codec == sb.codec
    for layer in range(sa.n_layers):
        for p in range(n_pages):
            pa, pb = sa.page_parts(layer, p), sb.page_parts(layer, p)
            for x, y in zip(pa[0] + pa[1], pb[0] + pb[1], strict=True):
                assert x.dtype == y.dtype and np.array_equal(x, y), (layer, p)
        ta, tb = sa.tables[layer], sb.tables[layer]
        nb = sa.P // ta.block_tokens
        assert ta.block_pages >= n_pages and tb.block_pages >= n_pages
        for x, y in zip(ta.block_summaries, tb.block_summaries, strict=True):
            assert mx.array_equal(x[:, :n_pages * nb], y[:, :n_pages * nb]).item(), layer


@dataclass
class Stored:
    """One bit width's system prompt, prefilled in sparse mode into `folder`, then restored
    into a fresh exact-mode store in this process."""

    bits: int
    system: str
    folder: Path
    ids: list[int]
    pages: int  # full pages stored (all but the last token's page)
    sparse: tuple[list[int], str]  # the prefilling process's reply
    exact: tuple[list[int], str]  # the reply of a restored exact-mode store


# 4 bits on a shorter prompt (~800 tokens, 6 pages): the suite's time goes to prefills.
@pytest.fixture(scope="module", params=[16, 8, 4])
def stored(request: pytest.FixtureRequest, starter_lm: LoadedModel,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stored]:
    bits = int(request.param)
    system = SYSTEM if bits != 4 else _system(16)
    tmp = tmp_path_factory.mktemp(f"paged-{bits}")
    folder = tmp / "px"
    ids = starter_lm.tokenizer.encode_chat([{"role": "system", "content": system},
                                            {"role": "user", "content": QUESTION}])
    pages = (len(ids) - 1) // PAGE
    with _paged(starter_lm, _kv("sparse", bits, tmp), folder) as pc:
        first = starter_lm.new_cache()
        tok_s, text_s, last = _reply(starter_lm, ids, first)
        assert last.cached_tokens == 0 and pc.stats.hits == 0
        pc.flush()
        assert pc.stats.pages_written == pages and not pc.stats.write_errors
    assert len(list(folder.glob("*.kvp"))) == 1
    with _paged(starter_lm, _kv("exact", bits, tmp), folder) as pc:
        again = starter_lm.new_cache()
        tok_e, text_e, last = _reply(starter_lm, ids, again)
        assert last.cached_tokens == pages * PAGE and pc.stats.hits == 1
        _same_pages(first, again, pages)
    first.close()
    again.close()
    yield Stored(bits, system, folder, ids, pages, (tok_s, text_s), (tok_e, text_e))


def test_page_bounds_over_ordered_bits_equal_the_float_extremes() -> None:
    """The restore's page bounds reduce float16 summaries as integers in the floats' order:
    the same extremes as float min and max over negatives, zeros, subnormals, infinities and
    values a bit apart, and the mapping undoes itself."""
    edge = np.array([-np.inf, -65504.0, -1.0, -6e-8, -0.0, 0.0, 6e-8, 1e-3, 1.0, 1.0009765625,
                     65504.0, np.inf], np.float16)
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.choice(edge, 4096), (rng.standard_normal(4096) * 3)
                        .astype(np.float16)]).reshape(64, 8, 16)
    bits = mx.array(x).view(mx.int16)
    assert np.array_equal(np.array(prefix_restore._ordered(prefix_restore._ordered(bits))),
                          x.view(np.int16))
    for red, f in ((mx.min, np.min), (mx.max, np.max)):
        got = np.array(prefix_restore._ordered(red(prefix_restore._ordered(bits), axis=1))
                       .view(mx.float16))
        assert np.array_equal(got, f(x, axis=1))


def test_a_restore_maps_the_stored_pages_and_copies_nothing(
        stored: Stored, starter_lm: LoadedModel, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A paged restore reads page headers and summaries only; the records stay in the run
    file, are never written to the session's SSD tier, and stay readable through the held
    descriptor after eviction removes the file (another process, or this one's budget).
    Each page's own key bound is its blocks' extreme, computed a few pages at a time while
    the restore reads on (chunks of 4 here, so that several meet)."""
    if stored.bits == 8:
        pytest.skip("one quantized width is enough for the mapping itself")
    monkeypatch.setattr(prefix_restore, "BOUND_CHUNK", 4)
    folder = tmp_path / "px"
    shutil.copytree(stored.folder, folder)
    with _paged(starter_lm, _kv("exact", stored.bits, tmp_path), folder) as pc:
        cache = starter_lm.new_cache()
        plan = pc.lookup(stored.ids)
        got = pc.restore(cache.cache, stored.ids, plan, 0)
        store = cache.cache[0].store  # type: ignore[attr-defined]
        assert got == stored.pages * PAGE
        for table in store.tables:
            bmin, bmax = table.block_summaries  # (heads, pages * blocks, dim)
            h, _, d = bmin.shape
            assert table.kmin.shape == (stored.pages, h, d)
            for got_b, blocks, f in ((table.kmin, bmin, mx.min), (table.kmax, bmax, mx.max)):
                want = f(blocks.reshape(h, stored.pages, -1, d).astype(mx.float32), axis=2)
                assert mx.array_equal(got_b, want.transpose(1, 0, 2).astype(got_b.dtype)).item()
        assert store.stats()["pages_mapped"] == stored.pages * store.n_layers
        assert store.stats()["pages_ram"] == 0 and store.counters["ssd_reads"] == 0
        # Shown as shared with the prefix cache, not as this session's SSD pages.
        assert store.stats()["bytes_shared"] == got // PAGE * store.n_layers * store.record_bytes
        assert store.stats()["bytes_ssd"] == 0
        assert pc.stats.bytes_read == stored.pages * (pc.page_head + pc.summary_bytes)
        for run in plan.runs:
            run.path.unlink()  # evicted meanwhile: the open descriptor still reads it
        cache.tokens[:] = stored.ids[:got]
        tokens, text, ev = _reply(starter_lm, stored.ids, cache)
        assert ev.cached_tokens == got and (tokens, text) == stored.exact
        stats = store.stats()
        assert stats["ssd_reads"] >= stored.pages * store.n_layers
        # Read once, kept in free RAM slots; written to the session's files: none of them.
        assert stats["pages_ram"] >= stored.pages * store.n_layers
        store.flush()
        assert store.counters["pages_written"] <= store.n_layers  # the reply's own page
        cache.close()


def test_a_restore_holds_the_prefilled_pages_and_answers_alike(stored: Stored) -> None:
    """(The fixture compared every page and summary of the two stores.) Both replies are
    whole; sparse mode's may differ from exact mode's (it reads 6 of its 12 pages)."""
    assert (len(stored.ids) > 1400 and stored.pages == 11) or stored.bits == 4
    assert len(stored.exact[0]) == len(stored.sparse[0]) == REPLY


@pytest.mark.parametrize("mode", ["sparse", "exact"])
def test_a_restarted_process_reuses_the_pages_in_either_mode(stored: Stored, mode: str,
                                                             starter: Any, strata_home: Path
                                                             ) -> None:
    if stored.bits == 4 and mode == "exact":
        pytest.skip("4 bits: one restart (sparse) is enough; exact restores in process")
    args = ["generate", "--model", starter["name"], "--kv-mode", mode, "--kv-bits",
            str(stored.bits), "--system", stored.system, "--prompt", QUESTION, "--temp", "0",
            "--max-tokens", str(REPLY), "--json", "--timeline"]
    if mode == "sparse":
        args += ["--kv-budget", str(BUDGET)]
    r = run_strata(*args, home=strata_home, timeout=300,
                   env={"STRATA_PREFIX_DIR": str(stored.folder),
                        "STRATA_PREFIX_TAILS": "0"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"] == len(stored.ids)
    assert out["cached_tokens"] == stored.pages * PAGE
    assert "cache restore" in r.stderr
    assert out["text"] == (stored.sparse if mode == "sparse" else stored.exact)[1]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_record_is_refused_and_the_answer_is_unchanged(
        stored: Stored, damage: str, starter_lm: LoadedModel, tmp_path: Path) -> None:
    if stored.bits == 4 and damage == "truncate":
        pytest.skip("truncation does not depend on the page encoding")
    folder = tmp_path / "px"
    shutil.copytree(stored.folder, folder)
    with _paged(starter_lm, _kv("exact", stored.bits, tmp_path), folder) as pc:
        plan = pc.lookup(stored.ids)
        assert plan.hit_pages == stored.pages and len(plan.runs) == 1
        run = plan.runs[0]
        last = run.offset(stored.pages - 1, pc.page_bytes)
        if damage == "flip":
            data = bytearray(run.path.read_bytes())
            data[last + pc.page_head + 5 * pc.layer_bytes + 999] ^= 0x10  # a value of layer 5
            run.path.write_bytes(bytes(data))
        else:
            with open(run.path, "r+b") as f:
                f.truncate(last + pc.page_bytes // 2)
        tokens, text, ev = _reply(starter_lm, stored.ids)
        assert ev.cached_tokens == (stored.pages - 1) * PAGE
        assert pc.stats.corrupt_pages == (damage == "flip")
        assert (tokens, text) == stored.exact
        pc.flush()  # the page it prefilled again is stored again
        assert pc.lookup(stored.ids).hit_pages == stored.pages


def test_a_prompt_that_diverges_reuses_the_pages_before(starter_lm: LoadedModel,
                                                        tmp_path: Path) -> None:
    # The same first 6 ledgers, then others: about 2.2 pages shared; b has 5 pages.
    a, b = (starter_lm.tokenizer.encode_chat([{"role": "system", "content": _system(6)
                                               + _system(n, start)},
                                              {"role": "user", "content": QUESTION}])
            for start, n in ((20, 2), (30, 8)))
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert 2 * PAGE < shared < 3 * PAGE and len(b) > 4 * PAGE
    with _paged(starter_lm, _kv("exact", 16, tmp_path), tmp_path / "px") as pc:
        want = _reply(starter_lm, b, prefix_cache=False)
        _reply(starter_lm, a)
        pc.flush()
        got = _reply(starter_lm, b)
        assert got[2].cached_tokens == shared // PAGE * PAGE
        assert got[:2] == want[:2]
        pc.flush()
        # b's own pages went to a second run that continues a's shared pages (not copied).
        plan_a, plan_b = pc.lookup(a), pc.lookup(b)
        assert plan_a.hit_pages == (len(a) - 1) // PAGE
        assert plan_b.hit_pages == (len(b) - 1) // PAGE
        assert len(plan_b.runs) == 2 and plan_b.runs[1].first == shared // PAGE


def test_a_sliding_window_model_restores_its_windows_in_paged_mode(tmp_path: Path) -> None:
    from tests.engine.kv.test_layouts import PAGE as LPAGE
    from tests.engine.kv.test_layouts import settings, write_folder

    lm = LoadedModel.load(write_folder(tmp_path / "gemma3", "gemma3_text"))
    prompt = [int(x) for x in np.random.default_rng(2).integers(3, 300, 1100)]
    plain = _reply(lm, prompt, prefix_cache=False)[0]
    for bits in (16, 8):
        lm.kv_settings = settings(tmp_path / "kv", bits=bits)
        lm.enable_prefix_cache(PrefixSettings(folder=tmp_path / f"px{bits}", tails=False))
        assert lm.prefix_cache is not None and lm.prefix_cache.P == LPAGE
        first, _, ev1 = _reply(lm, prompt)
        lm.prefix_cache.flush()
        assert sorted(p.suffix for p in (tmp_path / f"px{bits}").iterdir()
                      if p.name != "labels.json" and not p.name.startswith("pages.db")
                      ) == [".kvp", ".kvw"]
        cache = lm.new_cache()
        second, _, ev2 = _reply(lm, prompt, cache)
        assert ev1.cached_tokens == 0 and ev2.cached_tokens == (len(prompt) - 1) // LPAGE * LPAGE
        assert second == first
        # 1 MB of RAM holds 56 of the 68 restored pages per layer: the rest went to the SSD
        # tier as the restore committed them, and attention read them back.
        st = cache.cache[1].store  # type: ignore[attr-defined]
        assert st.max_slots < st.tables[0].n_pages
        assert st.counters["evictions"] > 0 and st.counters["ssd_reads"] > 0
        cache.close()
        if bits == 16:
            assert first == plain
        lm.disable_prefix_cache()


def test_the_key_separates_encodings_not_modes(stored: Stored, starter_lm: LoadedModel,
                                               tmp_path: Path) -> None:
    """16-bit pages are one layout in every mode (mlx-lm's cache restores what a paged
    mode stored); 8 and 4 bits are keyed by bits and group, and mlx-lm's cache (16-bit only)
    never finds them."""
    keys = set()
    old = starter_lm.kv_settings
    try:
        for mode in ("exact", "sparse"):
            for group in (32, 64):
                starter_lm.kv_settings = KVSettings(mode=mode, bits=stored.bits,
                                                    group_size=group)
                keys.add(starter_lm.prefix_key())
        starter_lm.kv_settings = None
        keys.add(starter_lm.prefix_key())
    finally:
        starter_lm.kv_settings = old
    assert len(keys) == (1 if stored.bits == 16 else 3)
    folder = tmp_path / "px"
    shutil.copytree(stored.folder, folder)
    pc = starter_lm.enable_prefix_cache(PrefixSettings(folder=folder, tails=False))
    try:
        if stored.bits != 16:
            assert pc.lookup(stored.ids).hit_pages == 0
            return
        _, _, ev = _reply(starter_lm, stored.ids)
        assert ev.cached_tokens == stored.pages * PAGE and pc.stats.hits == 1
    finally:
        starter_lm.disable_prefix_cache()


def test_two_processes_storing_one_prefix_at_once_leave_one_usable_store(
        starter: Any, strata_home: Path, tmp_path: Path) -> None:
    # Two real sessions in sparse mode, started together over one empty folder, each
    # prefilling the same system prompt; a third process then finds those pages.
    from concurrent.futures import ThreadPoolExecutor

    from engine.kv.prefix import folder_summary

    folder = tmp_path / "px"
    system = _system(12)  # ~500 tokens: 3 full pages

    def ask(question: str) -> dict[str, Any]:
        r = run_strata("generate", "--model", starter["name"], "--kv-mode", "sparse",
                       "--kv-budget", str(BUDGET), "--system", system, "--prompt", question,
                       "--temp", "0", "--max-tokens", "4", "--json", home=strata_home,
                       timeout=300, env={"STRATA_PREFIX_DIR": str(folder)})
        assert r.returncode == 0, r.stderr[-2000:]
        return dict(json.loads(r.stdout))

    with ThreadPoolExecutor(2) as pool:
        first = list(pool.map(ask, [QUESTION, "Who paid the pilot?"]))
    assert all(out["cached_tokens"] == 0 for out in first)
    assert not list(folder.glob(".tmp-*"))  # every write finished or was cleaned up
    summary = folder_summary(folder)
    assert summary["runs"] >= 1 and summary["stale_files"] == 0
    third = ask("What did the Osprey land?")
    assert third["cached_tokens"] >= 3 * PAGE


def test_sparse_mode_keeps_in_ram_only_the_pages_a_second_step_reads(
        stored: Stored, starter_lm: LoadedModel, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The RAM tier's admission in sparse mode (engine.kv.store, REUSE_ADMISSION): after a
    restore, the stored pages the question's one step reads (its rescoring shortlist, its
    chosen blocks) are read for that step and let go, where the old rule (every page read
    kept while a slot is free) keeps them all; the reply's next steps read them again and
    keep them. The reply is the old rule's. The question is one sparse step without votes,
    as past SPARSE_PREFILL_PAST and VOTE_PAST_MAX (16k) after a restore: both are lowered
    below the ~1,400 restored tokens, and the question is the 40 tokens after them. (The
    rule counts reads: a chunk that votes reads every page once more.)"""
    if stored.bits == 8:
        pytest.skip("the rule does not depend on the encoding: 16 and 4 bits")
    monkeypatch.setattr(attention, "SPARSE_PREFILL_PAST", 4 * PAGE)
    monkeypatch.setattr(generate_mod, "SPARSE_PREFILL_PAST", 4 * PAGE)
    monkeypatch.setattr(attention, "VOTE_PAST_MAX", 4 * PAGE)
    folder = tmp_path / "px"
    shutil.copytree(stored.folder, folder)
    ids = stored.ids[:stored.pages * PAGE + 40]  # one chunk after the stored pages

    def mapped_in_ram(cache: PromptCache) -> int:
        store = cache.cache[0].store  # type: ignore[attr-defined]
        return sum(int((t.slot_of[:stored.pages] >= 0).sum()) for t in store.tables)

    kept: dict[bool, tuple[int, int]] = {}
    replies: dict[bool, tuple[list[int], str]] = {}
    for reuse in (True, False):
        monkeypatch.setattr(kv_store, "REUSE_ADMISSION", reuse)
        with _paged(starter_lm, _kv("sparse", stored.bits, tmp_path / f"kv-{reuse}"), folder):
            one = starter_lm.new_cache()
            tokens, _, ev = _reply(starter_lm, ids, one, 1)
            assert ev.cached_tokens == stored.pages * PAGE and len(tokens) == 1
            store = one.cache[0].store  # type: ignore[attr-defined]
            assert store.counters["ssd_reads"] > 0
            after_one = mapped_in_ram(one)
            one.close()
            whole = starter_lm.new_cache()
            tokens, text, ev = _reply(starter_lm, ids, whole)
            assert len(tokens) == REPLY
            replies[reuse] = tokens, text
            kept[reuse] = (after_one, mapped_in_ram(whole))
            whole.close()
    assert replies[True] == replies[False]
    # One step: nothing of what it read stays (the old rule kept all of it).
    assert kept[True][0] == 0 < kept[False][0]
    # A reply: what the steps read again is kept (here every step reads every page).
    assert 0 < kept[True][1] <= kept[False][1]

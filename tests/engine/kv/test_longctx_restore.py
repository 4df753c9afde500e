"""Sparse mode's question votes survive a restore (issue 19): a prompt stored whole (pages and
tail, with its logits and votes) by one prefill is restored into a fresh paged store with the
tail's votes and no forward pass; a tail without votes (rewritten without them) makes the
restore prefill the prompt's last VOTE_QUERIES + 1 tokens again. Either way the votes equal
the fresh prefill's and the greedy reply is the same, on the real starter model and real
files; a prompt within its budget (the contiguous buffer) records the same votes."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.kv import KVSettings, attention
from engine.kv.prefix import PrefixCache, PrefixSettings
from engine.kv.tail import read_tail, write_tail
from engine.runtime.generate import LoadedModel, PromptCache, generate
from engine.runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)
REPLY = 6
PAGE = 128
BUDGET = 640 + 64  # sinks 128, window 512, 8 blocks chosen (4 voted) among 3-4 pages
QUESTION = "Which ledger records the copper ore, and what was the pilot paid?"
SHIPS = ["Marten", "Halcyon", "Bittern", "Osprey", "Kestrel", "Petrel", "Curlew", "Tern"]
CARGO = ["salt cod", "oak staves", "tar", "slate", "wool", "copper ore", "lamp oil", "rope"]


def _system(ledgers: int) -> str:
    return "You are the archivist of a small maritime museum. " + " ".join(
        f"Ledger {i} of the harbour office records {CARGO[i % 8]} landed by the "
        f"{SHIPS[(3 * i) % 8]} in {1850 + i}, and notes that the pilot was paid "
        f"{5 + i % 7} shillings for the passage across the bar." for i in range(ledgers))


@contextmanager
def _sparse(lm: LoadedModel, folder: Path, tmp: Path, budget: int = BUDGET
            ) -> Iterator[PrefixCache]:
    old = lm.kv_settings
    lm.kv_settings = KVSettings(mode="sparse", budget_tokens=budget, ssd_dir=tmp / "kv")
    pc = lm.enable_prefix_cache(PrefixSettings(folder=folder, tails=True))
    try:
        yield pc
    finally:
        lm.disable_prefix_cache()
        lm.kv_settings = old


def _reply(lm: LoadedModel, ids: list[int], cache: PromptCache) -> tuple[list[int], Any]:
    tokens, last = [], None
    for ev in generate(lm, ids, GREEDY, REPLY, prompt_cache=cache):
        if ev.token is not None:
            tokens.append(ev.token)
        last = ev
    return tokens, last


def _votes(cache: PromptCache) -> list[np.ndarray]:
    store = cache.cache[0].store  # type: ignore[attr-defined]
    out = []
    for t in store.tables:
        assert t.votes is not None, "no question votes"
        out.append(np.array(t.votes))
    return out


def test_a_restored_prompt_votes_and_answers_as_a_fresh_prefill(starter_lm: LoadedModel,
                                                                tmp_path: Path) -> None:
    ids: list[int] = []
    for ledgers in range(24, 40):  # a tail of at least VOTE_QUERIES + 2 tokens after the pages
        ids = starter_lm.tokenizer.encode_chat([
            {"role": "system", "content": _system(ledgers)},
            {"role": "user", "content": QUESTION}])
        if len(ids) % PAGE > attention.VOTE_QUERIES + 1:
            break
    keep = attention.VOTE_QUERIES + 1
    assert len(ids) > 900 and len(ids) % PAGE > keep
    folder = tmp_path / "px"
    with _sparse(starter_lm, folder, tmp_path / "a") as pc:
        fresh = starter_lm.new_cache()
        tok_f, last = _reply(starter_lm, ids, fresh)
        assert last.cached_tokens == 0
        votes_f = _votes(fresh)
        pc.flush()
        assert pc.stats.pages_written == len(ids) // PAGE
    assert list(folder.glob("*.kvt")), "the tail was stored"
    # Within its budget the prompt is prefilled into the contiguous buffer: the same votes.
    with _sparse(starter_lm, tmp_path / "px-wide", tmp_path / "w", budget=4096) as pc:
        wide = starter_lm.new_cache()
        _reply(starter_lm, ids, wide)
        pc.flush()
        assert wide.cache[0].contig is not None  # type: ignore[attr-defined]
        for a, b in zip(votes_f, _votes(wide), strict=True):
            assert a.shape == b.shape and np.abs(a - b).max() < 1e-3 * max(1.0, np.abs(a).max())
        wide.close()
    # Restored whole within the budget (no prefill left: under half of it), the votes too.
    with _sparse(starter_lm, tmp_path / "px-wide", tmp_path / "w2", budget=4096):
        wide = starter_lm.new_cache()
        _, last = _reply(starter_lm, ids, wide)
        assert last.cached_tokens == len(ids)
        for a, b in zip(votes_f, _votes(wide), strict=True):
            assert np.abs(a - b).max() < 1e-3 * max(1.0, np.abs(a).max())
        wide.close()
    for run, with_votes in (("b", True), ("c", False)):
        with _sparse(starter_lm, folder, tmp_path / run) as pc:
            if not with_votes:  # the same record without its votes (as an older writer's)
                (path,) = folder.glob("*.kvt")
                at = struct.calcsize("<8sHIIIIIIII")  # the header's parent chain hash
                parent = path.read_bytes()[at:at + 32]
                tail = read_tail(path, parent, len(ids) // PAGE, pc.tail_layout)
                assert tail is not None and tail.votes is not None
                tail.votes = None
                write_tail(folder, path.name, tail, parent, pc.tail_layout)
            again = starter_lm.new_cache()
            tok_r, last = _reply(starter_lm, ids, again)
            votes_r = _votes(again)
        store = again.cache[0].store  # type: ignore[attr-defined]
        assert store.tables[0].votes_at == len(ids) - 1
        for a, b in zip(votes_f, votes_r, strict=True):
            assert a.shape == b.shape and np.abs(a - b).max() < 1e-3 * max(1.0, np.abs(a).max())
        assert tok_r == tok_f and len(tok_f) == REPLY
        # With the votes: the whole prompt restored, no forward pass before the first token.
        # Without: pages and most of the tail, the question's last tokens prefilled again.
        assert last.cached_tokens == (len(ids) if with_votes else len(ids) - keep)
        again.close()
    fresh.close()
    mx.clear_cache()

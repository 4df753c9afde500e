"""Sparse selection that holds on natural text (issue 19): blocks chosen by their true
largest logit among the bound's best, where the box bound alone ranks decoys first; the
question's votes keeping what the prompt's last chunk attended to; the same blocks chosen
whether the pages are in RAM or on the SSD."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.kv import KVSettings, attention
from engine.kv.cache import PagedLayerCache
from engine.kv.store import KVStore

H, D, P = 1, 16, 8


def _decode_over_decoys(tmp_path: Path, question: bool = False) -> float:
    """One decode step over pages: a sink, three decoy blocks (each key large in one other
    dimension: box bound 8a, true logit a), the block that matters (every key q.k = 3a, value
    1), three empty blocks, the window. The budget chooses 2 blocks of the 7 candidates.
    Returns the output (1 when all weight is on the block that matters). `question`: the
    pages come as one prefill chunk attended by queries of ones (which record the votes)."""
    import mlx.core as mx

    s = KVSettings(mode="sparse", page_tokens=P, ssd_dir=tmp_path / "kv", sink_tokens=P,
                   window_tokens=P, budget_tokens=4 * P).validate()
    store = KVStore(s, n_layers=1, kv_heads=H, head_dim=D)
    a = 3.0
    zero = mx.zeros((1, H, P, D))
    decoy = a * mx.eye(P, D)[None, None]                              # key i: a * e_i
    hot = mx.full((1, H, P, D), 3 * a / D)                            # q.k = 3a for q = 1
    keys = [zero, decoy, decoy, decoy, hot, zero, zero, zero, zero]
    vals = [zero, zero, zero, zero, mx.ones((1, H, P, D)), zero, zero, zero, zero]
    cache = PagedLayerCache(store, 0)
    k, v = cache.update_and_fetch(mx.concatenate(keys, axis=2), mx.concatenate(vals, axis=2))
    if question:
        mx.eval(attention.attend(cache, mx.ones((1, H, k.shape[2], D)), k, v, 1.0))
    z = mx.zeros((1, H, 1, D))
    k, v = cache.update_and_fetch(z, z)
    out = attention.attend(cache, mx.ones((1, H, 1, D)), k, v, 1.0)
    store.close()
    return float(out.mean())


def test_true_logits_find_the_block_the_bound_ranks_last(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Exact attention puts ~0.99 of the weight on the hot block (logit 9 against 3 and 0).
    monkeypatch.setattr(attention, "RESCORE", 4)  # STRATA_SPARSE_RESCORE=4
    assert _decode_over_decoys(tmp_path) > 0.95


def test_the_bound_alone_chooses_the_decoys(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the rescoring exists: by the bound alone the two chosen blocks are decoys."""
    monkeypatch.setattr(attention, "RESCORE", 1)
    assert _decode_over_decoys(tmp_path) < 0.05


def test_question_votes_keep_a_block_the_bound_drops(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The same pages, the bound alone (RESCORE 1), but the prompt's last chunk (queries of
    ones, prefilled exactly) put its weight on the block that matters: its votes keep that
    block for the reply, and the decode step's output is that block's value."""
    monkeypatch.setattr(attention, "RESCORE", 1)
    monkeypatch.setattr(attention, "FIRST_EXACT", False)  # the step itself stays sparse
    monkeypatch.setattr(attention, "VOTE_SHARE", 0.5)     # 1 of the 2 chosen blocks voted
    assert _decode_over_decoys(tmp_path, question=True) > 0.95
    monkeypatch.setattr(attention, "VOTE_SHARE", 0.0)
    assert _decode_over_decoys(tmp_path / "off", question=True) < 0.05


# -- tiers --------------------------------------------------------------------------------
TP, TH, TD, REP = 16, 2, 16, 3


def _tier_run(tmp_path: Path, slots: int | None) -> tuple[KVStore, list[Any], Any]:
    """Prefill chunks, then decode steps, through one layer of a store whose RAM tier holds
    `slots` pages (None: all); the last step's queries and recent max are returned too."""
    import mlx.core as mx

    s = KVSettings(mode="sparse", page_tokens=TP, ssd_dir=tmp_path / "kv", sink_tokens=TP,
                   window_tokens=TP, budget_tokens=2 * TP + 6 * 8).validate()
    store = KVStore(s, n_layers=1, kv_heads=TH, head_dim=TD)
    if slots is not None:
        store.max_slots = slots
    mx.random.seed(7)
    cache = PagedLayerCache(store, 0)
    outs = []
    for n in [200, 300, 150, 1, 1, 1]:
        # Keys of uneven scale per dimension: the box bound and the true logits disagree.
        k = mx.random.normal((1, TH, n, TD)) * mx.linspace(0.2, 3.0, TD)
        v = mx.random.normal((1, TH, n, TD))
        q = mx.random.normal((1, TH * REP, n, TD))
        k2, v2 = cache.update_and_fetch(k, v)
        outs.append(attention.attend(cache, q, k2, v2, TD ** -0.5))
        mx.eval(outs[-1])
    return store, outs, (q * TD ** -0.5).reshape(TH, REP, TD)


@pytest.mark.parametrize("slots", [5, 24])
def test_same_blocks_from_ram_and_from_the_ssd(tmp_path: Path, slots: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Rescoring, votes and the page narrowing choose the same blocks with every page in RAM
    and with most on the SSD (the shortlist's keys read through the store: for the step only
    with 5 slots, brought into RAM with 24), so the answer does not depend on the tier."""
    import mlx.core as mx

    monkeypatch.setattr(attention, "RESCORE", 4)
    monkeypatch.setattr(attention, "VOTE_SHARE", 0.5)
    monkeypatch.setattr(attention, "FIRST_EXACT", True)
    hot, ref, q = _tier_run(tmp_path / "hot", None)
    cold, outs, _ = _tier_run(tmp_path / "cold", slots)
    for a, b in zip(ref, outs, strict=True):
        assert float(mx.abs(a - b).max()) < 1e-5
    n = hot.tables[0].n_pages
    assert cold.tables[0].n_resident < n and cold.stats()["ssd_reads"] > 0
    # The votes came from the keys, wherever they lived.
    assert float(mx.abs(hot.tables[0].votes - cold.tables[0].votes).max()) < 1e-6
    acc = (mx.zeros((TH, REP)), None, None)
    chosen = []
    for store in (hot, cold):
        got = attention.select_blocks(store, 0, q, n, acc, start=10 ** 9)
        assert got is not None
        chosen.append(np.sort(np.array(got[0]), axis=-1))
    assert (chosen[0] == chosen[1]).all()
    # And rescoring ran on the cold store: the bound alone chooses otherwise.
    monkeypatch.setattr(attention, "RESCORE", 1)
    got = attention.select_blocks(cold, 0, q, n, acc, start=10 ** 9)
    assert got is not None and not (np.sort(np.array(got[0]), axis=-1) == chosen[1]).all()
    for store in (hot, cold):
        store.close()


def _step_reads(tmp_path: Path, mode: str) -> tuple[int, int, Any]:
    """One decode step after the prefill chunks of `_tier_run`'s shape, through a store whose
    RAM tier holds 5 pages: (pages read off the SSD by that step, pages not in RAM before
    it, its output)."""
    import mlx.core as mx

    s = KVSettings(mode=mode, page_tokens=TP, ssd_dir=tmp_path / "kv", sink_tokens=TP,
                   window_tokens=TP, budget_tokens=2 * TP + 6 * 8).validate()
    store = KVStore(s, n_layers=1, kv_heads=TH, head_dim=TD)
    store.max_slots = 5
    mx.random.seed(7)
    cache = PagedLayerCache(store, 0)
    for n in [200, 300, 150, 1]:
        k = mx.random.normal((1, TH, n, TD)) * mx.linspace(0.2, 3.0, TD)
        v = mx.random.normal((1, TH, n, TD))
        q = mx.random.normal((1, TH * REP, n, TD))
        k2, v2 = cache.update_and_fetch(k, v)
        if n == 1:
            store.flush()
            cold = store.tables[0].n_pages - store.tables[0].n_resident
            before = store.stats()["ssd_reads"]
        out = attention.attend(cache, q, k2, v2, TD ** -0.5)
        mx.eval(out)
    reads = store.stats()["ssd_reads"] - before
    store.close()
    return reads, cold, out


def test_a_sparse_step_reads_each_page_once(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A shortlist as large as the candidates (RESCORE 40: every candidate page read for its
    keys, RAM holding 5 pages): the step attends its chosen blocks from the pages it read
    for the rescoring rather than reading them again, so it reads at most the pages exact
    mode reads (each cold page once), and gives the same output as with every page in RAM."""
    import mlx.core as mx

    monkeypatch.setattr(attention, "RESCORE", 40)
    monkeypatch.setattr(attention, "RESCORE_CAP", 0.0)  # no cap: the shortlist is all
    monkeypatch.setattr(attention, "VOTE_SHARE", 0.5)
    monkeypatch.setattr(attention, "FIRST_EXACT", False)
    sparse, cold, out = _step_reads(tmp_path / "sparse", "sparse")
    exact, cold_exact, _ = _step_reads(tmp_path / "exact", "exact")
    assert exact == cold_exact == cold > 20  # exact reads every page off the RAM tier once
    assert 0 < sparse <= exact
    _, ref, _ = _tier_run(tmp_path / "hot", None)
    assert float(mx.abs(ref[3] - out).max()) < 1e-5

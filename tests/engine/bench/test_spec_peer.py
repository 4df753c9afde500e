"""mlx-lm's own speculative path, the reference `strata bench spec` runs beside Strata's
drafters: with the starter drafting for itself it gives the plain greedy text, as Strata's
draft-model path does on the same prompt, and its run reports what it kept."""

from __future__ import annotations

from engine.bench.spec import PEER_DRAFT_TOKENS, Task, peer_run
from engine.runtime.generate import LoadedModel
from engine.runtime.speculative import ModelDrafter
from tests.engine.runtime.spec_fixtures import copy_prompt, plain, run


def test_mlx_lm_speculative_path_agrees_with_plain_and_with_strata_s_draft_model(
        starter_lm: LoadedModel) -> None:
    ids = copy_prompt(starter_lm)
    n = 32
    reference = plain(starter_lm, ids, n)
    task = Task("copy", "edit", ids)
    tps, toks, drafted, kept = peer_run(starter_lm, task, n, draft=starter_lm)
    assert toks == reference
    # The target drafting for itself: nearly every draft is kept, and each step drafts some.
    assert kept >= n // 2 and drafted >= kept and tps > 0
    assert drafted <= PEER_DRAFT_TOKENS * n
    _, plain_toks, no_drafts, none_kept = peer_run(starter_lm, task, n)
    assert plain_toks == reference and no_drafts == none_kept == 0
    drafter = ModelDrafter(starter_lm, starter_lm)
    try:
        ours, last = run(starter_lm, ids, drafter, n)
    finally:
        drafter.close()
    assert ours == toks and last.accepted_tokens > 0

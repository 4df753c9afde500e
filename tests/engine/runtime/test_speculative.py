"""Speculative decoding on the real starter model: greedy text identical to plain decoding
(prompt lookup over 256 tokens, a draft model over 64, in mlx-lm's cache and in paged exact
mode), sampled text with the target's distribution, a draft model of another vocabulary
refused, cancel mid-reply."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.kv import KVSettings
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.sampling import Sampler, SamplingParams
from engine.runtime.speculative import (
    HELD,
    PRIOR_ACCEPT,
    RECHECK_EVERY,
    VERIFY_BLAS_THREADS,
    DraftModels,
    DraftRefused,
    LookupDrafter,
    ModelDrafter,
    Speculator,
    StepCosts,
    costs_of,
)
from engine.telemetry import GenerationEvent
from tests.engine.runtime.spec_fixtures import GREEDY, copy_prompt, plain, run


@pytest.fixture(scope="module")
def copy_ids(starter_lm: LoadedModel) -> list[int]:
    return copy_prompt(starter_lm)


@pytest.fixture
def exact(starter_lm: LoadedModel) -> Iterator[LoadedModel]:
    old = starter_lm.kv_settings
    starter_lm.kv_settings = KVSettings(mode="exact", page_tokens=32)
    try:
        yield starter_lm
    finally:
        starter_lm.kv_settings = old


def test_lookup_proposes_what_followed_the_last_match() -> None:
    d = LookupDrafter(min_n=2, max_n=3)
    assert d.propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]
    assert d.propose([1, 2, 3, 4, 5, 9, 2, 3, 4], 8) == [5, 9, 2, 3, 4]  # up to the end
    assert d.propose([7, 8, 9], 4) == []  # another history: indexed again, no match
    # After [.., 8, 9] a match needs an earlier 9 followed by something: none yet.
    assert not d.may_propose([7, 8, 9])
    assert d.may_propose([7, 8, 9, 1, 9])


def _latest_by_hand(seq: list[int], lo: int, hi: int) -> int | None:
    """The end of the latest earlier occurrence of seq's last n tokens (ending before its
    last position), n from hi down to lo: the lookup's rule, one slice at a time."""
    h = len(seq)
    for n in range(hi, lo - 1, -1):
        if h < n:
            continue
        for end in range(h - 1, n - 1, -1):
            if seq[end - n:end] == seq[h - n:]:
                return end
    return None


def test_lookup_search_equals_the_rule_by_hand() -> None:
    """The vectorized search against the rule written out: random histories over small
    vocabularies (many overlapping matches), each grown token by token through one drafter,
    with a new prompt and a history one token shorter now and then."""
    import random

    rng = random.Random(5)
    checked = 0
    for _ in range(300):
        lo = rng.choice([1, 2, 3])
        hi = lo + rng.choice([0, 1, 3, 5])
        vocab = rng.choice([2, 3, 5, 40])
        d = LookupDrafter(min_n=lo, max_n=hi)
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        for _ in range(20):
            if rng.random() < 0.1:
                seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
            seq = seq + [rng.randrange(vocab)]
            if rng.random() < 0.2:
                d.may_propose(seq[:-1])  # as generate asks after the first token
            want = _latest_by_hand(seq, lo, hi) if len(seq) > lo else None
            got = d.propose(seq, 4)
            if not got or d.held(seq) == 0:  # a fresh search's draft, not a followed copy
                assert got == ([] if want is None else seq[want:want + 4]), (seq, lo, hi)
                checked += 1
            assert d.may_propose(seq) == (
                _latest_by_hand(seq, lo - 1, lo - 1) is not None if lo > 1 else True)
    assert checked > 1000


def test_lookup_follows_the_copy_it_drafted_from() -> None:
    # The 2-gram (4, 5) last occurs before 7, but the copy being followed (the first line,
    # picked by its 2-gram (1, 2)) goes on with 6.
    d = LookupDrafter(min_n=2, max_n=2)
    src = [1, 2, 3, 4, 5, 6, 9, 4, 5, 7, 9]
    assert d.propose([*src, 1, 2], 2) == [3, 4]
    assert d.propose([*src, 1, 2, 3, 4, 5], 3) == [6, 9, 4]
    # The reply left the copy (8 instead of 6): a fresh search, the latest match (the reply).
    assert d.propose([*src, 1, 2, 3, 4, 5, 8, 4, 5], 1) == [8]


def test_verify_passes_move_to_the_other_thread_count_when_a_recheck_is_faster() -> None:
    """The calibration's choice of BLAS threads is rechecked every RECHECK_EVERY verify
    passes: a faster figure on the other count moves the passes there (its timings with it),
    a slower one doubles the interval."""
    own = VERIFY_BLAS_THREADS + 1  # the process's own count, not the verify passes'
    c = StepCosts(seconds={1: 0.05, 9: 0.20}, threads=VERIFY_BLAS_THREADS)
    picks = [c.verify_threads(own) for _ in range(RECHECK_EVERY)]
    assert picks[:-1] == [(VERIFY_BLAS_THREADS, False)] * (RECHECK_EVERY - 1)
    assert picks[-1] == (0, True)  # the process's own count, once
    c.add_other(9, 0.25)  # slower there: stay, recheck half as often
    assert c.threads == VERIFY_BLAS_THREADS and c.recheck_every == 2 * RECHECK_EVERY
    for _ in range(2 * RECHECK_EVERY - 1):
        assert c.verify_threads(own) == (VERIFY_BLAS_THREADS, False)
    assert c.verify_threads(own) == (0, True)
    c.add_other(9, 0.05)  # a running figure (0.19 s): one fast pass does not undo a slow one
    assert c.threads == VERIFY_BLAS_THREADS and c.recheck_every == 4 * RECHECK_EVERY
    c.add_other(9, 0.05)  # 0.148 s, under 0.85 x 0.20: move
    assert c.threads == 0 and c.recheck_every == RECHECK_EVERY
    assert c.seconds[1] == 0.05 and c.seconds[9] < 0.17 and c.other == {9: 0.20}
    # The other count is now the calibration's: rechecked the same way, back if faster.
    for _ in range(RECHECK_EVERY - 1):
        c.verify_threads(own)
    assert c.verify_threads(own) == (VERIFY_BLAS_THREADS, True)
    # No recheck where the counts are the same or OpenBLAS is not ours.
    assert StepCosts().verify_threads(None) == (VERIFY_BLAS_THREADS, False)
    assert StepCosts().verify_threads(VERIFY_BLAS_THREADS) == (VERIFY_BLAS_THREADS, False)


class _NoCache:
    """A speculator's cache view that no step reads (only its decisions are tested)."""

    cache: list[Any] = []
    tokens: list[int] = []


def test_a_followed_copy_and_a_fresh_match_are_priced_apart(starter_lm: LoadedModel) -> None:
    """A summary's fresh n-gram matches fail once it paraphrases while the copies it quotes
    hold: the speculator keeps one acceptance for each, and stops drafting on fresh matches
    alone once they fail."""
    d = LookupDrafter(min_n=2, max_n=2)
    src = [1, 2, 3, 4, 5, 6, 9]
    spec = Speculator(starter_lm, d, Sampler(GREEDY), _NoCache(), lambda x: x, {},
                      forced=False)
    assert d.propose([*src, 1, 2], 2) == [3, 4]
    assert spec.kind([*src, 1, 2, 3]) == "young"  # the copy goes on, one token held so far
    assert spec.kind([*src, 1, 2, 3, 7]) == "fresh"  # it left the copy: a fresh search next
    spec.costs = StepCosts({1: 0.05, 2: 0.055, 3: 0.06, 5: 0.07, 9: 0.09, 17: 0.13})
    spec.acceptance["follow"] = [9.0, 10.0]
    spec.acceptance["young"] = [1.0, 4.0]
    spec.acceptance["fresh"] = [0.5, 5.0]
    young = spec.best_k(16, "young")  # the last kind() call held no copy: its rate alone
    assert spec.best_k(16, "fresh") == 0
    # A copy that has held for HELD tokens is priced by the long copies' rate, and the
    # tokens it has matched count as accepted drafts: it drafts longer than a young one.
    long_src = list(range(100, 100 + 2 * HELD))
    d2 = LookupDrafter(min_n=2, max_n=2)
    spec.drafter = d2
    assert d2.propose([*long_src, 7, *long_src[:2]], 2) == long_src[2:4]
    assert spec.kind([*long_src, 7, *long_src[:2 + HELD]]) == "follow"
    assert spec.best_k(16, "follow") >= 8 > young


@pytest.mark.parametrize("mode", ["mlx", "exact"])
def test_greedy_matches_plain_decoding_over_256_tokens(starter_lm: LoadedModel,
                                                      copy_ids: list[int], mode: str,
                                                      request: pytest.FixtureRequest) -> None:
    """Prompt lookup over 256 tokens and a draft model over the first 64, against plain
    decoding, in mlx-lm's cache and in paged exact mode (the prompt is prefilled once; each
    reply trims the last one's tokens). The draft model's replies are shorter for the suite's
    budget: the draft model is the starter itself (the same vocabulary, nearly every draft
    kept), so each of its tokens costs about a plain step more."""
    lm = request.getfixturevalue("exact") if mode == "exact" else starter_lm
    assert lm.paged == (mode == "exact")
    cache = lm.new_cache()
    drafter = ModelDrafter(lm, lm)
    try:
        reference = plain(lm, copy_ids, 256, cache)  # shared with test_spec_batch.py
        spec, last = run(lm, copy_ids, "lookup", 256, cache=cache)
        by_model, last_model = run(lm, copy_ids, drafter, 64, cache=cache)
        # The draft's cache holds exactly the tokens it has run.
        assert drafter.pc.tokens == (copy_ids + by_model)[:len(drafter.pc.tokens)]
        assert all(c.offset == len(drafter.pc.tokens) for c in drafter.pc.cache)
    finally:
        drafter.close()
        cache.close()
    assert len(reference) == 256
    assert last.drafted_tokens > last.accepted_tokens > 100  # drafts kept, and some rejected
    assert last_model.accepted_tokens >= last_model.drafted_tokens // 2 > 0
    assert spec == reference
    assert by_model == reference[:64]


def test_a_young_copy_that_has_matched_a_few_tokens_drafts_long(
        starter_lm: LoadedModel, copy_ids: list[int]) -> None:
    """The starter copying a file: once the copy a fresh search picked has matched its first
    3 tokens (it has never missed), the next pass drafts at least 7 tokens at a verify cost
    of 1 + 0.15 (L - 1) plain steps (the tokens it matched count double: 5 before), and
    those drafts are the plain greedy reply's next tokens (after the 256-token test, whose
    plain reply it shares)."""
    reply = plain(starter_lm, copy_ids, 24)
    d = LookupDrafter()
    spec = Speculator(starter_lm, d, Sampler(GREEDY), _NoCache(), lambda x: x, {},
                      forced=False)
    spec.costs = StepCosts({n: 0.07 * (1 + 0.15 * (n - 1)) for n in (1, 5, 9, 17)})
    at = next(i for i in range(len(reply)) if d.propose(copy_ids + reply[:i], 1))
    assert spec.kind(copy_ids + reply[:at + 1]) == "young"  # the pick's token matched
    history = copy_ids + reply[:at + 3]
    assert spec.kind(history) == "young" and spec.acceptance["young"] == list(PRIOR_ACCEPT)
    k = spec.best_k(16, "young")
    assert k >= 7
    drafts = d.propose(history, k)
    assert len(drafts) == k and drafts == reply[at + 3:at + 3 + k]
    spec.kind(history)
    spec.acceptance["young"] = [0.5, 3.0]  # this reply's young copies have parted early
    assert spec.best_k(16, "young") < k


def test_calibration_times_the_pass_lengths_and_leaves_the_cache_as_it_was(
        starter_lm: LoadedModel, copy_ids: list[int]) -> None:
    """Before a model's first draft its verify passes are timed once, over a short cache of
    their own (so the first reply drafts on measured costs, and a deep reply does not pay
    passes over its whole cache), and one plain step over the reply's cache (the depth's
    point they scale from); the reply's cache is left as it was."""
    lm = starter_lm
    cache = lm.new_cache()
    try:
        run(lm, copy_ids[:-4], "off", 1, cache=cache)  # the prompt's start in the cache
        held = [c.offset for c in cache.cache], list(cache.tokens)
        spec = Speculator(lm, LookupDrafter(), Sampler(GREEDY), cache,
                          lambda x: lm.model(x, cache=cache.cache), {}, forced=False)
        spec.costs = StepCosts()  # as for a model never measured
        assert spec.calibrate() > 0
        assert {1, 5, 9} <= set(spec.costs.prior) and spec.costs.threads in (0, 1)
        assert set(spec.costs.seconds) == {1}  # at the reply's depth: a plain step alone
        assert min(spec.costs.prior.values()) == 1.0  # no pass cheaper than a plain step
        assert spec.costs.ratio(5) == spec.costs.prior[5]
        assert spec.calibrate() == 0  # once
        assert ([c.offset for c in cache.cache], list(cache.tokens)) == held
    finally:
        cache.close()


def test_calibration_takes_the_reply_s_own_plain_steps_when_it_has_two(
        starter_lm: LoadedModel, copy_ids: list[int]) -> None:
    """The depth's point comes from the two plain steps the decode loop last timed when it
    has them (the faster kept), no step run over the reply's cache for it; with one, the
    calibration times two of its own as before."""
    lm = starter_lm
    cache = lm.new_cache()
    try:
        run(lm, copy_ids[:-4], "off", 1, cache=cache)
        fed: list[int] = []

        def forward(x: Any) -> Any:
            fed.append(x.shape[1])
            return lm.model(x, cache=cache.cache)

        spec = Speculator(lm, LookupDrafter(), Sampler(GREEDY), cache, forward, {},
                          forced=False)
        spec.costs = StepCosts()
        for s in (0.31, 0.29, 0.5):
            spec.plain_timed(s)
        spec.calibrate()
        assert fed == [] and spec.costs.seconds[1] == 0.29  # (0.29, 0.5): the faster
        spec = Speculator(lm, LookupDrafter(), Sampler(GREEDY), cache, forward, {},
                          forced=False)
        spec.costs = StepCosts()
        spec.plain_timed(0.01)
        spec.calibrate()
        assert fed == [1, 1] and spec.costs.seconds[1] != 0.01
    finally:
        cache.close()


def test_the_decode_loop_times_its_unqueued_plain_steps_for_the_speculator(
        starter_lm: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply that rests (nothing to copy) decodes its own plain steps; each built with no
    step queued before its token is timed for the speculator: every step where the paged
    attention computes it as it is built, at most the first where decode is pipelined."""
    from engine.kv import attention, cpu_select

    ids = starter_lm.tokenizer.encode_chat(
        [{"role": "user", "content": "Tell me a long story about a lighthouse."}])
    timed: list[float] = []
    own = Speculator.plain_timed

    def counted(self: Speculator, seconds: float) -> None:
        timed.append(seconds)
        own(self, seconds)

    monkeypatch.setattr(Speculator, "plain_timed", counted)
    old = starter_lm.kv_settings
    try:
        starter_lm.kv_settings = KVSettings(mode="exact")
        run(starter_lm, ids, "auto", 12)
        lazy = len(timed)
        timed.clear()
        monkeypatch.setattr(attention, "FUSED_DECODE_PAST", -1)
        monkeypatch.setattr(cpu_select, "DENSE_MIN_KEYS", 0)
        monkeypatch.setattr(cpu_select, "CONTIG_DENSE_MIN_KEYS", 0)
        toks, last = run(starter_lm, ids, "auto", 12)
    finally:
        starter_lm.kv_settings = old
    # 11 steps after the first token; one or two may go through `Speculator.step` (a
    # draft tried and found empty), which times its own.
    assert lazy <= 1, lazy
    assert last.drafted_tokens == 0 and len(timed) >= len(toks) - 3 and min(timed) > 0, timed


def test_calibration_waits_for_a_possible_draft_after_the_first_token(
        starter_lm: LoadedModel, copy_ids: list[int]) -> None:
    """No first token waits for the timing: a one-token reply never calibrates, and a reply
    that copies its prompt calibrates once it could draft, with the plain decode's tokens."""
    costs = costs_of(starter_lm)
    saved = (dict(costs.seconds), costs.threads, costs.calibrated, dict(costs.prior),
             costs.prior_one)
    try:
        costs.seconds.clear()
        costs.prior.clear()
        costs.calibrated = False
        run(starter_lm, copy_ids, "auto", 1)
        assert not costs.calibrated and set(costs.seconds) <= {1} and not costs.prior
        # 64 tokens: where a verify pass costs several plain steps (one-row products read
        # packed codes, engine.runtime.packed) the first drafts wait for a probe
        toks, last = run(starter_lm, copy_ids, "auto", 64)
        assert costs.calibrated and {1, 5, 9} <= set(costs.prior)
        assert toks == plain(starter_lm, copy_ids, 64) and last.drafted_tokens > 0
    finally:
        costs.seconds.clear()
        costs.seconds.update(saved[0])
        costs.prior.clear()
        costs.prior.update(saved[3])
        costs.threads, costs.calibrated, costs.prior_one = saved[1], saved[2], saved[4]


def test_draft_setting_resolves_to_a_drafter_loaded_once(starter_lm: LoadedModel) -> None:
    loads: list[str] = []

    def load(name: str) -> LoadedModel:
        loads.append(name)
        return starter_lm  # the starter drafting for itself: same vocabulary

    drafts = DraftModels(load)
    assert [drafts.drafter(starter_lm, s) for s in ("auto", "off", "lookup")] == [
        "auto", "off", "lookup"]
    first = drafts.drafter(starter_lm, "starter-copy")
    assert isinstance(first, ModelDrafter) and first.name == starter_lm.manifest["name"]
    assert drafts.drafter(starter_lm, "starter-copy") is first and loads == ["starter-copy"]
    drafts.drafter(starter_lm, "another")  # another name: the first is closed, one more load
    assert loads == ["starter-copy", "another"]
    assert drafts.drafter(starter_lm, "off") == "off"  # the draft model goes
    assert isinstance(drafts.drafter(starter_lm, "another"), ModelDrafter)
    assert loads == ["starter-copy", "another", "another"]
    drafts.close()


def test_draft_model_of_another_vocabulary_is_refused(starter_lm: LoadedModel, library: Any,
                                                      tmp_path: Path) -> None:
    from engine.importers import import_path
    from tests.reliability.common import write_tiny_gguf

    name = "tiny-other-vocab"
    if library.find(name) is None:
        import_path(library, write_tiny_gguf(tmp_path / "tiny.gguf"), name=name)
    tiny = LoadedModel.load(name, library=library, warm_up=False)
    with pytest.raises(DraftRefused) as info:
        ModelDrafter(starter_lm, tiny)
    msg = str(info.value)
    assert "\n" not in msg and name in msg and "vocabulary" in msg


def test_sampled_tokens_keep_the_target_distribution(starter_lm: LoadedModel) -> None:
    """Many short replies at temperature 0.8 with and without drafts (fixed seeds, other
    seeds for each arm): the token at the drafted position is distributed alike."""
    lm = starter_lm
    # After " heads" the lookup proposes "." (the target: p about 0.4 at this temperature).
    ids = lm.tokenizer.encode("The coin said heads. The coin said tails. The coin said",
                              add_bos=False)
    cache = lm.new_cache()  # the prompt is prefilled once; each reply trims its own tokens
    runs, n = 32, 3
    arms: dict[str, list[list[int]]] = {"off": [], "lookup": []}
    drafted = accepted = 0
    try:
        for arm, base in (("off", 1000), ("lookup", 0)):
            for s in range(runs):
                params = SamplingParams(temperature=0.8, seed=base + s)
                toks, last = run(lm, ids, arm, n, params, cache)
                arms[arm].append(toks)
                if arm == "lookup":
                    drafted += last.drafted_tokens
                    accepted += last.accepted_tokens
    finally:
        cache.close()
    assert drafted > accepted > 0  # drafts were accepted and rejected
    # The drafted position (the one after the first token): a rule that kept every draft
    # would put "." there every time, against about 0.4 of the time; total variation on 32
    # runs a side stays well under 0.35 when the distributions are one.
    a = Counter(t[1] for t in arms["off"])
    b = Counter(t[1] for t in arms["lookup"])
    tv = 0.5 * sum(abs(a[x] - b[x]) / runs for x in set(a) | set(b))
    assert tv < 0.35, (a.most_common(4), b.most_common(4))


def test_cancel_during_a_verify_step_stops_before_the_next_token(starter_lm: LoadedModel,
                                                                 copy_ids: list[int]) -> None:
    """The flag is set as the first token of a verify pass that kept several drafts comes
    out: the tokens that pass accepted after it never do."""
    stop = [False]
    events: list[GenerationEvent] = []
    for ev in generate(starter_lm, copy_ids, GREEDY, 64, drafter="lookup",
                       cancel=lambda: stop[0]):
        events.append(ev)
        if not stop[0] and ev.accepted_tokens >= 3:
            stop[0] = True
            at = ev.generated_tokens
    last = events[-1]
    assert stop[0] and last.finish_reason == "cancelled" and last.token is None
    assert last.generated_tokens == at  # nothing after the flag
    assert len([e for e in events if e.token is not None]) == at

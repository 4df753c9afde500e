"""Drafting in the server's decode batch, on the real starter model: a row decoding alone
verifies drafts over mlx-lm's batch cache and its greedy text is the plain decode's; rows
decoding together draft each on its own (one verify pass, per-row acceptance, holes for the
rows that kept fewer) and each row's greedy text is still its plain run's, a row that rejects
drafts beside one that keeps them disturbing neither, a row joining a batch with holes too."""

from __future__ import annotations

import pytest

from engine.runtime.batch import Batch, Row
from engine.runtime.generate import LoadedModel
from engine.telemetry import GenerationEvent
from tests.engine.runtime.spec_fixtures import GREEDY, copy_prompt, plain


class _Sink:
    def __init__(self) -> None:
        self.events: list[GenerationEvent] = []

    def __call__(self, ev: GenerationEvent) -> None:
        self.events.append(ev)

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1].finish_reason is not None


@pytest.fixture(scope="module")
def copy_ids(starter_lm: LoadedModel) -> list[int]:
    return copy_prompt(starter_lm)


@pytest.fixture(scope="module")
def plain_copy(starter_lm: LoadedModel, copy_ids: list[int]) -> list[int]:
    """The copy prompt's plain greedy reply (64 tokens; a shorter one is its start), the
    start of the 256 that test_speculative.py compares with (decoded once for both)."""
    return plain(starter_lm, copy_ids, 256)[:64]


def test_a_row_alone_drafts_and_keeps_the_plain_text(starter_lm: LoadedModel,
                                                     copy_ids: list[int],
                                                     plain_copy: list[int]) -> None:
    lm = starter_lm
    batch = Batch(lm)
    assert batch.accepts()
    sink = _Sink()
    assert batch.join(Row(copy_ids, GREEDY, 64, sink, drafter="lookup"))
    while len(batch):
        batch.step()
    last = sink.events[-1]
    assert last.finish_reason == "length" and last.generated_tokens == 64
    assert last.drafted_tokens > last.accepted_tokens > 10  # drafts kept, and some rejected
    assert batch.steps < 64 - last.accepted_tokens // 2  # fewer steps than tokens
    assert sink.tokens == plain_copy


def _listing(lm: LoadedModel) -> list[int]:
    """A chat prompt whose reply repeats itself only in part: forced lookup drafts there are
    often wrong (rejected), and some are kept."""
    return lm.tokenizer.encode_chat([{"role": "user", "content": (
        "Write a list of ten animals and one fact about each animal, numbered.")}])


def test_rows_together_draft_each_on_its_own_and_keep_the_plain_text(
        starter_lm: LoadedModel, copy_ids: list[int], plain_copy: list[int]) -> None:
    lm = starter_lm
    listing = _listing(lm)
    rhyme = lm.tokenizer.encode("the cat sat on the mat. the dog sat on the log. the cat ran "
                                "to the dog. the", add_bos=False)
    batch = Batch(lm)
    a, c, d = _Sink(), _Sink(), _Sink()
    assert batch.join(Row(copy_ids, GREEDY, 48, a, drafter="lookup"))
    assert batch.join(Row(listing, GREEDY, 48, c, drafter="lookup"))
    for _ in range(4):
        batch.step()
    # A third row joins a batch whose rows have holes (the listing's rejected drafts).
    assert batch.join(Row(rhyme, GREEDY, 24, d, drafter="lookup"))
    while not a.done:
        batch.step()
    copy_steps = batch.steps
    while len(batch):
        batch.step()
    assert batch.peak_rows == 3
    ea, ec = a.events[-1], c.events[-1]
    # The copy kept most of its drafts, the listing rejected some (so holes exist), in the
    # same passes. How many the listing drafts follows measured costs (CI: 19, 17 kept).
    assert ea.accepted_tokens > 30 and ec.drafted_tokens > ec.accepted_tokens
    assert copy_steps < 48 - ea.accepted_tokens // 2  # the copy's steps made several tokens
    assert a.tokens == plain_copy[:48]
    assert c.tokens == plain(lm, listing, 48)
    assert d.tokens == plain(lm, rhyme, 24)


def test_a_row_that_rejects_does_not_disturb_a_row_that_drafts_nothing(
        starter_lm: LoadedModel, copy_ids: list[int], plain_copy: list[int]) -> None:
    """Open chat (drafter off) beside a rejecting row, then beside the copy: its slots become
    holes at every pass, and its text is its plain run's; the copy row finishes first and
    leaves (the batch filtered with holes), the others decode on."""
    lm = starter_lm
    listing = _listing(lm)
    chat = lm.tokenizer.encode_chat([{"role": "user", "content": "Name three fruits."}])
    batch = Batch(lm)
    a, b, c = _Sink(), _Sink(), _Sink()
    assert batch.join(Row(chat, GREEDY, 32, b, drafter="off"))
    assert batch.join(Row(listing, GREEDY, 40, c, drafter="lookup"))
    assert batch.join(Row(copy_ids, GREEDY, 16, a, drafter="lookup"))
    while len(batch):
        batch.step()
    assert b.events[-1].drafted_tokens == 0 and c.events[-1].drafted_tokens > 0
    assert a.tokens == plain_copy[:16]
    assert b.tokens == plain(lm, chat, 32)
    assert c.tokens == plain(lm, listing, 40)

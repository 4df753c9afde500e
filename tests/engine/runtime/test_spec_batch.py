"""Drafting in the server's decode batch, on the real starter model: a row decoding alone
verifies drafts over mlx-lm's batch cache and its greedy text is the plain decode's; once a
second row joins, both decode on undrafted and each still equals its plain run."""

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


def test_a_second_row_joining_ends_the_drafts_and_both_keep_the_plain_text(
        starter_lm: LoadedModel, copy_ids: list[int], plain_copy: list[int]) -> None:
    lm = starter_lm
    other = lm.tokenizer.encode_chat([{"role": "user", "content": "Name three fruits."}])
    batch = Batch(lm)
    a, b = _Sink(), _Sink()
    assert batch.join(Row(copy_ids, GREEDY, 48, a, drafter="lookup"))
    while a.tokens and len(a.tokens) < 12:
        batch.step()
    drafted = a.events[-1].drafted_tokens
    assert drafted > 0  # it drafted while alone
    assert batch.join(Row(other, GREEDY, 24, b, drafter="lookup"))
    steps = batch.steps
    while len(batch) == 2:
        batch.step()
    assert batch.steps > steps and batch.peak_rows == 2
    assert a.events[-1].drafted_tokens == drafted  # together, neither drafts
    while len(batch):
        batch.step()
    assert a.done and b.done
    assert a.tokens == plain_copy[:48]
    assert b.tokens == plain(lm, other, 24)

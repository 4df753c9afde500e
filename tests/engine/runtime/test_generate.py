"""Runtime on the real starter model: streaming text, stops, sampling, cancel, multi-turn reuse."""

from __future__ import annotations

from typing import Any

import pytest

from engine.errors import StrataError
from engine.runtime.generate import ChatSession, _stop_split, generate
from engine.runtime.sampling import SamplingParams
from engine.runtime.tokenizer import StreamingDetokenizer

GREEDY = SamplingParams(temperature=0)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _run(lm: Any, ids: list[int], params: SamplingParams = GREEDY, max_tokens: int = 24,
         **kw: Any) -> tuple[str, list[int], Any]:
    text, tokens, last = [], [], None
    for ev in generate(lm, ids, params, max_tokens, **kw):
        text.append(ev.text)
        if ev.token is not None:
            tokens.append(ev.token)
        last = ev
    return "".join(text), tokens, last


UNICODE = ["naïve café 🙂 — 你好, мир!", "emoji run 🙂🙃🚀🎉", "x\u00e9\u0301y"]


@pytest.mark.parametrize("text", UNICODE)
def test_streaming_detokenizer_never_splits_characters(starter_lm: Any, text: str) -> None:
    tok = starter_lm.tokenizer
    ids = tok.encode(text)
    # The case is real: some single tokens are partial UTF-8 sequences.
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text.isascii() or "é" in text
    detok = StreamingDetokenizer(tok)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_stop_split_holds_back_possible_prefixes() -> None:
    assert _stop_split("hello wor", ["world"]) == ("hello ", "wor", False)
    assert _stop_split("hello world!", ["world"]) == ("hello ", "", True)
    assert _stop_split("abc", []) == ("abc", "", False)


def test_stop_string_ends_reply_before_it(starter_lm: Any) -> None:
    ids = starter_lm.tokenizer.encode_chat(FRANCE)
    full, _, _ = _run(starter_lm, ids)
    assert "Paris" in full
    text, _, last = _run(starter_lm, ids, stop=["Paris"])
    assert "Paris" not in text and full.startswith(text)
    assert last.finish_reason == "stop"


def test_eos_and_length_finish_reasons(starter_lm: Any) -> None:
    ids = starter_lm.tokenizer.encode_chat(FRANCE)
    _, tokens, last = _run(starter_lm, ids, max_tokens=64)
    assert last.finish_reason == "stop" and not set(tokens) & starter_lm.eos_ids
    _, tokens, last = _run(starter_lm, ids, max_tokens=3)
    assert last.finish_reason == "length" and len(tokens) == 3


def test_seeded_sampling_is_reproducible(starter_lm: Any) -> None:
    ids = starter_lm.tokenizer.encode_chat([{"role": "user", "content": "Tell me a story."}])
    hot = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, min_p=0.02, seed=7)
    _, a, _ = _run(starter_lm, ids, hot, max_tokens=16)
    _, b, _ = _run(starter_lm, ids, hot, max_tokens=16)
    assert a == b and len(a) == 16
    _, greedy, _ = _run(starter_lm, ids, GREEDY, max_tokens=16)
    _, top1, _ = _run(starter_lm, ids, SamplingParams(temperature=1.0, top_k=1, seed=3), 16)
    assert top1 == greedy
    others = [_run(starter_lm, ids, SamplingParams(temperature=1.0, seed=s), 16)[1]
              for s in (1, 2, 3)]
    assert any(o != a for o in others)


def test_repetition_penalty_changes_greedy_output(starter_lm: Any) -> None:
    ids = starter_lm.tokenizer.encode("one one one one one one one one", add_bos=False)
    _, plain, _ = _run(starter_lm, ids, GREEDY, max_tokens=12)
    _, penal, _ = _run(starter_lm, ids, SamplingParams(temperature=0, repetition_penalty=2.0),
                       max_tokens=12)
    assert len(penal) == 12 and penal != plain


def test_logits_processors_see_history_and_steer_greedy_output(starter_lm: Any) -> None:
    """A processor that bans each greedy pick forces a different reply; it sees every token."""
    import mlx.core as mx

    ids = starter_lm.tokenizer.encode_chat(FRANCE)
    _, plain, _ = _run(starter_lm, ids, max_tokens=6)
    seen: list[list[int]] = []

    def ban_plain(history: list[int], logits: Any) -> Any:
        seen.append(list(history))
        i = len(history) - len(ids)
        if i < len(plain):
            logits[:, plain[i]] = -mx.inf
        return logits

    _, steered, _ = _run(starter_lm, ids, max_tokens=6, logits_processors=[ban_plain])
    assert all(a != b for a, b in zip(steered, plain, strict=False))
    assert [len(h) for h in seen] == [len(ids) + k for k in range(len(seen))]
    assert seen[-1][len(ids):] == steered[:len(seen) - 1]


def test_a_processor_that_raises_leaves_the_prompt_cache_in_step(starter_lm: Any) -> None:
    """A grammar that fails mid-reply (after the step's KV was fed): the next reply over the
    same prompt cache is the one a fresh cache gives."""
    ids = starter_lm.tokenizer.encode_chat(FRANCE)

    def fail_late(history: list[int], logits: Any) -> Any:
        if len(history) > len(ids) + 2:
            raise StrataError("grammar failed")
        return logits

    pc = starter_lm.new_cache()
    with pytest.raises(StrataError, match="grammar failed"):
        _run(starter_lm, ids, max_tokens=8, prompt_cache=pc, logits_processors=[fail_late])
    assert all(getattr(c, "offset", 0) <= len(pc.tokens) for c in pc.cache)
    again = starter_lm.tokenizer.encode_chat(FRANCE + [{"role": "assistant", "content": "Paris"},
                                                       {"role": "user", "content": "And Spain?"}])
    got = _run(starter_lm, again, max_tokens=6, prompt_cache=pc)[1]
    assert got == _run(starter_lm, again, max_tokens=6)[1]
    pc.close()


def test_invalid_sampling_is_a_user_error() -> None:
    with pytest.raises(StrataError, match="top_p"):
        SamplingParams(top_p=0).validate()
    with pytest.raises(StrataError, match="temperature"):
        SamplingParams(temperature=-1).validate()


def test_cancel_between_decode_steps(starter_lm: Any) -> None:
    ids = starter_lm.tokenizer.encode_chat([{"role": "user", "content": "Tell me a story."}])
    seen: list[int] = []
    events = generate(starter_lm, ids, GREEDY, 100, cancel=lambda: len(seen) >= 3)
    for ev in events:
        if ev.token is not None:
            seen.append(ev.token)
        last = ev
    assert last.finish_reason == "cancelled" and len(seen) == 3


def test_cancel_during_prefill(starter_lm: Any) -> None:
    ids = starter_lm.tokenizer.encode("word " * 1200, add_bos=False)
    cache = starter_lm.new_cache()
    events = list(generate(starter_lm, ids, GREEDY, 10, cancel=lambda: True, prompt_cache=cache))
    assert [e.finish_reason for e in events] == ["cancelled"]
    assert events[0].generated_tokens == 0
    assert 0 < len(cache.tokens) < len(ids)  # stopped after the first chunk


def test_multi_turn_reuses_previous_kv(starter_lm: Any) -> None:
    session = ChatSession(starter_lm, system="You are a helpful assistant.")
    first = list(session.send("What is the capital of France?", GREEDY, 32))
    assert first[-1].cached_tokens == 0
    second = list(session.send("And of Germany?", GREEDY, 32))
    reply = "".join(e.text for e in second)
    # Everything up to the new user message came from the cache.
    assert second[-1].cached_tokens >= first[-1].prompt_tokens
    assert second[-1].prompt_tokens - second[-1].cached_tokens < 20
    # And the reply equals a cold run on the same prompt.
    prompt = starter_lm.tokenizer.encode_chat(session.messages[:-1])
    cold, _, _ = _run(starter_lm, prompt, max_tokens=32)
    assert reply == cold and "Berlin" in reply
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user",
                                                     "assistant"]


def _steps_at_each_token(lm: Any, ids: list[int], n: int) -> list[int]:
    """Decode steps built (forward passes after the prefill's) when each token went out."""
    from engine.runtime import generate as gen

    calls: list[int] = []
    forward = gen._forward

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(a[1].shape[1])  # the step's new tokens
        return forward(*a, **kw)

    gen._forward = counted
    try:
        seen: list[int] = []
        prefill = -1
        for _ in generate(lm, ids, GREEDY, n, drafter="off"):
            if prefill < 0:
                prefill = len(calls)  # the first token: the prefill's passes only
            seen.append(len(calls) - prefill)
    finally:
        gen._forward = forward
    assert all(c == 1 for c in calls[prefill:]), "decode steps feed one token each"
    return seen[:n]


def test_a_step_computed_as_it_is_built_is_not_queued_before_the_token(
        starter_lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode is pipelined (the next step queued before the token before it goes out) while
    building a step is cheap beside computing it: on MLX's lazy graph at a short context.
    Where building a step is computing it (the paged attention's numpy steps, which evaluate
    each layer), a queued step would hold the token back a whole step: each token then goes
    out before the next step is built."""
    from engine.kv import KVSettings, attention, cpu_select

    ids = starter_lm.tokenizer.encode_chat(
        [{"role": "user", "content": "Tell me a long story about a lighthouse."}])
    old = starter_lm.kv_settings
    try:
        starter_lm.kv_settings = KVSettings(mode="exact")
        lazy = _steps_at_each_token(starter_lm, ids, 12)
        # The same store, its decode steps through the numpy pass from the first token.
        monkeypatch.setattr(attention, "FUSED_DECODE_PAST", -1)
        monkeypatch.setattr(cpu_select, "DENSE_MIN_KEYS", 0)
        monkeypatch.setattr(cpu_select, "CONTIG_DENSE_MIN_KEYS", 0)
        eager = _steps_at_each_token(starter_lm, ids, 12)
    finally:
        starter_lm.kv_settings = old
    # Token k (1-based) needs k - 1 steps; pipelined, one more is built by then.
    assert sum(s == k for k, s in enumerate(lazy[2:-1], 3)) >= 7, lazy
    assert eager[1:] == list(range(1, 12)), eager


def test_a_prompt_s_last_chunk_computes_the_head_on_its_last_row_only(starter_lm: Any) -> None:
    """Inside last_row_head the starter's tied head multiplies the last position alone: the
    logits the reply samples from equal the full pass's last row; outside the block, and on
    another thread inside it, every row is computed as before."""
    import threading

    import mlx.core as mx

    from engine.runtime.model import head_on_last_row, last_row_head

    ids = starter_lm.tokenizer.encode_chat(FRANCE)
    x = mx.array(ids)[None]

    def forward() -> Any:
        return starter_lm.model(x, cache=starter_lm.new_cache().cache)

    full = forward()
    seen: list[Any] = []
    with last_row_head():
        last = forward()
        other = threading.Thread(target=lambda: seen.append(forward().shape))
        other.start()
        other.join()
    after = forward()
    vocab = full.shape[-1]
    assert full.shape == after.shape == (1, len(ids), vocab) and seen == [full.shape]
    assert last.shape == (1, 1, vocab)
    # The last row alone is a one-row product (sgemv, engine.matvec), the full pass's rows
    # sgemm's: the same sums in another order (3.6e-5 apart at most here, logits up to 25).
    assert mx.allclose(last[0, -1], full[0, -1], atol=1e-4).item()
    assert int(mx.argmax(last[0, -1]).item()) == int(mx.argmax(full[0, -1]).item())
    # An architecture not read for it (gemma4_text also calls as_linear on its inputs).
    assert not head_on_last_row(starter_lm.model, {"model_type": "gemma4_text"})


@pytest.mark.parametrize("kv_mode", ["mlx", "exact"])
def test_a_short_prompt_is_one_pass_and_gives_the_split_passes_reply(
        starter_lm: Any, kv_mode: str) -> None:
    """With the head on one row, a prompt under a chunk is prefilled in one pass that gives
    the first token (mlx-lm prefills all but the last token, then that one alone); the
    reply is the split passes' token for token, in mlx-lm's cache and the paged one."""
    from engine.kv import KVSettings
    from engine.runtime import generate as gen

    ids = starter_lm.tokenizer.encode_chat(FRANCE)
    calls: list[int] = []
    forward = gen._forward

    def counted(*a: Any, **kw: Any) -> Any:
        calls.append(a[1].shape[1])
        return forward(*a, **kw)

    old, head = starter_lm.kv_settings, starter_lm.head_last_row
    gen._forward = counted
    try:
        starter_lm.kv_settings = None if kv_mode == "mlx" else KVSettings(mode=kv_mode)
        replies = {}
        for whole in (True, False):
            starter_lm.head_last_row = whole
            calls.clear()
            replies[whole] = _run(starter_lm, ids, max_tokens=12, prefix_cache=False,
                                  drafter="off")[1]
            assert calls[:2] == ([len(ids), 1] if whole else [len(ids) - 1, 1]), calls
    finally:
        gen._forward = forward
        starter_lm.head_last_row = head
        starter_lm.kv_settings = old
    assert replies[True] == replies[False] and len(replies[True]) > 3

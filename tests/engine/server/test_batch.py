"""Concurrent requests batched, through the official `openai` client against a real
`strata serve` on loopback and the starter model: eight streams that arrive together decode in
one batch and each equals its sequential greedy run; a client that hangs up mid-batch frees
its slot (the server's batch drops to the rows left and counts it cancelled) while the others
go on; past `--max-queue` waiting requests, a 429 with Retry-After, and the queued ones
still complete."""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.engine.server.conftest import KEY, serving

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.",
             "Name three fruits.", "Explain gravity in one sentence.", "What is 2+2?",
             "Tell me a joke.", "Who wrote Hamlet?", "Describe a cat in a few words."]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # the starter keeps counting: no early EOS
DEADLINE_S = 60


def _status(base: str) -> dict[str, Any]:
    req = urllib.request.Request(base + "/strata/status",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        status: dict[str, Any] = json.loads(resp.read())
        return status


def _until(base: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll the server's status until `check` holds (the engine reports each step)."""
    end = time.monotonic() + DEADLINE_S
    while True:
        status = _status(base)
        if check(status):
            return status
        assert time.monotonic() < end, f"status never matched: {status}"
        time.sleep(0.02)


def _stream(client: openai.OpenAI, question: str, max_tokens: int = 16) -> str:
    chunks = client.chat.completions.create(
        model="starter", messages=[{"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_eight_streams_equal_their_sequential_runs(server: str, client: openai.OpenAI) -> None:
    alone = [_stream(client, q) for q in QUESTIONS]
    before = _status(server)["batch"]
    got: dict[int, str] = {}
    gate = threading.Barrier(len(QUESTIONS))

    def one(i: int) -> None:
        gate.wait()  # they arrive together
        got[i] = _stream(client, QUESTIONS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(QUESTIONS))] == alone
    assert all(alone)
    after = _status(server)["batch"]
    steps, tokens = after["steps"] - before["steps"], after["tokens"] - before["tokens"]
    # Steps that ran several rows at once: more tokens than forward passes.
    assert tokens > 2 * steps > 0, (before, after)
    assert after["peak_rows"] >= 4


# Each with its own sampling: a schema, logprobs, a repetition penalty, a required tool call.
NAMED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0}},
         "required": ["name", "age"], "additionalProperties": False}
WEATHER: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"], "additionalProperties": False}}}]
MIXED: list[dict[str, Any]] = [
    {"q": "Describe a person as JSON.", "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": NAMED}}},
    {"q": "Give me a user record.", "logprobs": True, "top_logprobs": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": NAMED}}},
    {"q": "Name three fruits.", "extra_body": {"repetition_penalty": 1.3}},
    {"q": "What is the weather in Oslo right now?", "tools": WEATHER, "tool_choice": "required",
     "max_tokens": 40},
]


def _mixed(client: openai.OpenAI, case: dict[str, Any]) -> tuple[Any, ...]:
    """One streamed reply for a MIXED case: (text, tool call deltas, logprobs, finish)."""
    opts = {k: v for k, v in case.items() if k != "q"}
    opts.setdefault("temperature", 0)
    opts.setdefault("max_tokens", 20)
    text, calls, probs, finish = [], [], [], None
    for c in client.chat.completions.create(
            model="starter", messages=[{"role": "user", "content": case["q"]}],
            stream=True, **opts):
        if not c.choices:
            continue
        choice = c.choices[0]
        text.append(choice.delta.content or "")
        calls += [(t.function.name, t.function.arguments) for t in choice.delta.tool_calls or []
                  if t.function is not None]
        if choice.logprobs is not None and choice.logprobs.content:
            probs += [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                      for t in choice.logprobs.content]
        finish = choice.finish_reason or finish
    return "".join(text), calls, probs, finish


def test_streams_with_their_own_sampling_batch_and_equal_their_runs(
        server: str, client: openai.OpenAI) -> None:
    alone = [_mixed(client, case) for case in MIXED]
    before = _status(server)["batch"]
    got: dict[int, tuple[Any, ...]] = {}
    gate = threading.Barrier(len(MIXED))

    def one(i: int) -> None:
        gate.wait()
        got[i] = _mixed(client, MIXED[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(MIXED))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, want in enumerate(alone):
        text, calls, probs, finish = got[i]
        assert (text, calls, finish) == want[:2] + want[3:]
        # The same tokens; their log-probabilities within float error (a batch's matmuls
        # block, and so round, by its row count).
        assert [(t, [a for a, _ in top]) for t, _, top in probs] == \
            [(t, [a for a, _ in top]) for t, _, top in want[2]]
        assert [v for _, v, _ in probs] == pytest.approx([v for _, v, _ in want[2]], abs=2e-3)
    for i in (0, 1):  # the schema held, batched or not
        assert alone[i][3] == "stop"
        assert set(json.loads(alone[i][0])) == {"name", "age"}
    assert alone[1][2]  # logprobs came, and equal the sequential ones
    assert alone[3][1] and alone[3][1][0][0] == "get_weather" and alone[3][3] == "tool_calls"
    after = _status(server)["batch"]
    steps, tokens = after["steps"] - before["steps"], after["tokens"] - before["tokens"]
    assert tokens > 2 * steps > 0, (before, after)  # they decoded together, not alone


class _Record:
    """A logits processor that records each call's history length (and may fail)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.seen: list[int] = []
        self.fail_at = fail_at

    def __call__(self, history: list[int], logits: Any) -> Any:
        self.seen.append(len(history))
        if self.fail_at is not None and len(self.seen) > self.fail_at:
            raise ValueError("refused")
        return logits


def test_batch_rows_with_processors_equal_generate(starter_lm: Any) -> None:
    """In the engine, no server: each row's grammar, penalty, seed and processors in one
    batch give the tokens `generate` gives alone; a processor that raises fails its row only,
    after the tokens already sampled."""
    from engine.runtime.batch import Batch, Row
    from engine.runtime.generate import generate
    from engine.runtime.grammar import GrammarProcessor, json_grammar
    from engine.runtime.sampling import SamplingParams

    tok = starter_lm.tokenizer
    grammar = json_grammar(NAMED)
    cases: list[tuple[str, SamplingParams, Callable[[], list[Any]]]] = [
        ("Describe a person as JSON.", SamplingParams(temperature=0),
         lambda: [GrammarProcessor(tok, grammar)]),
        ("Name three fruits.", SamplingParams(temperature=0, repetition_penalty=1.3), list),
        ("Tell me a joke.", SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.2),
         lambda: [_Record()]),
    ]
    n = 12

    def ids(q: str) -> list[int]:
        return list(tok.encode_chat([{"role": "user", "content": q}]))

    alone = [[ev.token for ev in generate(starter_lm, ids(q), p, n, logits_processors=procs(),
                                          prefix_cache=False) if ev.token is not None]
             for q, p, procs in cases]
    batch = Batch(starter_lm, 8)
    got: list[list[int]] = [[] for _ in cases]
    failed: list[Exception] = []
    records = []

    def sink(i: int) -> Callable[[Any], None]:
        return lambda ev: got[i].append(ev.token) if ev.token is not None else None

    for i, (q, p, procs) in enumerate(cases):
        made = procs()
        records += [r for r in made if isinstance(r, _Record)]
        batch.join(Row(ids(q), p, n, sink(i), processors=made, fail=failed.append))
    breaking = _Record(fail_at=3)  # masks 3 tokens, then raises computing the 4th
    broken: list[int] = []
    batch.join(Row(ids("Who wrote Hamlet?"), SamplingParams(temperature=0), n,
                   lambda ev: broken.append(ev.token) if ev.token is not None else None,
                   processors=[breaking], fail=failed.append))
    assert batch.peak_rows == 0 and len(batch) == len(cases) + 1
    while len(batch):
        batch.step()
    assert got == alone and all(alone)
    assert batch.peak_rows == len(cases) + 1
    assert [str(e) for e in failed] == ["refused"] and len(broken) == 3
    # Processors see the prompt, then one more token a call: as generate calls them.
    for r in records:
        assert r.seen == list(range(r.seen[0], r.seen[0] + len(r.seen)))


def test_requests_that_arrive_together_share_a_cached_prefix(client: openai.OpenAI) -> None:
    """Three requests with one (new) system prompt, sent together: the first prefills it, the
    two that join after it reuse its KV (the prompt cache is the prompt's while it
    prefills; the batch holds a copy)."""
    system = (f"Session {secrets.token_hex(4)}. You are a terse assistant for a bakery. "
              + "Opening hours are nine to five, closed on Sundays. " * 20)
    asks = ("When do you open?", "Are you open on Sunday?", "Do you sell bread?")
    gate = threading.Barrier(len(asks))

    def one(question: str) -> Any:
        gate.wait()
        return client.chat.completions.create(
            model="starter", temperature=0, max_tokens=4,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": question}]).usage

    with ThreadPoolExecutor(len(asks)) as pool:
        usages = list(pool.map(one, asks))
    cached = sorted(u.prompt_tokens_details.cached_tokens or 0 for u in usages)
    assert all(u.prompt_tokens > 200 for u in usages)
    assert cached[0] < 20 and cached[1] > 200 and cached[2] > 200, cached


def test_a_client_that_hangs_up_frees_its_slot(server: str, client: openai.OpenAI) -> None:
    base = _status(server)
    streams = [client.completions.create(model="starter", prompt=COUNTING, max_tokens=400,
                                         temperature=0, stream=True) for _ in range(2)]
    first = [next(iter(s)) for s in streams]  # both are decoding now
    assert all(f.choices for f in first)
    _until(server, lambda s: s["batch"]["rows"] == 2)
    streams[0].close()  # hang up mid-batch
    left = _until(server, lambda s: s["batch"]["rows"] == 1
                  and s["cancelled"] == base["cancelled"] + 1)
    assert left["running"] == 1
    # The freed slot serves a new request while the other stream goes on.
    r = client.completions.create(model="starter", prompt="The capital of France is",
                                  max_tokens=4, temperature=0)
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    assert next(iter(streams[1])).choices  # still streaming
    streams[1].close()
    _until(server, lambda s: s["running"] == 0 and s["batch"]["rows"] == 0)


# -- the queue bound: a server of its own, one row, one place in the queue ----------------
@pytest.fixture(scope="module")
def small_server(starter: Any, strata_home: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve-small") / "stderr.log"
    with serving(strata_home, log, "--max-batch", "1", "--max-queue", "1") as url:
        yield url


def test_past_the_queue_bound_a_429_with_retry_after(small_server: str) -> None:
    with openai.OpenAI(base_url=small_server, api_key=KEY, max_retries=0, timeout=120) as c:
        running = c.completions.create(model="starter", prompt=COUNTING, max_tokens=400,
                                       temperature=0, stream=True)
        assert next(iter(running)).choices  # the one row decodes
        queued: dict[str, Any] = {}

        def wait_in_queue() -> None:
            queued["r"] = c.completions.create(model="starter", prompt="Hello", max_tokens=2,
                                               temperature=0)

        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        _until(small_server, lambda s: s["waiting"] == 1)
        with pytest.raises(openai.RateLimitError) as refused:
            c.completions.create(model="starter", prompt="Hello", max_tokens=2)
        assert refused.value.status_code == 429
        assert refused.value.response.headers["retry-after"] == "1"
        body = refused.value.response.json()["error"]
        assert body["code"] == "rate_limit_exceeded" and "--max-queue" in body["message"]
        running.close()  # the row frees: the queued request runs and completes
        waiter.join(120)
        assert queued["r"].choices[0].finish_reason == "length"
        status = _status(small_server)
        assert status["rejected"] == 1 and status["max_queue"] == 1

"""Concurrent requests batched, through the official `openai` client against a real
`strata serve` on loopback and the starter model: eight streams that arrive together decode in
one batch and each equals its sequential greedy run; a client that hangs up mid-batch frees
its slot (the server's batch drops to the rows left and counts it cancelled) while the others
go on; past `--max-queue` waiting requests, a 429 with Retry-After, and the queued ones
still complete."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
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

"""What agents need from `strata serve`, through the official `openai` and `anthropic` clients
against the real server (conftest.py) and the starter model: tool calls in both APIs, streamed
and not; strict JSON schemas whose output validates; Anthropic's Messages API and token count;
the Responses API, embeddings and logprobs; hostile bodies answered 4xx with the server still
serving."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anthropic
import jsonschema
import openai
import pytest

from engine.runtime.tokenizer import Tokenizer
from engine.server.tools import prompt_ids
from tests.engine.server.conftest import KEY

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                  "required": ["city"], "additionalProperties": False}
TOOLS: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": WEATHER_SCHEMA}}]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris right now?"}]
GREEDY: Any = {"temperature": 0}


@pytest.fixture(scope="module")
def claude(server: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.removesuffix("/v1"), api_key=KEY, max_retries=0,
                             timeout=120) as c:
        yield c


def _batch(server: str) -> dict[str, Any]:
    """The server's batch counters (/strata/status)."""
    req = urllib.request.Request(server + "/strata/status",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        batch: dict[str, Any] = json.loads(resp.read())["batch"]
        return batch


def _post(url: str, body: bytes) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


# -- tools -----------------------------------------------------------------------------------
def test_openai_tool_call_round_trip(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="starter", messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=40, **GREEDY)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_SCHEMA)

    # The result goes back as a tool message; the model answers in text.
    history: Any = [*ASK, choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 22 C"}]
    r2 = client.chat.completions.create(model="starter", messages=history, tools=TOOLS,
                                        tool_choice="none", max_tokens=12, **GREEDY)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    assert r2.usage is not None and r2.usage.prompt_tokens > r.usage.prompt_tokens  # type: ignore


def test_openai_streamed_tool_call(client: openai.OpenAI) -> None:
    deltas: list[Any] = []
    finishes, text = [], []
    for chunk in client.chat.completions.create(
            model="starter", messages=ASK, tools=TOOLS, max_tokens=40, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY):
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            text.append(c.delta.content or "")
            if c.finish_reason:
                finishes.append(c.finish_reason)
    assert finishes == ["tool_calls"] and "".join(text) == ""  # the call syntax never leaks
    assert len(deltas) == 1 and deltas[0].function and deltas[0].id
    assert deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads(deltas[0].function.arguments or ""), WEATHER_SCHEMA)

    # The round trip, streamed: the call goes back with its result, the answer streams.
    call = {"id": deltas[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": deltas[0].function.arguments}}
    history: Any = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": deltas[0].id, "content": "Sunny, 22 C"}]
    answer, ends = [], []
    for chunk in client.chat.completions.create(model="starter", messages=history, tools=TOOLS,
                                                max_tokens=12, stream=True, **GREEDY):
        for c in chunk.choices:
            answer.append(c.delta.content or "")
            assert not c.delta.tool_calls
            if c.finish_reason:
                ends.append(c.finish_reason)
    assert "".join(answer) and ends in (["stop"], ["length"])


def test_anthropic_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    tools: Any = [{"name": "get_weather", "description": "Current weather for a city",
                   "input_schema": WEATHER_SCHEMA}]
    m = claude.messages.create(model="starter", max_tokens=40, tools=tools, messages=ASK,
                               system=[{"type": "text", "text": "You use tools."}],
                               tool_choice={"type": "any"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather"
    jsonschema.validate(use[0].input, WEATHER_SCHEMA)

    history: Any = [*ASK, {"role": "assistant", "content": m.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                  "content": "Sunny, 22 C"}]}]
    with claude.messages.stream(model="starter", max_tokens=12, tools=tools, messages=history,
                                tool_choice={"type": "none"}, extra_body=GREEDY) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed and final.content[0].type == "text" and final.content[0].text == streamed
    assert final.stop_reason in ("end_turn", "max_tokens")
    # The first turn's prompt came back from the prompt cache.
    assert final.usage.cache_read_input_tokens and final.usage.cache_read_input_tokens > 20

    with claude.messages.stream(model="starter", max_tokens=40, tools=tools, messages=ASK,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"]
    jsonschema.validate(final.content[0].input, WEATHER_SCHEMA)  # type: ignore[union-attr]


def test_anthropic_messages_stop_sequences_and_count(claude: anthropic.Anthropic,
                                                      starter: dict[str, Any]) -> None:
    ask: Any = [{"role": "user", "content": "What is the capital of France?"}]
    m = claude.messages.create(model="starter", max_tokens=16, messages=ask,
                               stop_sequences=[" Paris"], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " Paris"
    assert m.content[0].type == "text" and "Paris" not in m.content[0].text
    counted = claude.messages.count_tokens(model="starter", messages=ask)
    used = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == used
    tok = Tokenizer.load(Path(starter["path"]))
    assert counted.input_tokens == len(prompt_ids(tok, [{"role": "user",
                                                          "content": ask[0]["content"]}], []))


# -- structured output -----------------------------------------------------------------------
ANSWER = {"type": "object", "properties": {
    "answer": {"type": "string", "enum": ["yes", "no", "unsure"]},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 9},
    "topics": {"type": "array", "maxItems": 1, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
        "required": ["name"], "additionalProperties": False}}},
    "required": ["answer", "confidence", "topics"], "additionalProperties": False}
QUESTIONS = ["Is the sky blue?", "Is fire cold?", "Do fish swim?", "Is Paris in Spain?",
             "Can birds fly?", "Do cats bark?", "Is ice hot?", "Is the sun a star?",
             "Do trees walk?", "Is water wet?", "Can dogs read?", "Is the moon cheese?",
             "Do bees make honey?", "Is snow black?", "Are roses red?", "Can fish climb?",
             "Is gold a metal?", "Do cows fly?", "Is Rome in Italy?", "Are bananas blue?"]


def test_strict_json_schema_output_validates(client: openai.OpenAI, server: str) -> None:
    """20 prompts, sent together so they decode in one batch (each with its own mask and
    seed): every reply parses and validates."""
    fmt: Any = {"type": "json_schema",
                "json_schema": {"name": "answer", "strict": True, "schema": ANSWER}}

    def ask(i: int) -> Any:
        return client.chat.completions.create(
            model="starter", messages=[{"role": "user", "content": QUESTIONS[i] +
                                        " Answer in JSON."}],
            response_format=fmt, max_tokens=60, temperature=0.8, seed=i)

    assert len(QUESTIONS) == 20
    before = _batch(server)
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        replies = list(pool.map(ask, range(len(QUESTIONS))))
    for r in replies:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), ANSWER)
    after = _batch(server)
    steps, tokens = after["steps"] - before["steps"], after["tokens"] - before["tokens"]
    assert tokens > 3 * steps > 0, (before, after)  # they decoded together

    # json_object on the legacy endpoint too, and logprobs of what the mask allowed.
    r2 = client.completions.create(model="starter", prompt="A JSON object about a dog:",
                                   max_tokens=30, logprobs=2, temperature=0,
                                   extra_body={"response_format": {"type": "json_object"}})
    if r2.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r2.choices[0].text), dict)
    lp = r2.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert "".join(lp.tokens) == r2.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)


def test_chat_logprobs_and_seed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="starter", messages=ASK, max_tokens=5, logprobs=True,
                                       top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob)

    # A seed makes sampling at temperature 1 repeat itself.
    sampled = [client.chat.completions.create(model="starter", messages=ASK, max_tokens=6,
                                              temperature=1.0, seed=seed).choices[0]
               .message.content for seed in (7, 7, 8)]
    assert sampled[0] == sampled[1]


# -- Responses and embeddings ----------------------------------------------------------------
def test_responses_api(client: openai.OpenAI) -> None:
    r = client.responses.create(model="starter", input="What is the capital of France?",
                                instructions="Answer in one sentence.", max_output_tokens=12,
                                temperature=0)
    assert "Paris" in r.output_text and r.usage is not None and r.usage.output_tokens > 0
    kinds, deltas, done = [], [], None
    for ev in client.responses.create(model="starter", input=[{"role": "user", "content":
                                      "What is the capital of France?"}],
                                      instructions="Answer in one sentence.",
                                      max_output_tokens=12, temperature=0, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        if ev.type in ("response.completed", "response.incomplete"):
            done = ev.response
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert done is not None and "".join(deltas) == done.output_text == r.output_text


def test_embeddings_are_mean_pooled_unit_vectors(client: openai.OpenAI) -> None:
    e = client.embeddings.create(model="starter", input=["a cat sat on the mat", "a cat sat on "
                                 "the mat", "quarterly tax filing deadlines"])
    a, b, c = (d.embedding for d in e.data)
    assert len(a) == 576 and sum(x * x for x in a) == pytest.approx(1.0, abs=1e-4)
    same = sum(x * y for x, y in zip(a, b, strict=True))
    other = sum(x * y for x, y in zip(a, c, strict=True))
    assert same == pytest.approx(1.0, abs=1e-4) and other < same
    assert e.usage.prompt_tokens > 10


# -- refusals --------------------------------------------------------------------------------
def _raw_oversized(server: str) -> bytes:
    """A request announcing a 100 MB body: the answer must come before it is sent."""
    url = urlsplit(server)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                   f"{KEY}\r\nContent-Type: application/json\r\nContent-Length: {100 << 20}"
                   "\r\n\r\n{").encode())
        return s.recv(4096)


def _count(client: openai.OpenAI) -> str:
    """A streamed greedy completion that runs a few seconds (no early end of text)."""
    chunks = client.completions.create(model="starter", prompt="1, 2, 3, 4, 5, 6, 7,",
                                       max_tokens=24, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_hostile_bodies_are_refused_and_the_server_keeps_serving(
        client: openai.OpenAI, server: str) -> None:
    chat = f"{server}/chat/completions"
    alone = _count(client)
    beside: dict[str, str] = {}  # a stream decoding while the hostile bodies come in
    streaming = threading.Thread(target=lambda: beside.update(text=_count(client)))
    streaming.start()
    assert _raw_oversized(server).startswith(b"HTTP/1.1 413")

    code, body = _post(chat, b"[" * 100_000 + b"]" * 100_000)
    assert code == 400 and "nested too deep" in body["error"]["message"]

    t0 = time.monotonic()  # ten megabytes of text: refused before seconds of tokenizing
    ten_mb = [{"role": "user", "content": "a " * 5_000_000}]
    code, body = _post(chat, json.dumps({"messages": ten_mb, "max_tokens": 4}).encode())
    assert code == 400 and body["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 3

    with pytest.raises(openai.BadRequestError, match="unrecognized request argument"):
        client.chat.completions.create(model="starter", messages=ASK,  # type: ignore
                                       extra_body={"frobnicate": True})
    with pytest.raises(openai.BadRequestError, match="'n'"):
        client.chat.completions.create(model="starter", messages=ASK, n=2)  # type: ignore
    huge: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"k": {"enum": [f"v{i}" for i in range(50_000)]}}}}}
    deep: Any = {"type": "object"}
    for _ in range(45):
        deep = {"type": "object", "properties": {"a": deep}}
    endless: Any = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                    "required": ["next"]}}, "$ref": "#/$defs/n"}
    schemas: list[Any] = [huge["json_schema"]["schema"], deep, endless,
                          {"type": "object", "not": {}}]
    for schema in schemas:
        fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="starter", messages=ASK, max_tokens=8,
                                           response_format=fmt)
    code, body = _post(f"{server}/messages", json.dumps({"model": "starter", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}], "bogus": 1}).encode())
    assert code == 400 and body["type"] == "error" and "bogus" in body["error"]["message"]

    r = client.chat.completions.create(model="starter", messages=ASK, max_tokens=4, **GREEDY)
    assert r.choices[0].message.content
    streaming.join(120)
    assert beside.get("text") == alone  # undisturbed, token for token

"""OpenAI's Responses API (basic) and embeddings, over the same jobs as chat.

Contract: `routes(host, guarded)` gives POST /v1/responses and POST /v1/embeddings.
/v1/responses takes `input` (a string, or a list of role/content messages), `instructions`
(the system turn), `max_output_tokens`, sampling fields and `text.format` (json_object or
json_schema, enforced by a grammar), and answers a `response` object with one output message,
or with `stream` the Responses event sequence (response.created ... response.completed, each
with its sequence_number) that the `openai` client parses. Tools, `previous_response_id` and
stored responses are refused with a 400. /v1/embeddings returns, per input, the mean of the
model's last hidden states (after its final norm) over the input's tokens, scaled to unit
length: a chat model's states, not a trained embedding model's, useful for rough similarity
only. `encoding_format` float or base64 (little-endian float32, the openai client's default).
"""

from __future__ import annotations

import base64
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.runtime.generate import LoadedModel
from engine.server.exchange import Collected, Endpoint, Exchange, read_json, start_generation
from engine.server.host import MAX_CHARS_PER_TOKEN, CallJob, Host, RequestError, embed
from engine.server.params import (
    chat_messages,
    chat_prompt,
    max_tokens,
    model_of,
    response_grammar,
    sampling,
    text_size,
)
from engine.telemetry import GenerationEvent

RESPONSE_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature",
                   "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stream", "text",
                   "store", "metadata", "user", "tools", "tool_choice", "parallel_tool_calls",
                   "previous_response_id", "reasoning", "truncation", "service_tier",
                   "include", "prompt_cache_key", "safety_identifier", "stream_options"}
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}
MAX_INPUTS = 256


def _input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body.get("input")
    items: list[Any]
    if isinstance(raw, str):
        items = [{"role": "user", "content": raw}]
    elif isinstance(raw, list) and raw:
        items = []
        for i, item in enumerate(raw):
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise RequestError(f"input[{i}]: only message items are supported",
                                   param="input")
            items.append({"role": item.get("role"), "content": item.get("content")})
    else:
        raise RequestError("'input' must be a string or a non-empty list of messages",
                           param="input")
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise RequestError("'instructions' must be a string", param="instructions")
        items.insert(0, {"role": "system", "content": instructions})
    return chat_messages(items, param="input")


class _Response:
    """A Responses object and its stream events."""

    def __init__(self, model: str, body: dict[str, Any]) -> None:
        self.id = "resp_" + uuid.uuid4().hex
        self.item = "msg_" + uuid.uuid4().hex
        self.model, self.body = model, body
        self.created = int(time.time())
        self.seq = 0

    def obj(self, status: str, text: str | None, last: GenerationEvent | None) -> dict[str, Any]:
        b = self.body
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": [], "error": None, "incomplete_details": None,
            "instructions": b.get("instructions"), "max_output_tokens":
            b.get("max_output_tokens"), "metadata": b.get("metadata") or {},
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
            "text": b.get("text") or {"format": {"type": "text"}}, "usage": None}
        if text is not None:
            out["output"] = [self.message(text, "completed")]
        if last is not None:
            if last.finish_reason == "length":
                out["status"] = "incomplete"
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            out["usage"] = {
                "input_tokens": last.prompt_tokens,
                "input_tokens_details": {"cached_tokens": last.cached_tokens},
                "output_tokens": last.generated_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": last.prompt_tokens + last.generated_tokens}
        return out

    def message(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.item, "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def routes(host: Host, guarded: Callable[[Endpoint], Endpoint]) -> list[Route]:
    async def responses(request: Request) -> Response:
        body = await read_json(request, RESPONSE_FIELDS)
        model = model_of(host, body)
        for key in ("tools", "previous_response_id"):
            if body.get(key):
                raise RequestError(f"'{key}' is not supported on /v1/responses yet; use "
                                   "/v1/chat/completions", param=key)
        if body.get("store"):
            raise RequestError("stored responses are not supported ('store': false)",
                               param="store")
        messages = _input_messages(body)
        text_opts = body.get("text")
        fmt = text_opts.get("format") if isinstance(text_opts, dict) else None
        grammar = response_grammar(fmt, "text.format")
        started = await start_generation(
            request, host, model=model, prompt=chat_prompt(messages, []),
            params=sampling(body), max_tokens=max_tokens(body, None, ("max_output_tokens",)),
            prompt_param="input", grammar=grammar, chars=text_size(messages, []))
        if started is None:
            return Response(status_code=499)
        ex, first = started
        shape = _Response(first.model, body)
        if body.get("stream"):
            ex.streaming()
            return StreamingResponse(stream(shape, ex), media_type="text/event-stream")
        try:
            got: Collected | None = await ex.collect()
        finally:
            ex.close()
        if got is None:
            return Response(status_code=499)
        return JSONResponse(shape.obj("completed", got.text, got.last))

    async def stream(shape: _Response, ex: Exchange) -> AsyncIterator[str]:
        parts: list[str] = []
        ids = dict(item_id=shape.item, output_index=0, content_index=0)
        try:
            yield shape.event("response.created", response=shape.obj("in_progress", None, None))
            yield shape.event("response.in_progress",
                              response=shape.obj("in_progress", None, None))
            yield shape.event("response.output_item.added", output_index=0,
                              item=shape.message(None, "in_progress"))
            yield shape.event("response.content_part.added", **ids, part=shape.part(""))
            async for ev in ex.events():
                if not isinstance(ev, GenerationEvent):
                    continue
                if ev.text:
                    parts.append(ev.text)
                    yield shape.event("response.output_text.delta", **ids, delta=ev.text,
                                      logprobs=[])
                if ev.finish_reason is None:
                    continue
                text = "".join(parts)
                yield shape.event("response.output_text.done", **ids, text=text, logprobs=[])
                yield shape.event("response.content_part.done", **ids, part=shape.part(text))
                yield shape.event("response.output_item.done", output_index=0,
                                  item=shape.message(text, "completed"))
                done = shape.obj("completed", text, ev)
                kind = "response.completed" if done["status"] == "completed" \
                    else "response.incomplete"
                yield shape.event(kind, response=done)
        except RequestError as exc:
            yield shape.event("error", code=exc.code, message=str(exc), param=exc.param)
        finally:
            ex.close()

    async def embeddings(request: Request) -> Response:
        body = await read_json(request, EMBEDDING_FIELDS)
        model = model_of(host, body)
        if body.get("dimensions") is not None:
            raise RequestError("'dimensions' is not supported (the model's width is fixed)",
                               param="dimensions")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise RequestError("'encoding_format' must be 'float' or 'base64'",
                               param="encoding_format")
        raw = body.get("input")
        if isinstance(raw, str) or (isinstance(raw, list) and raw
                                    and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        if not isinstance(raw, list) or not raw or len(raw) > MAX_INPUTS or not all(
                (isinstance(x, str) and x) or (isinstance(x, list) and x and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in x)) for x in raw):
            raise RequestError(f"'input' must be a non-empty string, a list of token ids, or a "
                               f"list of at most {MAX_INPUTS} of them", param="input")
        inputs: list[str | list[int]] = raw

        def run(lm: LoadedModel) -> tuple[list[list[float]], int]:
            tok, vectors, count = lm.tokenizer, [], 0
            for x in inputs:
                if isinstance(x, str) and len(x) > lm.context_length * MAX_CHARS_PER_TOKEN:
                    raise RequestError(f"an input has {len(x):,} characters: far past this "
                                       f"model's {lm.context_length}-token context",
                                       code="context_length_exceeded", param="input")
                ids = tok.encode(x) if isinstance(x, str) else list(x)
                if any(not 0 <= t < tok.vocab_size for t in ids):
                    raise RequestError("'input' has token ids outside the vocabulary",
                                       param="input")
                vectors.append(embed(lm, ids))
                count += len(ids)
            return vectors, count

        ex = Exchange(request, host, lambda emit: CallJob(model, run, emit))
        try:
            got = await ex.result()
        finally:
            ex.close()
        if got is None:
            return Response(status_code=499)
        vectors, count = got

        def encode(v: list[float]) -> Any:
            if fmt == "float":
                return v
            return base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()

        return JSONResponse({
            "object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": count, "total_tokens": count}})

    return [Route("/v1/responses", guarded(responses), methods=["POST"]),
            Route("/v1/embeddings", guarded(embeddings), methods=["POST"])]

"""Anthropic's Messages API over the same jobs as OpenAI's chat (named so as not to shadow the
`anthropic` package).

Contract: `routes(host, api_key)` gives POST /v1/messages and POST /v1/messages/count_tokens.
Messages takes `system` (a string or text blocks), multi-turn `messages` whose content is a
string or blocks (text, tool_use, tool_result), `tools` (name, description, input_schema) and
`tool_choice` (auto, any, tool, none: any/tool force one valid call by grammar), `max_tokens`,
`stop_sequences`, sampling fields, and `stream`. It answers a `message` with text and
tool_use blocks, `stop_reason` (end_turn, max_tokens, stop_sequence, tool_use) and `usage`
whose `cache_read_input_tokens` are the prompt tokens the prefix cache gave (input_tokens are
the rest, as Anthropic counts), or with `stream` Anthropic's events: message_start,
content_block_start/delta/stop (text_delta, input_json_delta), ping, message_delta,
message_stop. `output_config.format` (json_schema) constrains the reply as OpenAI's
response_format does. count_tokens answers {"input_tokens"} for the prompt the same request would
prefill. Errors have Anthropic's shape {"type": "error", "error": {"type", "message"}}. The
API key may come as `x-api-key` (Anthropic's clients) or a Bearer token.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.runtime.generate import LoadedModel
from engine.server.exchange import Exchange, guard, read_json, start_generation, with_retry
from engine.server.host import MAX_CHARS_PER_TOKEN, CallJob, Host, RequestError, TokenLogprob
from engine.server.params import (
    chat_prompt,
    max_tokens,
    model_of,
    response_grammar,
    sampling,
    stop_strings,
    text_size,
)
from engine.server.tools import Tool, ToolCall, ToolUse, make_tool
from engine.telemetry import GenerationEvent

# Fields of the API as the 2026 client sends them (temperature and friends: older clients).
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers",
                "cache_control", "output_config", "diagnostics", "inference_geo", "speed",
                "user_profile_id", "workspace_id", "context_management", "output_format"}
MESSAGE_FIELDS = COUNT_FIELDS | {"max_tokens", "stop_sequences", "stream", "temperature",
                                 "top_p", "top_k", "metadata", "service_tier", "container"}
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error"}


def error_response(exc: RequestError) -> JSONResponse:
    kind = _KINDS.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": str(exc)}},
                        status_code=exc.status, headers=with_retry(exc))


# -- the request ---------------------------------------------------------------------------
def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of blocks", param=where)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") not in (
                "text", "tool_use", "tool_result", "thinking", "redacted_thinking"):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise RequestError(f"{where}.content[{j}]: {kind!r} blocks are not supported "
                               "(text, tool_use and tool_result are)", param=where)
    return content


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b["text"] for b in _blocks(content, where) if b["type"] == "text")


def messages_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic's system + messages as engine.server.params' role/content dicts."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _result_text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    names: dict[str, str] = {}
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise RequestError(f"{where} must have the role 'user' or 'assistant'", param=where)
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for b in _blocks(m.get("content"), where):
            if b["type"] == "text":
                if not isinstance(b.get("text"), str):
                    raise RequestError(f"{where}: a text block needs 'text'", param=where)
                texts.append(b["text"])
            elif b["type"] == "tool_use" and m["role"] == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input"), dict):
                    raise RequestError(f"{where}: tool_use needs 'name' and an 'input' object",
                                       param=where)
                cid = str(b.get("id") or f"toolu_{i}_{len(calls)}")
                names[cid] = b["name"]
                calls.append({"id": cid, "name": b["name"], "arguments": b["input"]})
            elif b["type"] == "tool_result" and m["role"] == "user":
                cid = str(b.get("tool_use_id") or "")
                text = _result_text(b.get("content"), where)
                if b.get("is_error"):
                    text = f"Error: {text}"
                out.append({"role": "tool", "content": text, "tool_call_id": cid,
                            "name": names.get(cid, "")})
            elif b["type"] in ("tool_use", "tool_result"):
                raise RequestError(f"{where}: {b['type']} blocks belong to the "
                                   f"{'assistant' if b['type'] == 'tool_use' else 'user'}",
                                   param=where)
        if texts or calls or m["role"] == "assistant":
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def tools_of(body: dict[str, Any]) -> ToolUse:
    raw = body.get("tools")
    tools: list[Tool] = []
    if raw is not None:
        if not isinstance(raw, list) or len(raw) > 128:
            raise RequestError("'tools' must be a list of at most 128 tools", param="tools")
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
                raise RequestError(f"tools[{i}]: only client tools (name, input_schema) are "
                                   "supported", param="tools")
            tools.append(make_tool(t.get("name"), t.get("description"), t.get("input_schema"),
                                   f"tools[{i}]"))
    choice = body.get("tool_choice")
    if choice is None:
        return ToolUse(tools, "auto" if tools else "none")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        name = choice.get("name")
        if name not in {t.name for t in tools}:
            raise RequestError(f"'tool_choice' names {name!r}, which is not in 'tools'",
                               param="tool_choice")
        return ToolUse(tools, str(name))
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if mapped is None:
        raise RequestError("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'",
                           param="tool_choice")
    if mapped == "required" and not tools:
        raise RequestError("'tool_choice' any needs 'tools'", param="tool_choice")
    return ToolUse(tools, mapped if tools else "none")


def output_grammar(body: dict[str, Any]) -> str | None:
    """output_config.format ({type: json_schema, schema}) as a grammar."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise RequestError("'output_config' must be an object", param="output_config")
    fmt = (config or {}).get("format", body.get("output_format"))  # the older spelling
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise RequestError("'output_config.format.type' must be 'json_schema'",
                           param="output_config")
    return response_grammar(fmt, "output_config.format")


def _refuse(body: dict[str, Any]) -> None:
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise RequestError("extended thinking is not supported", param="thinking")
    if body.get("mcp_servers") or body.get("container"):
        raise RequestError("MCP servers and containers are not supported", param="mcp_servers")


# -- the reply -----------------------------------------------------------------------------
def _usage(ev: GenerationEvent, output: int | None = None) -> dict[str, Any]:
    return {"input_tokens": ev.prompt_tokens - ev.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": ev.cached_tokens,
            "output_tokens": ev.generated_tokens if output is None else output}


def _tool_block(c: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name,
            "input": c.arguments}


def _stop(ev: GenerationEvent, stops: tuple[str, ...], generated: str,
          calls: list[ToolCall] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). A stop string ends on a sampled token (EOS: none)."""
    if calls:
        return "tool_use", None
    if ev.finish_reason == "length":
        return "max_tokens", None
    if stops and ev.token is not None:
        if len(stops) == 1:
            return "stop_sequence", stops[0]
        hits = [(generated.find(s), s) for s in stops if s in generated]
        return "stop_sequence", min(hits)[1] if hits else stops[0]
    return "end_turn", None


def _event(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def routes(host: Host, api_key: str | None) -> list[Route]:
    guarded = guard(api_key, error_response)

    async def messages(request: Request) -> Response:
        body = await read_json(request, MESSAGE_FIELDS)
        model = model_of(host, body)
        _refuse(body)
        if body.get("max_tokens") is None:
            raise RequestError("'max_tokens' is required", param="max_tokens")
        msgs = messages_of(body)
        use = tools_of(body)
        stops = stop_strings(body, "stop_sequences")
        fmt = output_grammar(body)
        started = await start_generation(
            request, host, model=model, prompt=chat_prompt(msgs, use.tools, use.seen),
            params=sampling(body), max_tokens=max_tokens(body, None, ("max_tokens",)),
            stop=stops, grammar=lambda tok: use.grammar(tok) or fmt,
            chars=text_size(msgs, use.tools),
            logprobs=0 if len(stops) > 1 else None)  # its token texts name the stop hit
        if started is None:
            return Response(status_code=499)
        ex, first = started
        mid = "msg_" + uuid.uuid4().hex
        if body.get("stream"):
            ex.streaming()
            return StreamingResponse(stream(ex, mid, first.model, first.prompt_tokens, use,
                                            stops), media_type="text/event-stream")
        try:
            got = await ex.collect()
        finally:
            ex.close()
        if got is None:
            return Response(status_code=499)
        content, calls = use.parse(got.text)
        blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
        blocks += [_tool_block(c) for c in calls or ()]
        reason, seq = _stop(got.last, stops, "".join(lp.token for lp in got.logprobs), calls)
        return JSONResponse({"id": mid, "type": "message", "role": "assistant",
                             "model": first.model, "content": blocks, "stop_reason": reason,
                             "stop_sequence": seq, "usage": _usage(got.last)})

    async def stream(ex: Exchange, mid: str, model: str, prompt_tokens: int, use: ToolUse,
                     stops: tuple[str, ...]) -> AsyncIterator[str]:
        calls = use.stream() if use.active else None
        index, text_open, generated = 0, False, []
        try:
            yield _event("message_start", message={
                "id": mid, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}})
            yield _event("ping")
            async for ev in ex.events():
                if isinstance(ev, TokenLogprob):
                    generated.append(ev.token)
                    continue
                texts = [calls.feed(ev.text) if calls is not None else ev.text]
                found = None
                if ev.finish_reason is not None and calls is not None:
                    rest, found = calls.finish()
                    texts.append(rest)
                for text in texts:
                    if not text:
                        continue
                    if not text_open:
                        text_open = True
                        yield _event("content_block_start", index=index,
                                     content_block={"type": "text", "text": ""})
                    yield _event("content_block_delta", index=index,
                                 delta={"type": "text_delta", "text": text})
                if ev.finish_reason is None:
                    continue
                if text_open:
                    yield _event("content_block_stop", index=index)
                    index += 1
                for c in found or ():
                    block = _tool_block(c)
                    yield _event("content_block_start", index=index,
                                 content_block={**block, "input": {}})
                    yield _event("content_block_delta", index=index, delta={
                        "type": "input_json_delta", "partial_json": json.dumps(c.arguments)})
                    yield _event("content_block_stop", index=index)
                    index += 1
                reason, seq = _stop(ev, stops, "".join(generated), found)
                yield _event("message_delta", delta={"stop_reason": reason,
                                                     "stop_sequence": seq},
                             usage=_usage(ev))
                yield _event("message_stop")
        except RequestError as exc:
            yield _event("error", error={"type": _KINDS.get(exc.status, "api_error"),
                                         "message": str(exc)})
        finally:
            ex.close()

    async def count_tokens(request: Request) -> Response:
        body = await read_json(request, COUNT_FIELDS)
        model = model_of(host, body)
        _refuse(body)
        msgs = messages_of(body)
        use = tools_of(body)
        build = chat_prompt(msgs, use.tools)
        chars = text_size(msgs, use.tools)

        def count(lm: LoadedModel) -> int:
            if chars > lm.context_length * MAX_CHARS_PER_TOKEN:  # not worth seconds of work
                raise RequestError(f"the request has {chars:,} characters: far past this "
                                   f"model's {lm.context_length}-token context",
                                   code="context_length_exceeded", param="messages")
            return len(build(lm.tokenizer))

        ex = Exchange(request, host, lambda emit: CallJob(model, count, emit))
        try:
            n = await ex.result()
        finally:
            ex.close()
        if n is None:
            return Response(status_code=499)
        return JSONResponse({"input_tokens": n})

    return [Route("/v1/messages", guarded(messages), methods=["POST"]),
            Route("/v1/messages/count_tokens", guarded(count_tokens), methods=["POST"])]

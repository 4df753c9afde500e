"""The server's HTTP side: OpenAI's API over a `Host`, with Anthropic's beside it.

Contract: `create_app(host, api_key)` is a Starlette app with GET /v1/models, POST
/v1/chat/completions, POST /v1/completions (JSON, or server-sent events with `stream`), GET
/v1/strata/status (queue depth, caches), /v1/responses and /v1/embeddings
(engine.server.responses) and Anthropic's /v1/messages (engine.server.anthropic_api). Chat takes
`tools`/`tool_choice` (engine.server.tools: calls parsed from the model's own syntax; required
or named choices forced by a grammar), `response_format` json_object/json_schema (constrained
decoding, engine.runtime.grammar) and `logprobs`; both endpoints refuse unknown fields. Every
OpenAI error has OpenAI's shape {"error": {"message", "type", "param", "code"}} and status.
With an API key set, each request needs `Authorization: Bearer KEY` (or `x-api-key`). A request
whose client goes away is cancelled: dropped from the queue, or stopped between tokens.
`serve(...)` binds, loads the model on the engine thread, announces the address and runs
uvicorn until stopped. This module imports Starlette and uvicorn: import it only to serve.
"""

from __future__ import annotations

import ipaddress
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.errors import StrataError
from engine.runtime.batch import MAX_ROWS
from engine.runtime.tokenizer import Tokenizer
from engine.server.anthropic_api import routes as anthropic_routes
from engine.server.exchange import (
    Collected,
    Exchange,
    error_response,
    guard,
    read_json,
    start_generation,
)
from engine.server.host import MAX_QUEUE, EngineHost, Host, RequestError, TokenLogprob
from engine.server.params import (
    chat_messages,
    chat_prompt,
    max_tokens,
    model_of,
    response_grammar,
    sampling,
    stop_strings,
    text_size,
    top_logprobs,
)
from engine.server.responses import routes as openai_extra_routes
from engine.server.tools import ToolCall, ToolUse, parse_tool_choice, parse_tools
from engine.telemetry import GenerationEvent

DEFAULT_PORT = 8765
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
QUEUE_HEADER = "X-Strata-Queue-Depth"


# -- the OpenAI request ------------------------------------------------------------------------
_COMMON = {"model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens",
           "stop", "stream", "stream_options", "seed", "n", "logprobs", "user", "metadata",
           "frequency_penalty", "presence_penalty", "logit_bias", "response_format", "store",
           "service_tier", "prompt_cache_key", "safety_identifier"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                         "tool_choice", "parallel_tool_calls", "reasoning_effort", "modalities",
                         "verbosity", "functions", "function_call", "prediction", "audio",
                         "web_search_options"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or "" (all interfaces): treat as exposed


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("n") not in (None, 1):
        raise RequestError("only 'n': 1 is supported (send n requests instead)", param="n")
    if body.get("best_of") not in (None, 1):
        raise RequestError("only 'best_of': 1 is supported", param="best_of")
    if body.get("logit_bias"):
        raise RequestError("'logit_bias' is not supported", param="logit_bias")
    if body.get("functions") or body.get("function_call"):
        raise RequestError("'functions' is the deprecated form: send 'tools'", param="functions")
    if body.get("modalities") not in (None, ["text"]) or body.get("audio"):
        raise RequestError("only text output is supported", param="modalities")


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
        raise RequestError("'logprobs' must be true or false", param="logprobs")
    top = body.get("top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if not body.get("logprobs"):
        return None
    return top_logprobs(top or 0, "top_logprobs")


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    value = body.get("logprobs")
    return None if value is None else top_logprobs(value, "logprobs")


def text_prompt(prompt: Any) -> tuple[Callable[[Tokenizer], list[int]], int]:
    """A completion prompt's builder, and its characters."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text = prompt
        return (lambda tok: tok.encode(text)), len(text)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)

        def build(tok: Tokenizer) -> list[int]:
            if not all(0 <= t < tok.vocab_size for t in ids):
                raise RequestError(f"'prompt' has token ids outside 0..{tok.vocab_size - 1}",
                                   param="prompt")
            return ids

        return build, 0
    raise RequestError("'prompt' must be a string or a list of token ids (one prompt a request)",
                       param="prompt")


# -- response shapes -------------------------------------------------------------------------
def usage(ev: GenerationEvent) -> dict[str, Any]:
    # Speculative decoding's drafts in OpenAI's own fields (its Predicted Outputs' counts).
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.generated_tokens,
            "total_tokens": ev.prompt_tokens + ev.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
            "completion_tokens_details": {
                "accepted_prediction_tokens": ev.accepted_tokens,
                "rejected_prediction_tokens": ev.drafted_tokens - ev.accepted_tokens}}


def finish(ev: GenerationEvent) -> str:
    return "length" if ev.finish_reason == "length" else "stop"


def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes,
            "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, v, b in lp.top]}


class _Shape:
    """The JSON of one request's responses, chat or text completion."""

    def __init__(self, chat: bool, model: str, logprobs: bool = False) -> None:
        self.chat, self.model, self.logprobs = chat, model, logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.offset = 0  # text offset, for completions' logprobs

    def _base(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def scores(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return {"content": [_chat_logprob(lp) for lp in lps], "refusal": None}
        offsets = []
        for lp in lps:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{t: v for t, v, _ in lp.top} for lp in lps],
                "text_offset": offsets}

    def whole(self, got: Collected, content: str | None = None,
              calls: list[ToolCall] | None = None) -> dict[str, Any]:
        last = got.last
        reason = "tool_calls" if calls else finish(last)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant",
                                       "content": got.text if content is None else content}
            if calls:
                message["content"] = message["content"] or None
                message["tool_calls"] = [c.openai() for c in calls]
            choice = {"index": 0, "message": message, "logprobs": self.scores(got.logprobs),
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": got.text, "logprobs": self.scores(got.logprobs),
                      "finish_reason": reason}
        obj = self._base("chat.completion" if self.chat else "text_completion", [choice])
        obj["usage"] = usage(last)
        return obj

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False,
              usage: dict[str, Any] | None = None, with_usage: bool = False,
              lps: list[TokenLogprob] | None = None,
              calls: list[ToolCall] | None = None) -> str:
        if usage is not None:
            choices: list[dict[str, Any]] = []
        elif self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})
            if calls:
                delta["tool_calls"] = [{"index": i, **c.openai()} for i, c in enumerate(calls)]
            choices = [{"index": 0, "delta": delta, "logprobs": self.scores(lps or []),
                        "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": self.scores(lps or []),
                        "finish_reason": finish}]
        obj = self._base("chat.completion.chunk" if self.chat else "text_completion", choices)
        if with_usage:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_error(exc: RequestError) -> str:
    err = {"message": str(exc), "type": exc.kind, "param": exc.param, "code": exc.code}
    return f"data: {json.dumps({'error': err})}\n\n"


# -- the app -------------------------------------------------------------------------------
def create_app(host: Host, api_key: str | None = None) -> Starlette:
    guarded = guard(api_key)

    def model_card(m: dict[str, Any]) -> dict[str, Any]:
        try:
            created = int(Path(m["path"]).stat().st_mtime)
        except (OSError, KeyError):
            created = 0
        return {"id": m["name"], "object": "model", "created": created, "owned_by": "strata",
                "aliases": m.get("aliases", []), "context_length": m.get("context_length")}

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(m) for m in host.manifests()]})

    async def get_model(request: Request) -> Response:
        return JSONResponse(model_card(host.resolve(request.path_params["model"])))

    async def status(request: Request) -> Response:
        return JSONResponse({"default_model": host.default_model, **host.status()})

    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, CHAT_FIELDS)
        model = model_of(host, body)
        _refuse_unsupported(body)
        messages = chat_messages(body.get("messages"))
        tools = parse_tools(body.get("tools"))
        use = ToolUse(tools, parse_tool_choice(body.get("tool_choice"), tools))
        fmt = response_grammar(body.get("response_format"))
        return await complete(request, body, model, chat_prompt(messages, tools, use.seen),
                              text_size(messages, tools), chat=True, use=use,
                              grammar=lambda tok: use.grammar(tok) or fmt,
                              logprobs=_chat_logprobs(body))

    async def completions(request: Request) -> Response:
        body = await read_json(request, COMPLETION_FIELDS)
        model = model_of(host, body)
        _refuse_unsupported(body)
        if body.get("echo") or body.get("suffix"):
            raise RequestError("'echo' and 'suffix' are not supported", param="echo")
        if "prompt" not in body:
            raise RequestError("'prompt' is required", param="prompt")
        prompt, chars = text_prompt(body["prompt"])
        return await complete(request, body, model, prompt, chars, chat=False, use=None,
                              grammar=response_grammar(body.get("response_format")),
                              logprobs=_completion_logprobs(body))

    async def complete(request: Request, body: dict[str, Any], model: str,
                       prompt: Callable[[Tokenizer], list[int]], chars: int, chat: bool,
                       use: ToolUse | None, grammar: Any, logprobs: int | None) -> Response:
        params = sampling(body)
        limit = max_tokens(body, None if chat else COMPLETIONS_MAX_TOKENS)
        stop = stop_strings(body)
        stream = bool(body.get("stream"))
        opts = body.get("stream_options")
        include_usage = stream and isinstance(opts, dict) and bool(opts.get("include_usage"))
        started = await start_generation(
            request, host, model=model, prompt=prompt, params=params, max_tokens=limit,
            stop=stop, prompt_param="messages" if chat else "prompt", grammar=grammar,
            logprobs=logprobs, chars=chars)
        if started is None:
            return Response(status_code=499)
        ex, first = started
        headers = {QUEUE_HEADER: str(ex.depth)}
        shape = _Shape(chat, first.model, logprobs is not None)
        if stream:
            ex.streaming()
            return StreamingResponse(sse(shape, ex, use, include_usage), headers=headers,
                                     media_type="text/event-stream")
        try:
            got = await ex.collect()
        except RequestError as exc:
            return error_response(exc, headers)
        finally:
            ex.close()
        if got is None:
            return Response(status_code=499)
        if use is not None and use.active:
            content, calls = use.parse(got.text)
            return JSONResponse(shape.whole(got, content, calls), headers=headers)
        return JSONResponse(shape.whole(got), headers=headers)

    async def sse(shape: _Shape, ex: Exchange, use: ToolUse | None,
                  include_usage: bool) -> AsyncIterator[str]:
        calls = use.stream() if use is not None and use.active else None
        lps: list[TokenLogprob] = []
        try:
            if shape.chat:
                yield shape.chunk(None, role=True, with_usage=include_usage)
            async for ev in ex.events():
                if isinstance(ev, TokenLogprob):
                    lps.append(ev)
                    continue
                text = calls.feed(ev.text) if calls is not None else ev.text
                if text or (lps and calls is None):
                    yield shape.chunk(text, with_usage=include_usage, lps=lps)
                    lps = []
                if ev.finish_reason is None:
                    continue
                found = None
                if calls is not None:
                    rest, found = calls.finish()
                    if rest:
                        yield shape.chunk(rest, with_usage=include_usage, lps=lps)
                        lps = []
                if found:
                    yield shape.chunk(None, with_usage=include_usage, calls=found, lps=lps)
                yield shape.chunk(None, finish="tool_calls" if found else finish(ev),
                                  with_usage=include_usage)
                if include_usage:
                    yield shape.chunk(None, usage=usage(ev), with_usage=True)
            yield "data: [DONE]\n\n"
        except RequestError as exc:
            yield sse_error(exc)
        finally:
            ex.close()  # a client that went away (or a server stopping) frees the slot

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = (f"no route {request.method} {request.url.path}"
                   if status in (404, 405) else "internal error")
        return error_response(RequestError(message, status=status,
                                           kind="invalid_request_error" if status < 500
                                           else "server_error"))

    routes = [
        Route("/v1/models", guarded(list_models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(get_model), methods=["GET"]),
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/strata/status", guarded(status), methods=["GET"]),
        *openai_extra_routes(host, guarded),
        *anthropic_routes(host, api_key),
    ]
    # Exception: a bug still answers in OpenAI's shape (Starlette logs the traceback).
    return Starlette(routes=routes,
                     exception_handlers={HTTPException: http_error, Exception: http_error})


# -- serving -------------------------------------------------------------------------------
def bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        raise StrataError(f"cannot listen on {host or '*'}:{port} ({exc.strerror or exc})") \
            from exc
    return sock


# Seconds a SIGTERM'd server has to finish its shutdown (cancel streams, close the stores,
# interpreter teardown) before it exits anyway: once, in CI, an exit took over 15 s after the
# request traffic had ended, and a service manager's stop must not wait on a hang.
STOP_GRACE_S = 10.0


def exit_later(code: int, after: float) -> threading.Timer:
    """A daemon timer that dumps every thread's stack to stderr (the cause of a hang) and
    exits the process with `code` after `after` seconds, unless the process is gone by then.
    The stores write pages atomically, so an exit mid-write loses only the pages in flight."""
    def hard_exit() -> None:
        import faulthandler
        import os
        import sys

        print(f"strata: shutdown took over {after:g} s; exiting anyway", file=sys.stderr)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(after, hard_exit)
    timer.daemon = True
    timer.start()
    return timer


def _stop_within(grace: float) -> Callable[[int, Any], None]:
    """A SIGTERM handler: stop as Ctrl-C stops (KeyboardInterrupt, exit status 130), and exit
    130 after `grace` seconds whatever the shutdown is waiting for."""
    def handler(signum: int, frame: Any) -> None:
        exit_later(130, grace)
        raise KeyboardInterrupt

    return handler


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT, model: str = "starter",
          api_key: str | None = None, caches_per_model: int = 4,
          announce: Callable[[str], None] = print, max_batch: int = MAX_ROWS,
          max_queue: int = MAX_QUEUE) -> int:
    """Serve until interrupted (Ctrl-C or SIGTERM, which raise KeyboardInterrupt here).

    Refuses a non-loopback address without an API key. The engine runs on this (the main)
    thread and HTTP on another, so that MLX's work stays on the main thread. Up to
    `max_batch` requests decode together; past `max_queue` waiting, a request gets a 429.
    """
    if not is_loopback(host) and not api_key:
        raise StrataError(f"serving on {host or 'all interfaces'} exposes the model to the "
                          "network: set --api-key or STRATA_API_KEY")
    engine = EngineHost(caches_per_model=caches_per_model, max_batch=max_batch,
                        max_queue=max_queue)
    name = str(engine.library.get(model)["name"])  # an unknown model fails before binding
    sock = bind(host, port)
    config = uvicorn.Config(create_app(engine, api_key), log_level="warning", access_log=False,
                            lifespan="off", loop="asyncio", http="h11", ws="none",
                            timeout_graceful_shutdown=3)
    server = uvicorn.Server(config)

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            engine.stop()  # should HTTP die on its own, the engine loop ends too

    web = threading.Thread(target=http, name="strata-http", daemon=True)

    def ready() -> None:
        web.start()
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        announce(f"serving {name} at http://{shown}:{bound_port}/v1")

    previous = signal.signal(signal.SIGTERM, _stop_within(STOP_GRACE_S))
    try:
        engine.run(preload=name, ready=ready)
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.stop()
        server.should_exit = True
        if web.is_alive():
            web.join(5)  # let cancelled streams send their last chunk
        sock.close()
    return 0

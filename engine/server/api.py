"""The server's HTTP side: OpenAI's chat and text completion API over a `Host`.

Contract: `create_app(host, api_key)` is a Starlette app with GET /v1/models, POST
/v1/chat/completions, POST /v1/completions (JSON, or server-sent events with `stream`) and
GET /v1/strata/status (queue depth, caches). Every error has OpenAI's shape
{"error": {"message", "type", "param", "code"}} and status. With an API key set, each request
needs `Authorization: Bearer KEY` (compared in constant time). A request whose client goes
away is cancelled: dropped from the queue, or stopped between tokens. `serve(...)` binds,
loads the model on the engine thread, announces the address and runs uvicorn until stopped.
This module imports Starlette and uvicorn: import it only to serve.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.errors import StrataError
from engine.runtime.sampling import SamplingParams
from engine.runtime.tokenizer import Tokenizer
from engine.server.host import EngineHost, GenerationJob, Host, JobEvent, RequestError, Started
from engine.telemetry import GenerationEvent

DEFAULT_PORT = 8765
MAX_BODY = 64 << 20  # a million-token prompt is a few MB of text; refuse anything far past it
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
QUEUE_HEADER = "X-Strata-Queue-Depth"
_GONE = None  # put on a request's event queue when its client disconnects

Endpoint = Callable[[Request], Awaitable[Response]]


# -- errors and auth -----------------------------------------------------------------------
def error_response(exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": str(exc), "type": exc.kind, "param": exc.param,
                      "code": exc.code}}
    return JSONResponse(body, status_code=exc.status, headers=headers)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or "" (all interfaces): treat as exposed


def _authorized(request: Request, key: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = ""
    return hmac.compare_digest(token.strip().encode(), key.encode())


# -- request parsing -----------------------------------------------------------------------
async def _json_body(request: Request) -> dict[str, Any]:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise RequestError(f"request body is over {MAX_BODY >> 20} MB", status=413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def _number(body: dict[str, Any], key: str, default: float, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise RequestError(f"'{key}' must be {'an integer' if integer else 'a number'}",
                           param=key)
    return value


def _sampling(body: dict[str, Any]) -> SamplingParams:
    for key in ("frequency_penalty", "presence_penalty"):
        if _number(body, key, 0.0) != 0:
            raise RequestError(f"'{key}' is not supported; use 'repetition_penalty'", param=key)
    seed = body.get("seed")
    if seed is not None:
        seed = _number(body, "seed", 0, integer=True)
    params = SamplingParams(
        temperature=float(_number(body, "temperature", 1.0)),
        top_p=float(_number(body, "top_p", 1.0)),
        top_k=int(_number(body, "top_k", 0, integer=True)),
        min_p=float(_number(body, "min_p", 0.0)),
        repetition_penalty=float(_number(body, "repetition_penalty", 1.0)),
        seed=seed,
    )
    try:
        return params.validate()
    except StrataError as exc:
        raise RequestError(str(exc)) from exc


def _max_tokens(body: dict[str, Any], default: int | None) -> int | None:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    value = _number(body, key, 0, integer=True) if body.get(key) is not None else default
    if value is not None and value < 1:
        raise RequestError(f"'{key}' must be at least 1", param=key)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
        raise RequestError("'stop' must be a string or a list of at most 16 strings",
                           param="stop")
    return tuple(s for s in stop if s)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("n") not in (None, 1):
        raise RequestError("only 'n': 1 is supported", param="n")
    if body.get("logprobs") or body.get("top_logprobs"):
        raise RequestError("'logprobs' is not supported", param="logprobs")
    if body.get("tools") or body.get("functions"):
        raise RequestError("tool calls are not supported yet", param="tools")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise RequestError("only the 'text' response format is supported",
                           param="response_format")


def chat_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """OpenAI messages to the plain role/content dicts that chat templates expect."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"{param} must be an object with a 'role'", param=param)
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"{param} has an unknown role {m['role']!r}", param=param)
        content = m.get("content")
        if content is None:
            text = ""  # an assistant turn that only called tools
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise RequestError(f"{param}: only text content parts are supported",
                                       param=param)
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise RequestError(f"{param}.content must be a string or a list of parts",
                               param=param)
        out.append({"role": role, "content": text})
    return out


def chat_prompt(messages: list[dict[str, str]]) -> Callable[[Tokenizer], list[int]]:
    def build(tok: Tokenizer) -> list[int]:
        from jinja2.exceptions import TemplateError

        try:
            return tok.encode_chat(messages)
        except TemplateError as exc:  # e.g. a template that insists roles alternate
            raise RequestError(f"the model's chat template refused the messages: {exc}",
                               param="messages") from exc

    return build


def text_prompt(prompt: Any) -> Callable[[Tokenizer], list[int]]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text = prompt
        return lambda tok: tok.encode(text)
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)

        def build(tok: Tokenizer) -> list[int]:
            if not all(0 <= t < tok.vocab_size for t in ids):
                raise RequestError(f"'prompt' has token ids outside 0..{tok.vocab_size - 1}",
                                   param="prompt")
            return ids

        return build
    raise RequestError("'prompt' must be a string or a list of token ids (one prompt a request)",
                       param="prompt")


# -- response shapes -------------------------------------------------------------------------
def _usage(ev: GenerationEvent) -> dict[str, Any]:
    return {"prompt_tokens": ev.prompt_tokens, "completion_tokens": ev.generated_tokens,
            "total_tokens": ev.prompt_tokens + ev.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": ev.cached_tokens}}


def _finish(ev: GenerationEvent) -> str:
    return "length" if ev.finish_reason == "length" else "stop"


class _Shape:
    """The JSON of one request's responses, chat or text completion."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _base(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def whole(self, text: str, last: GenerationEvent) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": _finish(last)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": _finish(last)}
        obj = self._base("chat.completion" if self.chat else "text_completion", [choice])
        obj["usage"] = _usage(last)
        return obj

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False,
              usage: dict[str, Any] | None = None, with_usage: bool = False) -> str:
        if usage is not None:
            choices: list[dict[str, Any]] = []
        elif self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text else {})
            choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": None,
                        "finish_reason": finish}]
        obj = self._base("chat.completion.chunk" if self.chat else "text_completion", choices)
        if with_usage:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# -- the app -------------------------------------------------------------------------------
def create_app(host: Host, api_key: str | None = None) -> Starlette:
    def guarded(fn: Endpoint) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            if api_key and not _authorized(request, api_key):
                return error_response(
                    RequestError("missing or wrong API key: send 'Authorization: Bearer KEY'",
                                 status=401, code="invalid_api_key"),
                    headers={"WWW-Authenticate": "Bearer"})
            try:
                return await fn(request)
            except RequestError as exc:
                return error_response(exc)

        return endpoint

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

    def model_of(body: dict[str, Any]) -> str:
        name = body.get("model")
        if name is not None and not isinstance(name, str):
            raise RequestError("'model' must be a string", param="model")
        return str(host.resolve(name or None)["name"])

    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        model = model_of(body)
        _refuse_unsupported(body)
        prompt = chat_prompt(chat_messages(body))
        return await complete(request, body, model, prompt, chat=True)

    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        model = model_of(body)
        _refuse_unsupported(body)
        if body.get("echo") or body.get("suffix"):
            raise RequestError("'echo' and 'suffix' are not supported", param="echo")
        if "prompt" not in body:
            raise RequestError("'prompt' is required", param="prompt")
        return await complete(request, body, model, text_prompt(body["prompt"]), chat=False)

    async def complete(request: Request, body: dict[str, Any], model: str,
                       prompt: Callable[[Tokenizer], list[int]], chat: bool) -> Response:
        params = _sampling(body)
        max_tokens = _max_tokens(body, None if chat else COMPLETIONS_MAX_TOKENS)
        stop = _stop(body)
        stream = bool(body.get("stream"))
        opts = body.get("stream_options")
        include_usage = stream and isinstance(opts, dict) and bool(opts.get("include_usage"))

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[JobEvent | None] = asyncio.Queue()

        def emit(ev: JobEvent) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the event loop is gone: the server is stopping
                job.cancel()

        job = GenerationJob(model=model, prompt=prompt, emit=emit, params=params,
                            max_tokens=max_tokens, stop=stop,
                            prompt_param="messages" if chat else "prompt")
        headers = {QUEUE_HEADER: str(host.submit(job))}

        async def cancel_on_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            host.cancel(job)
            events.put_nowait(_GONE)

        watcher = asyncio.create_task(cancel_on_disconnect())
        settled = False  # True once the job ended or something else will cancel it
        try:
            first = await events.get()
            if first is _GONE or isinstance(first, RequestError):
                settled = True
                return Response(status_code=499) if first is _GONE else \
                    error_response(first, headers)
            assert isinstance(first, Started)
            shape = _Shape(chat, first.model)
            if stream:
                watcher.cancel()  # the streaming response listens for disconnects itself
                settled = True
                return StreamingResponse(
                    sse(shape, events, job, include_usage), headers=headers,
                    media_type="text/event-stream")
            parts = []
            while True:
                ev = await events.get()
                if ev is _GONE or isinstance(ev, RequestError):
                    settled = True
                    return Response(status_code=499) if ev is _GONE else \
                        error_response(ev, headers)
                assert isinstance(ev, GenerationEvent)
                parts.append(ev.text)
                if ev.finish_reason is not None:
                    settled = True
                    return JSONResponse(shape.whole("".join(parts), ev), headers=headers)
        finally:
            watcher.cancel()
            if not settled:  # cancelled by the server (shutdown) or an unexpected error
                host.cancel(job)

    async def sse(shape: _Shape, events: asyncio.Queue[JobEvent | None], job: GenerationJob,
                  include_usage: bool) -> AsyncIterator[str]:
        done = False
        try:
            if shape.chat:
                yield shape.chunk(None, role=True, with_usage=include_usage)
            while not done:
                ev = await events.get()
                if ev is _GONE:
                    return
                if isinstance(ev, RequestError):
                    done = True
                    err = {"message": str(ev), "type": ev.kind, "param": ev.param,
                           "code": ev.code}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    break
                assert isinstance(ev, GenerationEvent)
                if ev.finish_reason is None:
                    if ev.text:
                        yield shape.chunk(ev.text, with_usage=include_usage)
                    continue
                done = True
                if ev.text:
                    yield shape.chunk(ev.text, with_usage=include_usage)
                yield shape.chunk(None, finish=_finish(ev), with_usage=include_usage)
                if include_usage:
                    yield shape.chunk(None, usage=_usage(ev), with_usage=True)
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (or the server is stopping): free the slot
                host.cancel(job)

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


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT, model: str = "starter",
          api_key: str | None = None, caches_per_model: int = 4,
          announce: Callable[[str], None] = print) -> int:
    """Serve until interrupted (Ctrl-C or SIGTERM, which raise KeyboardInterrupt here).

    Refuses a non-loopback address without an API key. The engine runs on this (the main)
    thread and HTTP on another, so that MLX's work stays on the main thread.
    """
    if not is_loopback(host) and not api_key:
        raise StrataError(f"serving on {host or 'all interfaces'} exposes the model to the "
                          "network: set --api-key or STRATA_API_KEY")
    engine = EngineHost(caches_per_model=caches_per_model)
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

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
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

"""What every API surface shares: reading a body safely, and one job's events in asyncio.

Contract: `read_json(request, allowed)` reads at most MAX_BODY bytes (a larger Content-Length
or stream is a 413 before parsing), parses JSON (invalid or nested past MAX_JSON_DEPTH: a 400,
no traceback), and refuses fields not in `allowed` (a 400 naming them, as OpenAI does).
`Exchange(request, host, make_job)` submits the job `make_job(emit)` and hands its events to
the event loop: `first()` is its `Started` (or raises the job's `RequestError`, or returns None
when the client went away), `events()` the rest up to the finishing `GenerationEvent`, and
`collect()` gathers a whole reply. Closing an exchange whose job has not finished cancels it
(a client that hangs up frees its place at once). `guard(api_key, render)` wraps endpoints
with the API key check (Bearer or x-api-key) and renders RequestErrors in the API's shape; a
429 (the host's queue is full) carries `Retry-After` (`with_retry`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.server.host import (
    GenerationJob,
    Host,
    Job,
    JobEvent,
    RequestError,
    Result,
    Started,
    TokenLogprob,
)
from engine.telemetry import GenerationEvent

MAX_BODY = 32 << 20  # a context's worth of text is a few MB; anything far past it is refused
MAX_JSON_DEPTH = 64
_GONE = None  # put on a request's event queue when its client disconnects


def _too_deep(value: Any) -> bool:
    todo = [(value, 0)]
    while todo:
        v, d = todo.pop()
        if d > MAX_JSON_DEPTH:
            return True
        if isinstance(v, dict):
            todo.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            todo.extend((x, d + 1) for x in v)
    return False


async def read_json(request: Request, allowed: Iterable[str] | None = None) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise RequestError(f"request body is over {MAX_BODY >> 20} MB", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise RequestError(f"request body is over {MAX_BODY >> 20} MB", status=413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except RecursionError as exc:
        raise RequestError(f"the request body is nested too deep (over {MAX_JSON_DEPTH} "
                           "levels)") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if _too_deep(body):
        raise RequestError(f"the request body is nested too deep (over {MAX_JSON_DEPTH} levels)")
    if allowed is not None:
        unknown = sorted(set(body) - set(allowed))
        if unknown:
            names = ", ".join(repr(k[:40]) for k in unknown[:5])
            raise RequestError(f"unrecognized request argument(s): {names}",
                               param=unknown[0][:40], code="unknown_parameter")
    return body


@dataclass
class Collected:
    text: str
    last: GenerationEvent
    logprobs: list[TokenLogprob] = field(default_factory=list)


class Exchange:
    """One job seen from the event loop. Use it as an async context manager, or call close()."""

    def __init__(self, request: Request, host: Host,
                 make_job: Callable[[Callable[[JobEvent], None]], Job]) -> None:
        self.request, self.host = request, host
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[JobEvent | None] = asyncio.Queue()

        def emit(ev: JobEvent) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, ev)
            except RuntimeError:  # the event loop is gone: the server is stopping
                self.job.cancel()

        self.job = make_job(emit)
        self.depth = host.submit(self.job)
        self.finished = False
        self._watcher: asyncio.Task[None] | None = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.host.cancel(self.job)
        self.queue.put_nowait(_GONE)

    def streaming(self) -> None:
        """The response streams now: Starlette's StreamingResponse watches for disconnects."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if not self.finished:
            self.finished = True
            self.host.cancel(self.job)

    async def _next(self) -> JobEvent | None:
        ev = await self.queue.get()
        if ev is _GONE:
            self.finished = True  # already cancelled
            return None
        if isinstance(ev, RequestError):
            self.finished = True
            raise ev
        return ev

    async def first(self) -> Started | None:
        ev = await self._next()
        if ev is None:
            return None
        assert isinstance(ev, Started), ev
        return ev

    async def result(self) -> Any:
        """A CallJob's value (None when the client went away)."""
        ev = await self._next()
        if ev is None:
            return None
        assert isinstance(ev, Result), ev
        self.finished = True
        return ev.value

    async def events(self) -> AsyncIterator[GenerationEvent | TokenLogprob]:
        """The events after `Started`, ending with the finishing GenerationEvent (the
        iteration just stops when the client went away)."""
        while True:
            ev = await self._next()
            if ev is None:
                return
            assert isinstance(ev, GenerationEvent | TokenLogprob), ev
            if isinstance(ev, GenerationEvent) and ev.finish_reason is not None:
                self.finished = True
                yield ev
                return
            yield ev

    async def collect(self) -> Collected | None:
        parts: list[str] = []
        scores: list[TokenLogprob] = []
        async for ev in self.events():
            if isinstance(ev, TokenLogprob):
                scores.append(ev)
                continue
            parts.append(ev.text)
            if ev.finish_reason is not None:
                return Collected("".join(parts), ev, scores)
        return None


async def start_generation(request: Request, host: Host, **job: Any
                           ) -> tuple[Exchange, Started] | None:
    """Submit a GenerationJob(**job) and wait for it to start (None: the client left).
    Raises the job's RequestError (context too long, ...) with the exchange closed."""
    ex = Exchange(request, host, lambda emit: GenerationJob(emit=emit, **job))
    try:
        first = await ex.first()
    except BaseException:
        ex.close()
        raise
    if first is None:
        ex.close()
        return None
    return ex, first


# -- errors and auth -----------------------------------------------------------------------
def error_response(exc: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape."""
    body = {"error": {"message": str(exc), "type": exc.kind, "param": exc.param,
                      "code": exc.code}}
    return JSONResponse(body, status_code=exc.status, headers=with_retry(exc, headers))


def with_retry(exc: RequestError, headers: dict[str, str] | None = None
               ) -> dict[str, str] | None:
    """`headers` plus Retry-After when the error carries one (a 429: the queue is full)."""
    if exc.retry_after is None:
        return headers
    return {**(headers or {}), "Retry-After": str(exc.retry_after)}


def authorized(request: Request, key: str) -> bool:
    """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's),
    compared in constant time."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = request.headers.get("x-api-key", "")
    return hmac.compare_digest(token.strip().encode(), key.encode())


Endpoint = Callable[[Request], Awaitable[Response]]


def guard(api_key: str | None, render: Callable[[RequestError], Response] = error_response
          ) -> Callable[[Endpoint], Endpoint]:
    """An endpoint wrapper: the API key check, and RequestErrors rendered by `render`."""
    def wrap(fn: Endpoint) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            if api_key and not authorized(request, api_key):
                resp = render(RequestError(
                    "missing or wrong API key: send 'Authorization: Bearer KEY'",
                    status=401, code="invalid_api_key", kind="authentication_error"))
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
            try:
                return await fn(request)
            except RequestError as exc:
                return render(exc)

        return endpoint

    return wrap

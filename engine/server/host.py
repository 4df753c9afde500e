"""The server's engine side: one thread owns MLX and runs generation jobs in arrival order.

Contract: `EngineHost.run(preload=model)` makes the calling thread the engine thread (MLX
state belongs to the thread that made it): it loads `model`, then runs queued jobs until
`stop()`. `submit(job)` queues a job from any thread (FIFO, one runs at a time); its
`run(models)` executes on the engine thread and reports through the job's own `emit`
callback. `cancel(job)` drops a queued job or sets a running job's flag, which generation
checks between prefill chunks and between decode steps. The engine thread's
engine.runtime.pool.ModelPool is the jobs' `Models`: the loaded model and a few prompt caches
for it, so requests that share a prefix (a long system prompt) prefill only what is new. No
HTTP here: another owner of an engine thread (the window's worker) serves the same API by
implementing `Host` (queueing) over its own ModelPool.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.errors import StrataError
from engine.library import Library
from engine.runtime.generate import LoadedModel, PromptCache, generate
from engine.runtime.pool import ModelPool
from engine.runtime.sampling import SamplingParams
from engine.runtime.tokenizer import Tokenizer
from engine.telemetry import GenerationEvent

log = logging.getLogger(__name__)


class RequestError(StrataError):
    """A request the server refuses or fails: the HTTP status and OpenAI's `code`/`param`."""

    def __init__(self, message: str, status: int = 400, code: str | None = None,
                 param: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.kind = kind


# -- protocols: what the HTTP layer needs, and what a job needs ----------------------------
class Models(Protocol):
    """Engine-thread only: a loaded model by library name, and a prompt cache for a prompt."""

    def get(self, name: str) -> LoadedModel: ...

    def cache_for(self, lm: LoadedModel, prompt: Sequence[int]) -> PromptCache: ...

    def discard(self, cache: PromptCache) -> None: ...


class Job(Protocol):
    def run(self, models: Models) -> None: ...

    def cancel(self) -> None: ...

    def fail(self, error: RequestError) -> None: ...

    @property
    def cancelled(self) -> bool: ...


class Host(Protocol):
    """Whoever owns the engine thread, as the HTTP layer sees it."""

    default_model: str

    def manifests(self) -> list[dict[str, Any]]: ...

    def resolve(self, name: str | None) -> dict[str, Any]: ...

    def submit(self, job: Job) -> int: ...

    def cancel(self, job: Job) -> None: ...

    def status(self) -> dict[str, Any]: ...


# -- jobs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    """First event of an accepted generation: the prompt fits and prefill begins."""

    model: str
    prompt_tokens: int
    max_tokens: int


JobEvent = Started | GenerationEvent | RequestError


@dataclass(eq=False)
class GenerationJob:
    """One completion request. `prompt` turns the model's tokenizer into token ids (it runs on
    the engine thread, after the model is loaded); `emit` receives, in order, a `Started`, then
    `GenerationEvent`s up to one with a finish_reason, or a single `RequestError`."""

    model: str
    prompt: Callable[[Tokenizer], list[int]]
    emit: Callable[[JobEvent], None]
    params: SamplingParams
    max_tokens: int | None = None  # None: whatever room the context leaves
    stop: tuple[str, ...] = ()
    prompt_param: str = "messages"
    _flag: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._flag.set()

    @property
    def cancelled(self) -> bool:
        return self._flag.is_set()

    def fail(self, error: RequestError) -> None:
        self.emit(error)

    def run(self, models: Models) -> None:
        if self.cancelled:
            return
        pc = None
        try:
            lm = models.get(self.model)
            ids = self.prompt(lm.tokenizer)
            if not ids:
                raise RequestError("the prompt is empty", param=self.prompt_param)
            limit = lm.context_length
            max_tokens = self.max_tokens if self.max_tokens is not None else limit - len(ids)
            if max_tokens < 1 or len(ids) + max_tokens > limit:
                raise RequestError(
                    f"this model's maximum context length is {limit} tokens, but the request "
                    f"needs {len(ids) + max(max_tokens, 1)} ({len(ids)} in the prompt, "
                    f"{max(max_tokens, 1)} for the completion)",
                    code="context_length_exceeded", param=self.prompt_param)
            pc = models.cache_for(lm, ids)
            self.emit(Started(lm.manifest["name"], len(ids), max_tokens))
            for ev in generate(lm, ids, self.params, max_tokens, self.stop,
                               cancel=self._flag.is_set, prompt_cache=pc):
                self.emit(ev)
        except RequestError as exc:
            self.emit(exc)
        except StrataError as exc:  # the model failed to load, or generation refused
            self.emit(RequestError(str(exc), status=500, kind="server_error"))
        except Exception as exc:  # a bug: report it, and keep the engine thread alive
            log.exception("generation failed")
            if pc is not None:
                models.discard(pc)  # its KV may no longer match its tokens
            self.emit(RequestError(f"internal error: {exc}", status=500, kind="server_error"))


# -- the host: a FIFO queue and the engine thread -----------------------------------------
class EngineHost:
    """The standalone `Host`: a queue, and a model pool driven by `run()` on the engine thread.

    `strata serve` calls `run()` on the main thread and serves HTTP from another: MLX's CPU
    backend aborts the process at exit when some of its work ran on a secondary thread.
    """

    def __init__(self, library: Library | None = None, caches_per_model: int = 4) -> None:
        self.library = library or Library()
        self.default_model = ""
        self._caches_per_model = caches_per_model
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._closed = False
        self._counts = {"completed": 0, "cancelled": 0}
        self._pool_status: dict[str, Any] = {"model": None, "prompt_caches": []}

    # any thread
    def manifests(self) -> list[dict[str, Any]]:
        return self.library.manifests()

    def resolve(self, name: str | None) -> dict[str, Any]:
        m = self.library.find(name or self.default_model)
        if m is None:
            raise RequestError(f"model {name!r} is not in the library", status=404,
                               code="model_not_found", param="model")
        return m

    def submit(self, job: Job) -> int:
        """Queue `job`; returns the queue depth it joined (running and waiting, itself in)."""
        with self._cv:
            if self._closed:
                raise RequestError("the server is shutting down", status=503,
                                   kind="server_error")
            self._queue.append(job)
            self._cv.notify()
            return len(self._queue) + (self._running is not None)

    def cancel(self, job: Job) -> None:
        job.cancel()
        with self._cv:
            if job in self._queue:  # never started: free its place now
                self._queue.remove(job)
                self._counts["cancelled"] += 1

    def status(self) -> dict[str, Any]:
        with self._cv:
            waiting = len(self._queue)
            running = self._running is not None
            counts = dict(self._counts)
        return {"queue_depth": waiting + running, "running": int(running), "waiting": waiting,
                **counts, **self._pool_status}

    def stop(self) -> None:
        """Refuse new jobs, fail queued ones, cancel the running one; `run()` then returns."""
        with self._cv:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            if self._running is not None:
                self._running.cancel()
            self._cv.notify_all()
        for job in dropped:
            job.fail(RequestError("the server is shutting down", status=503, kind="server_error"))

    # the engine thread
    def run(self, preload: str | None = None, ready: Callable[[], None] | None = None) -> None:
        """Process jobs on this thread until `stop()`. Loads `preload` first (raising what
        loading raises), then calls `ready()`."""
        pool = ModelPool(self.library, caches=self._caches_per_model)
        try:
            if preload is not None:
                self.default_model = pool.get(str(self.library.get(preload)["name"])) \
                    .manifest["name"]
                self._pool_status = pool.status()
            if ready is not None:
                ready()
            self._loop(pool)
        finally:
            pool.close()

    def _loop(self, pool: ModelPool) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._running = self._queue.popleft()
            try:
                job.run(pool)
            except Exception:  # jobs report their own errors; this is a last resort
                log.exception("engine job failed")
            except BaseException:  # Ctrl-C while generating: tell the client, then stop
                job.fail(RequestError("the server is shutting down", status=503,
                                      kind="server_error"))
                raise
            status = pool.status()
            with self._cv:
                self._running = None
                self._counts["cancelled" if job.cancelled else "completed"] += 1
                self._pool_status = status

"""The server's engine side: one thread owns MLX and runs generation jobs in arrival order.

Contract: `EngineHost.run(preload=model)` makes the calling thread the engine thread (MLX
state belongs to the thread that made it): it loads `model`, then runs queued jobs until
`stop()`. `submit(job)` queues a job from any thread (FIFO, one runs at a time); its
`run(models)` executes on the engine thread and reports through the job's own `emit`
callback. `cancel(job)` drops a queued job or sets a running job's flag, which generation
checks between prefill chunks and between decode steps. `ModelPool` keeps the loaded model
and a few `PromptCache`s for it, so requests that share a prefix (a long system prompt)
prefill only what is new. No HTTP here: the app can serve the same API over its own engine
thread by implementing `Host` (queueing) and `Models` (its loaded model and caches).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import StrataError
from engine.telemetry import GenerationEvent

if TYPE_CHECKING:
    from engine.library import Library
    from engine.runtime.generate import LoadedModel, PromptCache
    from engine.runtime.sampling import SamplingParams
    from engine.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A cache is reused for a prompt that shares at least this many tokens with it (or extends
# it); below that, a fresh cache is taken so one request cannot trim another's warm prefix.
MIN_SHARED = 32


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
        from engine.runtime.generate import generate

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


# -- the model pool (engine thread only) -----------------------------------------------------
def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _close(cache: PromptCache) -> None:
    close = getattr(cache, "close", None)  # paged caches hold threads and files
    if close is not None:
        close()


class ModelPool:
    """One loaded model at a time (two may not fit in memory) and an LRU of prompt caches."""

    def __init__(self, library: Library | None = None, caches_per_model: int = 4) -> None:
        self.library = library
        self.caches_per_model = max(1, caches_per_model)
        self.lm: LoadedModel | None = None
        self.caches: list[PromptCache] = []  # least recently used first

    def get(self, name: str) -> LoadedModel:
        from engine.runtime.generate import LoadedModel

        if self.lm is not None and self.lm.manifest["name"] == name:
            return self.lm
        for pc in self.caches:  # free the old weights and KV before loading
            _close(pc)
        self.lm, self.caches = None, []
        lm = LoadedModel.load(name, library=self.library)
        # The same SSD prefix cache as the CLI and the app: a long system prompt stays warm
        # across server restarts and is shared with them.
        lm.enable_prefix_cache()
        self.lm = lm
        return lm

    def cache_for(self, lm: LoadedModel, prompt: Sequence[int]) -> PromptCache:
        best, best_len = None, -1
        for pc in self.caches:
            n = shared_prefix(pc.tokens, prompt)
            if n > best_len:
                best, best_len = pc, n
        if best is None or (best_len < MIN_SHARED and best_len < len(best.tokens)):
            if len(self.caches) < self.caches_per_model:
                best = lm.new_cache()
                self.caches.append(best)
            else:
                best = self.caches[0]  # evict the least recently used (reuse() trims it)
        self.caches.remove(best)
        self.caches.append(best)
        return best

    def discard(self, cache: PromptCache) -> None:
        if cache in self.caches:
            self.caches.remove(cache)
        _close(cache)

    def status(self) -> dict[str, Any]:
        return {
            "model": self.lm.manifest["name"] if self.lm is not None else None,
            "prompt_caches": [{"tokens": len(pc.tokens), "bytes": pc.nbytes}
                              for pc in reversed(self.caches)],
        }


# -- the host: a FIFO queue and the engine thread -----------------------------------------
class EngineHost:
    """The standalone `Host`: a queue, and a model pool driven by `run()` on the engine thread.

    `strata serve` calls `run()` on the main thread and serves HTTP from another: MLX's CPU
    backend aborts the process at exit when some of its work ran on a secondary thread.
    """

    def __init__(self, library: Library | None = None, caches_per_model: int = 4) -> None:
        if library is None:
            from engine.library import Library

            library = Library()
        self.library = library
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
        pool = ModelPool(self.library, self._caches_per_model)
        try:
            if preload is not None:
                self.default_model = pool.get(str(self.library.get(preload)["name"])) \
                    .manifest["name"]
                self._pool_status = pool.status()
            if ready is not None:
                ready()
            self._loop(pool)
        finally:
            for pc in pool.caches:
                _close(pc)

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

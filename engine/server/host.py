"""The server's engine side: one thread owns MLX, batches what it can and runs the rest alone.

Contract: `EngineHost.run(preload=model)` makes the calling thread the engine thread (MLX
state belongs to the thread that made it): it loads `model`, then serves queued jobs until
`stop()`. `submit(job)` queues a job from any thread (FIFO); past `max_queue` jobs waiting
it raises a 429 RequestError with `retry_after`. Generations on the loaded model (any
sampling, grammar, logprobs or repetition penalty: engine.runtime.batch keeps each row's own)
join one decode batch of up to `max_batch` rows at step boundaries, each prefilled alone
first, and leave it when they finish or are cancelled; a `CallJob` on the loaded model runs
between two steps; any other job (another model, a model whose KV cannot batch) runs alone
once the batch has drained, FIFO order kept (nothing behind it joins meanwhile).
`cancel(job)` drops a queued job or sets a running job's flag, which prefill checks between
chunks and decoding before each step (a batched row then leaves at the next step). A
generation may carry a grammar (engine.runtime.grammar: its mask constrains every token) and
ask for logprobs (a `TokenLogprob` event before each token's `GenerationEvent`); a prompt
whose text is far past the context (over MAX_CHARS_PER_TOKEN characters a token) is refused
before tokenizing. `CallJob` runs any other engine-thread work on a loaded model
(embeddings, token counts) and emits its value as one `Result`. The engine thread's
engine.runtime.pool.ModelPool is the jobs' `Models`: the loaded model and a few prompt
caches for it, so requests that share a prefix (a long system prompt) prefill only what is
new. No HTTP here: another owner of an engine thread (the window's worker) serves the same
API by implementing `Host` (queueing) over its own ModelPool, running each job alone.
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
from engine.runtime.batch import MAX_ROWS, Batch, Row
from engine.runtime.generate import LoadedModel, PromptCache, generate
from engine.runtime.grammar import GrammarError, GrammarProcessor
from engine.runtime.pool import ModelPool
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import Drafter
from engine.runtime.tokenizer import Tokenizer
from engine.telemetry import GenerationEvent

log = logging.getLogger(__name__)
# No vocabulary averages anywhere near this many characters a token over a whole prompt: a
# text past context x this is refused at once instead of tokenized for seconds.
MAX_CHARS_PER_TOKEN = 64
MAX_TOP_LOGPROBS = 20
MAX_QUEUE = 64  # jobs waiting (not yet decoding) before new ones get a 429
RETRY_AFTER_S = 1  # what a 429 tells the client to wait: a batch slot frees within steps


class RequestError(StrataError):
    """A request the server refuses or fails: the HTTP status and OpenAI's `code`/`param`."""

    def __init__(self, message: str, status: int = 400, code: str | None = None,
                 param: str | None = None, kind: str = "invalid_request_error",
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param
        self.kind = kind
        self.retry_after = retry_after  # seconds, sent as Retry-After (a 429)


# -- protocols: what the HTTP layer needs, and what a job needs ----------------------------
class Models(Protocol):
    """Engine-thread only: a loaded model by library name, and a prompt cache for a prompt."""

    def get(self, name: str) -> LoadedModel: ...

    def cache_for(self, lm: LoadedModel, prompt: Sequence[int]) -> PromptCache: ...

    def discard(self, cache: PromptCache) -> None: ...

    def drafter(self, lm: LoadedModel) -> str | Drafter: ...


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


@dataclass(frozen=True)
class TokenLogprob:
    """The next token's log-probability (after any grammar mask) and the `top` most likely."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]]


@dataclass(frozen=True)
class Result:
    """A `CallJob`'s value."""

    value: Any


JobEvent = Started | GenerationEvent | RequestError | TokenLogprob | Result


class _Logprobs:
    """A logits processor that keeps each step's log-softmax (lazily) for the token sampled."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.steps: deque[tuple[Any, Any]] = deque()

    def __call__(self, history: list[int], logits: Any) -> Any:
        import mlx.core as mx

        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        idx = mx.argpartition(-lp, kth=self.top - 1, axis=-1)[:, : self.top] if self.top else None
        self.steps.append((lp, idx))
        return logits

    def take(self, token: int, tok: Tokenizer) -> TokenLogprob:
        lp, idx = self.steps.popleft()

        def piece(i: int) -> tuple[str, list[int]]:
            text = tok.decode([i])
            return text, list(text.encode("utf-8", errors="replace"))

        top = []
        if idx is not None:
            ids = [int(i) for i in idx[0].tolist()]
            vals = lp[0, idx[0]].tolist()
            # OpenAI's floor for impossible tokens (JSON has no -inf): what a grammar masked.
            top = sorted(((*piece(i), max(float(v), -9999.0))
                          for i, v in zip(ids, vals, strict=True)), key=lambda t: -t[2])
        text, raw = piece(token)
        return TokenLogprob(text, max(float(lp[0, token].item()), -9999.0), raw,
                            [(t, v, b) for t, b, v in top])


def in_step(pc: PromptCache) -> bool:
    """Whether every layer of `pc` holds exactly its tokens' positions."""
    n = len(pc.tokens)
    return all(getattr(c, "offset", n) == n for c in pc.cache)


def _lost_rank(models: Models, exc: Exception) -> Exception:
    """On a model split across Macs (ModelPool.cluster), MLX's error from a lost rank as the
    cluster's one line (which rank, after how many steps), not an internal error."""
    cluster = getattr(models, "cluster", None)
    return exc if cluster is None else cluster.explain(exc)  # type: ignore[no-any-return]


def _cache(models: Models, lm: LoadedModel, ids: list[int]) -> PromptCache:
    """The prompt cache for `ids`; one whose KV is out of step with its tokens is dropped."""
    pc = models.cache_for(lm, ids)
    if not in_step(pc):
        models.discard(pc)
        pc = models.cache_for(lm, ids)
    return pc


class _Cancellable:
    """What every job shares: a cancel flag the host reads between steps, and failing by an
    event to its emitter (both are dataclass fields of the job)."""

    _flag: threading.Event
    emit: Callable[[JobEvent], None]

    def cancel(self) -> None:
        self._flag.set()

    @property
    def cancelled(self) -> bool:
        return self._flag.is_set()

    def fail(self, error: RequestError) -> None:
        self.emit(error)


@dataclass(eq=False)
class GenerationJob(_Cancellable):
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
    # engine.runtime.grammar's compiled form, or a function of the tokenizer giving it
    grammar: str | Callable[[Tokenizer], str | None] | None = None
    logprobs: int | None = None  # None: none; else how many alternatives per token
    chars: int = 0  # characters of prompt text, for the refusal before tokenizing
    finished: bool = False  # a batched request: its last event is out
    _flag: threading.Event = field(default_factory=threading.Event)

    def _prepare(self, lm: LoadedModel) -> tuple[list[int], int, list[Any], _Logprobs | None]:
        """The prompt's ids, max_tokens and logits processors, or the RequestError refusing
        the request (context too long, empty prompt)."""
        limit = lm.context_length
        if self.chars > limit * MAX_CHARS_PER_TOKEN:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens, and the request "
                f"has {self.chars:,} characters of text: far more than fit",
                code="context_length_exceeded", param=self.prompt_param)
        ids = self.prompt(lm.tokenizer)
        if not ids:
            raise RequestError("the prompt is empty", param=self.prompt_param)
        max_tokens = self.max_tokens if self.max_tokens is not None else limit - len(ids)
        if max_tokens < 1 or len(ids) + max_tokens > limit:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens, but the request "
                f"needs {len(ids) + max(max_tokens, 1)} ({len(ids)} in the prompt, "
                f"{max(max_tokens, 1)} for the completion)",
                code="context_length_exceeded", param=self.prompt_param)
        procs: list[Any] = []
        grammar = self.grammar(lm.tokenizer) if callable(self.grammar) else self.grammar
        if grammar is not None:
            procs.append(GrammarProcessor(lm.tokenizer, grammar))
        scores = _Logprobs(self.logprobs) if self.logprobs is not None else None
        if scores is not None:
            procs.append(scores)  # after the grammar: what was sampled from
        return ids, max_tokens, procs, scores

    def _failed(self, exc: BaseException, models: Models, pc: PromptCache | None) -> None:
        """Report `exc` (raised preparing or generating) as the request's RequestError."""
        if isinstance(exc, RequestError):
            self.emit(exc)
        elif isinstance(exc, GrammarError):  # the grammar refused before the first token
            self.emit(RequestError(str(exc), param="response_format"))
        elif isinstance(exc, StrataError):  # the model failed to load, or generation refused
            self.emit(RequestError(str(exc), status=500, kind="server_error"))
        else:  # a bug: report it, and keep the engine thread alive
            log.error("generation failed", exc_info=exc)
            if pc is not None:
                models.discard(pc)  # its KV may no longer match its tokens
            self.emit(RequestError(f"internal error: {exc}", status=500, kind="server_error"))

    def run(self, models: Models) -> None:
        """Generate alone, start to end."""
        if self.cancelled:
            return
        pc = None
        try:
            lm = models.get(self.model)
            ids, max_tokens, procs, scores = self._prepare(lm)
            pc = _cache(models, lm, ids)
            self.emit(Started(lm.manifest["name"], len(ids), max_tokens))
            # Alone, a request drafts as the window's chats do (the draft setting).
            for ev in generate(lm, ids, self.params, max_tokens, self.stop,
                               cancel=self._flag.is_set, prompt_cache=pc,
                               logits_processors=procs, drafter=models.drafter(lm)):
                if scores is not None and ev.token is not None:
                    self.emit(scores.take(ev.token, lm.tokenizer))
                self.emit(ev)
        except Exception as exc:
            self._failed(_lost_rank(models, exc), models, pc)
        if pc is not None and not in_step(pc):
            # A grammar that refuses mid-reply raises after the step that fed its last token
            # (KV one position past the cache's tokens): a later prompt must not reuse it.
            models.discard(pc)

    def admit(self, models: Models, batch: Batch) -> str:
        """On the engine thread, with `batch` decoding on the loaded model: join it if this
        request can batch. 'joined' (it decodes in the batch; `finished` tells when it is
        done), 'done' (refused, or finished during its prefill), or 'alone' (it must run by
        itself: call `run` once the batch is empty)."""
        if self.cancelled:
            return "done"
        lm = batch.lm
        if self.model != lm.manifest["name"]:
            return "alone"
        if not batch.accepts():
            return "alone"
        pc = None
        try:
            ids, max_tokens, procs, scores = self._prepare(lm)
            pc = _cache(models, lm, ids)
            self.emit(Started(lm.manifest["name"], len(ids), max_tokens))
            tok = lm.tokenizer

            def on_event(ev: GenerationEvent) -> None:
                if scores is not None and ev.token is not None:
                    self.emit(scores.take(ev.token, tok))
                if ev.finish_reason is not None:
                    self.finished = True
                self.emit(ev)

            def on_fail(exc: Exception) -> None:  # a grammar refusing mid-reply
                self.finished = True
                self._failed(exc, models, None)

            # It drafts in the batch, alone or beside other rows (engine.runtime.batch).
            row = Row(ids, self.params, max_tokens, on_event, self.stop, self._flag.is_set,
                      pc, procs, on_fail, drafter=models.drafter(lm))
            return "joined" if batch.join(row) else "done"
        except Exception as exc:
            self._failed(exc, models, pc)
            return "done"


@dataclass(eq=False)
class CallJob(_Cancellable):
    """Other work on a loaded model: `call(lm)` on the engine thread, its value emitted as a
    `Result` (or a `RequestError`)."""

    model: str
    call: Callable[[LoadedModel], Any]
    emit: Callable[[JobEvent], None]
    _flag: threading.Event = field(default_factory=threading.Event)

    def run(self, models: Models) -> None:
        if self.cancelled:
            return
        try:
            self.emit(Result(self.call(models.get(self.model))))
        except RequestError as exc:
            self.emit(exc)
        except StrataError as exc:
            self.emit(RequestError(str(exc), status=500, kind="server_error"))
        except Exception as exc:  # a bug: report it, and keep the engine thread alive
            log.exception("engine call failed")
            self.emit(RequestError(f"internal error: {exc}", status=500, kind="server_error"))


def embed(lm: LoadedModel, ids: list[int]) -> list[float]:
    """The mean of the last layer's (normed) hidden states over `ids`, scaled to length 1."""
    import mlx.core as mx

    inner = getattr(lm.model, "model", None)
    if inner is None or not callable(inner):
        raise RequestError(f"{lm.manifest['name']} has no hidden-state output for embeddings",
                           param="model")
    if len(ids) > lm.context_length:
        raise RequestError(f"an input has {len(ids)} tokens; this model's context is "
                           f"{lm.context_length}", code="context_length_exceeded",
                           param="input")
    h = inner(mx.array([ids]))[0].astype(mx.float32).mean(axis=0)
    h = h / mx.maximum(mx.linalg.norm(h), 1e-12)
    return [float(x) for x in h.tolist()]


# -- the host: a FIFO queue, a decode batch and the engine thread ------------------------
class EngineHost:
    """The standalone `Host`: a queue, a decode batch and a model pool driven by `run()` on
    the engine thread.

    `strata serve` calls `run()` on the main thread and serves HTTP from another: MLX's CPU
    backend aborts the process at exit when some of its work ran on a secondary thread.
    """

    def __init__(self, library: Library | None = None, caches_per_model: int = 4,
                 max_batch: int = MAX_ROWS, max_queue: int = MAX_QUEUE) -> None:
        self.library = library or Library()
        self.default_model = ""
        self.max_batch = max(1, max_batch)
        self.max_queue = max(0, max_queue)
        # A prompt cache per row being prefilled at once is enough: one joins at a time.
        self._caches_per_model = caches_per_model
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._running: list[Job] = []  # decoding in the batch, or the one running alone
        self._closed = False
        self._counts = {"completed": 0, "cancelled": 0, "rejected": 0}
        self._batch: dict[str, int] = {"rows": 0, "steps": 0, "tokens": 0, "peak_rows": 0}
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
        """Queue `job`; returns the queue depth it joined (running and waiting, itself in).
        Past `max_queue` jobs waiting: a 429 RequestError with `retry_after`."""
        with self._cv:
            if self._closed:
                raise RequestError("the server is shutting down", status=503,
                                   kind="server_error")
            if len(self._queue) >= self.max_queue:
                self._counts["rejected"] += 1
                raise RequestError(
                    f"the server is busy: {len(self._queue)} requests are waiting (at most "
                    f"{self.max_queue}, --max-queue); retry after {RETRY_AFTER_S} s",
                    status=429, code="rate_limit_exceeded", kind="rate_limit_error",
                    retry_after=RETRY_AFTER_S)
            self._queue.append(job)
            self._cv.notify()
            return len(self._queue) + len(self._running)

    def cancel(self, job: Job) -> None:
        job.cancel()
        with self._cv:
            if job in self._queue:  # never started: free its place now
                self._queue.remove(job)
                self._counts["cancelled"] += 1

    def status(self) -> dict[str, Any]:
        with self._cv:
            waiting = len(self._queue)
            running = len(self._running)
            counts = dict(self._counts)
            batch = dict(self._batch, max_rows=self.max_batch)
        return {"queue_depth": waiting + running, "running": running, "waiting": waiting,
                "max_queue": self.max_queue, "batch": batch, **counts, **self._pool_status}

    def stop(self) -> None:
        """Refuse new jobs, fail queued ones, cancel the running ones; `run()` then returns."""
        with self._cv:
            self._closed = True
            dropped = list(self._queue)
            self._queue.clear()
            for job in self._running:
                job.cancel()
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
        batch: Batch | None = None
        held: Job | None = None  # must run alone: waits for the batch to drain
        try:
            while True:
                job = None
                with self._cv:
                    while (not self._queue and held is None and not (batch and len(batch))
                           and not self._closed):
                        self._cv.wait()
                    if self._closed:
                        return
                    if held is None and self._queue and (batch is None or not batch.full):
                        job = self._queue.popleft()
                        self._running.append(job)
                if held is not None and (batch is None or not len(batch)):
                    job, held = held, None
                    self._alone(job, pool)
                    continue
                if job is not None:
                    if batch is None or batch.lm is not pool.lm:
                        batch = Batch(pool.lm, self.max_batch) if pool.lm is not None else None
                    how = "alone"
                    if (isinstance(job, CallJob) and pool.lm is not None
                            and job.model == pool.lm.manifest["name"]):
                        self._alone(job, pool)  # short, on the loaded model: between steps
                        continue
                    if isinstance(job, GenerationJob) and batch is not None:
                        try:
                            how = job.admit(pool, batch)
                        except BaseException:  # Ctrl-C while prefilling
                            job.fail(RequestError("the server is shutting down", status=503,
                                                  kind="server_error"))
                            raise
                    if how == "done":
                        self._finished([job], pool)
                    elif how == "alone":
                        if batch is None or not len(batch):
                            self._alone(job, pool)
                        else:
                            held = job
                    if how != "joined":
                        continue
                    if batch is not None and self._queue and not batch.full:
                        continue  # others arrived together: they join before the next step
                if batch is not None and len(batch):
                    self._step(batch, pool)
        finally:
            if batch is not None and len(batch):
                batch.cancel_all()
            if held is not None:
                held.fail(RequestError("the server is shutting down", status=503,
                                       kind="server_error"))

    def _alone(self, job: Job, pool: ModelPool) -> None:
        try:
            job.run(pool)
        except Exception:  # jobs report their own errors; this is a last resort
            log.exception("engine job failed")
        except BaseException:  # Ctrl-C while generating: tell the client, then stop
            job.fail(RequestError("the server is shutting down", status=503,
                                  kind="server_error"))
            raise
        self._finished([job], pool)

    def _step(self, batch: Batch, pool: ModelPool) -> None:
        try:
            batch.step()
        except Exception as exc:  # a bug: every row fails, the engine thread lives on
            log.exception("batched decoding failed")
            error = RequestError(f"internal error: {exc}", status=500, kind="server_error")
            for job in list(self._running):
                if isinstance(job, GenerationJob) and not job.finished:
                    job.finished = True
                    job.fail(error)
            batch.drop_all()
        done: list[Job] = [j for j in self._running
                           if isinstance(j, GenerationJob) and j.finished]
        with self._cv:
            self._batch.update(rows=len(batch), steps=batch.steps, tokens=batch.rows_stepped,
                               peak_rows=max(self._batch["peak_rows"], batch.peak_rows))
        if done:
            self._finished(done, pool)

    def _finished(self, jobs: list[Job], pool: ModelPool) -> None:
        status = pool.status()
        with self._cv:
            for job in jobs:
                if job in self._running:
                    self._running.remove(job)
                self._counts["cancelled" if job.cancelled else "completed"] += 1
            self._pool_status = status

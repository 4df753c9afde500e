"""The one engine thread: requests in as queued slot calls, engine events out as Qt signals.

Contract: `Engine` (GUI thread) starts a QThread and moves an `EngineWorker` onto it. Every
engine call (fetch the starter, load, generate, import, remove) runs on that thread, so MLX
streams stay with the thread that made them. Each job is a generator of (signal, args)
steps; the runner emits each step and checks the job's cancel flag between steps, as in
superqt's generator workers. The GUI thread never waits on the engine, except in
`Engine.shutdown()` when the window closes. `Engine` re-emits the worker's events on the
GUI thread; the rest of the app connects to those, never to the worker itself.

The worker holds no engine policy: the loaded model, its KV settings and prefix cache, the
chats' sessions and their LRU, the prewarm of a system prompt and the memory figures are
engine.runtime.pool.ModelPool's. `apply_settings` hands the window's engine settings to the
pool (for sessions made after them); `prewarm(chat, model, system)` asks it to prefill a chat's
system prompt. Server jobs (app/server.py) run on the same thread between chat jobs, over the
same pool, so they share the model and the prefix cache.

Chat extras: a reply with `assistant_prefix` continues that text (a reply cut short): the
prompt is the chat template up to the assistant's turn plus the prefix's tokens, so the model
picks up mid-sentence. `read_document(path, model)` reads a file for a chat's context
(engine.importers.documents) and measures it on `model`'s tokenizer: tokens, the KV bytes
those tokens cost under the KV settings in force, the KV RAM budget and the model's context
(`document_read`; a file that cannot be read is error_occurred(job, "document", line)).

Will it fit: the worker settles the compute profile on the engine thread as it starts
(`profile_chosen`); an import plan gives each option a `fit` (engine.runtime.fit.Fit: weights
plus KV at the chosen context against this machine's memory) and an import that would not fit
is refused before anything is written; `Engine.fits(manifests)` gives the library's models
theirs from their config and manifest (file reads and psutil: the GUI thread may call it).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from PySide6.QtCore import QObject, QThread, QTimer, Signal, SignalInstance, Slot

import app.compat  # noqa: F401  (PySide6 work-around, see there)
from engine.errors import Cancelled, ImportFailed, StrataError
from engine.library import Library
from engine.platform import ComputeProfile
from engine.runtime.fit import (
    Fit,
    WeightSizes,
    chosen_context,
    estimate,
    gpu_memory_limit,
    value_bytes,
)
from engine.runtime.sampling import SamplingParams
from engine.telemetry import GenerationEvent, Timeline

if TYPE_CHECKING:
    from engine.importers import Source
    from engine.runtime.pool import ModelPool
    from engine.server.host import Job

log = logging.getLogger(__name__)

Step = tuple[SignalInstance, tuple[Any, ...]]
MEMORY_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ReplyRequest:
    """Everything the worker needs to answer one message of one chat."""

    chat_id: int
    model: str
    text: str
    history: list[dict[str, str]] = field(default_factory=list)  # earlier turns, no system
    system: str = ""
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int | None = None
    assistant_prefix: str = ""  # continue this reply rather than start one


# -- the worker (lives on the engine thread) ----------------------------------------------
class ServerHost(Protocol):
    """The app's server host (app.server.AppHost) as the worker sees it: told when each of
    its jobs starts and ends on the engine thread."""

    def job_started(self, job: Job) -> None: ...

    def job_finished(self, job: Job) -> None: ...


class EngineWorker(QObject):
    """Runs the app's engine jobs on the engine thread over one ModelPool; no policy here."""

    busy_changed = Signal(bool)
    starter_progressed = Signal(str, int, int)  # message, done, total (0: no measure)
    starter_ready = Signal(dict)
    model_loading = Signal(str)
    model_loaded = Signal(dict)  # name, path, weights_bytes, profile, phases
    reply_started = Signal(int)
    reply_delta = Signal(int, str)
    reply_finished = Signal(int, dict)  # job, stats
    import_planned = Signal(int, dict)  # job, the import plan (kind, recipes, sizes)
    import_started = Signal(int, dict)  # job, {"path", "kind"}
    import_progress = Signal(int, int, int)  # job, done, total
    import_finished = Signal(int, dict)  # job, manifest
    model_removed = Signal(int, str)
    error_occurred = Signal(int, str, str)  # job, what ("reply", "import", ...), message
    memory_sampled = Signal(object)  # engine.platform.MemorySnapshot
    prefix_warmed = Signal(int, int, dict)  # job, chat, {tokens, cached, prefilled, seconds}
    settings_applied = Signal(dict)  # the engine settings now in force
    prefix_cleared = Signal(int, dict)  # job, {"runs", "bytes"} removed from the disk
    profile_chosen = Signal(object)  # engine.platform.ComputeProfile models load in
    document_read = Signal(int, dict)  # job, the document and its measure (see the module doc)

    def __init__(self, home: Path) -> None:
        super().__init__()
        self.library = Library(home)
        self.home = Path(self.library.home)
        self.pool: ModelPool  # made on the engine thread, as it starts
        self._cancelled: set[int] = set()
        self._cancel_all = False
        self._lock = threading.Lock()
        self._last_sample = 0.0
        self._timer: QTimer | None = None
        self.profile: ComputeProfile | None = None  # set on the engine thread as it starts

    # -- called from any thread --------------------------------------------------------
    def cancel(self, job: int) -> None:
        """Ask job `job` to stop at its next step (thread-safe; no effect once it ended)."""
        with self._lock:
            self._cancelled.add(job)

    def cancel_all(self) -> None:
        with self._lock:
            self._cancel_all = True

    def _is_cancelled(self, job: int) -> bool:
        with self._lock:
            return self._cancel_all or job in self._cancelled

    # -- slots (queued from the GUI thread) ----------------------------------------------
    @Slot()
    def _on_thread_started(self) -> None:
        # Start-up: the runtime (MLX, numpy) loads here, on the engine thread, while the
        # window shows.
        from engine.runtime.pool import ModelPool, settings_from_options

        # The environment's settings (STRATA_KV_*, STRATA_PREFIX_*) until the window's apply.
        self.pool = ModelPool(self.library, settings_from_options({}, self.home))
        self.pool.on_loading = self.model_loading.emit
        self.pool.on_loaded = self.model_loaded.emit
        from engine.platform import compute_profile  # MLX decides it: here, on this thread

        self.profile = compute_profile()
        gpu_memory_limit()  # macOS asks Metal once, here; later calls read the cached figure
        self.profile_chosen.emit(self.profile)
        self._timer = QTimer(self)
        self._timer.setInterval(int(MEMORY_INTERVAL_S * 1000))
        self._timer.timeout.connect(self._on_timer_timeout)
        self._timer.start()
        self._sample(force=True)  # the memory panel fills at once, not after a second

    @Slot()
    def _on_timer_timeout(self) -> None:
        self._sample(force=True)

    @Slot()
    def _on_shutdown_requested(self) -> None:
        if self._timer is not None:
            self._timer.stop()
        self.pool.close()
        thread = self.thread()
        if thread is not None:
            thread.quit()

    @Slot(int, bool)
    def _on_starter_requested(self, job: int, load: bool) -> None:
        self._run(job, "starter", self._starter_steps(job, load))

    @Slot(int, str)
    def _on_load_requested(self, job: int, name: str) -> None:
        self._run(job, "load", self._load_steps(name))

    @Slot(int, str, list, str)
    def _on_load_across_requested(self, job: int, name: str, waiters: list[str],
                                  key: str) -> None:
        self._run(job, "load", self._load_across_steps(name, waiters, key or None))

    @Slot(int, object)
    def _on_reply_requested(self, job: int, request: ReplyRequest) -> None:
        self._run(job, "reply", self._reply_steps(job, request))

    @Slot(int, str)
    def _on_import_planned_requested(self, job: int, path: str) -> None:
        self._run(job, "import", self._plan_steps(job, Path(path)))

    @Slot(int, str, str, int)
    def _on_import_requested(self, job: int, path: str, recipe: str, context: int) -> None:
        self._run(job, "import", self._import_steps(job, Path(path), recipe or None,
                                                    context or None))

    @Slot(int, str)
    def _on_remove_requested(self, job: int, name: str) -> None:
        self._run(job, "remove", self._remove_steps(job, name))

    @Slot(int)
    def _on_chat_forgotten(self, chat_id: int) -> None:
        self.pool.forget(chat_id)
        self._sample(force=True)

    @Slot(int, int, str, str)
    def _on_prewarm_requested(self, job: int, chat_id: int, model: str, system: str) -> None:
        self._run(job, "prewarm", self._prewarm_steps(job, chat_id, model, system))

    @Slot(dict)
    def _on_settings_requested(self, settings: dict[str, Any]) -> None:
        """New engine settings: they apply to sessions made from now on, so the open chats'
        sessions are dropped (their next message restores or prefills again)."""
        from engine.runtime.pool import settings_from_options  # loaded with the pool already

        try:
            self.pool.configure(settings_from_options(settings, self.home))
        except (StrataError, ValueError, TypeError) as exc:
            self.error_occurred.emit(0, "settings", f"engine settings refused: {exc}")
            return
        self._sample(force=True)
        self.settings_applied.emit(dict(settings))

    @Slot(int, str, str)
    def _on_document_requested(self, job: int, path: str, model: str) -> None:
        self._run(job, "document", self._document_steps(job, path, model))

    @Slot(int)
    def _on_prefix_clear_requested(self, job: int) -> None:
        self._run(job, "prefix clear", self._prefix_clear_steps(job))

    @Slot(object, object)
    def _on_server_job_requested(self, host: ServerHost, job: Job) -> None:
        """One request of the app's local server (app/server.py), run here like a chat job,
        over the same model pool (a load it needs is heard as model_loading/model_loaded)."""
        host.job_started(job)
        self.busy_changed.emit(True)
        try:
            if not job.cancelled and not self._cancel_all:
                job.run(self.pool)
        except Exception:  # jobs report their own errors; this is a last resort
            log.error("server job failed:\n%s", traceback.format_exc())
        finally:
            host.job_finished(job)
            self._sample(force=True)
            self.busy_changed.emit(False)

    # -- the runner --------------------------------------------------------------------
    def _run(self, job: int, what: str, steps: Iterator[Step]) -> None:
        if self._is_cancelled(job):
            self.error_occurred.emit(job, what, f"{what} cancelled")
            return
        self.busy_changed.emit(True)
        try:
            for signal, args in steps:
                signal.emit(*args)
                self._sample()
        except Cancelled as exc:
            self.error_occurred.emit(job, what, str(exc))
        except StrataError as exc:
            self.error_occurred.emit(job, what, str(exc))
        except Exception as exc:  # a bug: keep the thread alive and say so
            log.error("engine %s job failed:\n%s", what, traceback.format_exc())
            self.error_occurred.emit(job, what, f"internal error: {exc!r}")
        finally:
            with self._lock:
                self._cancelled.discard(job)
            self._sample(force=True)
            self.busy_changed.emit(False)

    def _sample(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_sample < MEMORY_INTERVAL_S:
            return
        self._last_sample = now
        self.memory_sampled.emit(self.pool.memory())

    # -- jobs: each a generator of (signal, args) steps ---------------------------------
    def _starter_steps(self, job: int, load: bool) -> Iterator[Step]:
        # Start-up: the importers (gguf, numpy) load when the starter is fetched, not before
        # the window shows.
        from engine.importers.starter import ensure_starter

        last = [-1]

        def on_message(text: str) -> None:
            self.starter_progressed.emit(text[:1].upper() + text[1:], 0, 0)

        def on_import(done: int, total: int) -> None:
            pct = int(100 * done / max(total, 1))
            if pct != last[0]:
                last[0] = pct
                self.starter_progressed.emit("Importing the starter model", pct, 100)

        manifest = ensure_starter(self.library, progress=on_message, import_progress=on_import)
        yield self.starter_ready, (manifest,)
        if load:
            yield from self._load_steps(manifest["name"])

    def _load_steps(self, name: str) -> Iterator[Step]:
        """Make `name` the loaded model; the pool's callbacks emit model_loading/loaded."""
        self.pool.get(name)
        return
        yield  # a generator with no steps of its own

    def _load_across_steps(self, name: str, waiters: list[str], key: str | None
                           ) -> Iterator[Step]:
        """`name` split across this Mac and the waiting Macs; model_loaded carries `ranks`.
        `key`: the server's key, which Macs off loopback must be shown (None: $STRATA_API_KEY)."""
        self.pool.load_across(name, waiters, key=key)
        return
        yield  # a generator with no steps of its own

    def _reply_steps(self, job: int, req: ReplyRequest) -> Iterator[Step]:
        params = SamplingParams(temperature=req.temperature, top_p=req.top_p,
                                seed=req.seed).validate()
        loaded_before = self.pool.lm
        lm = self.pool.get(req.model)  # a load is heard before the reply starts
        yield self.reply_started, (job,)
        timeline = Timeline()
        last = None
        cancel = lambda: self._is_cancelled(job)  # noqa: E731
        if req.assistant_prefix:
            events = self._continue_events(req, params, cancel, timeline)
        else:
            events = self.pool.reply(req.chat_id, req.model, req.text, req.history, req.system,
                                     params, req.max_tokens, cancel=cancel, timeline=timeline)
        for ev in events:
            last = ev
            if ev.text:
                yield self.reply_delta, (job, ev.text)
        assert last is not None
        # A load this reply waited for counts in its phases (the model keeps its load timeline).
        load_s = sum(lm.timeline.durations().values()) if loaded_before is not lm else 0.0
        phases = {"load": load_s} if load_s else {}
        phases.update(timeline.durations())
        stats = {
            "model": lm.manifest["name"], "ttft_s": last.ttft_s, "decode_tps": last.decode_tps,
            "prefill_tps": last.prefill_tps, "prompt_tokens": last.prompt_tokens,
            "cached_tokens": last.cached_tokens, "generated_tokens": last.generated_tokens,
            "peak_memory_bytes": last.peak_memory_bytes,
            "finish_reason": last.finish_reason or "stop", "phases": phases,
            "drafted_tokens": last.drafted_tokens, "accepted_tokens": last.accepted_tokens,
        }
        yield self.reply_finished, (job, stats)

    def _continue_events(self, req: ReplyRequest, params: SamplingParams,
                         cancel: Callable[[], bool], timeline: Timeline
                         ) -> Iterator[GenerationEvent]:
        """The rest of `req.assistant_prefix`, in the chat's session (its KV reused)."""
        from engine.runtime.generate import generate  # loaded with the pool already

        session = self.pool.session(req.chat_id)
        lm = session.lm
        messages = [{"role": "system", "content": req.system}] if req.system else []
        messages += [dict(m) for m in req.history]
        messages.append({"role": "user", "content": req.text})
        prompt = lm.tokenizer.encode_chat(messages)
        prompt += lm.tokenizer.encode(req.assistant_prefix, add_bos=False, add_eos=False)
        session.messages = messages
        reply: list[str] = []
        try:
            for ev in generate(lm, prompt, params, req.max_tokens, cancel=cancel,
                               prompt_cache=session.cache, timeline=timeline,
                               drafter=self.pool.drafter(lm)):
                reply.append(ev.text)
                yield ev
        finally:
            session.messages.append({"role": "assistant",
                                     "content": req.assistant_prefix + "".join(reply)})

    def _document_steps(self, job: int, path: str, model: str) -> Iterator[Step]:
        from engine.importers.documents import read_document  # start-up: when one is attached

        doc = read_document(path)
        lm = self.pool.get(model) if model else self.pool.lm
        if lm is None:
            raise StrataError(f"{doc.name}: no model to count its tokens with")
        tokens = len(lm.tokenizer.encode(doc.text, add_bos=False, add_eos=False))
        yield self.document_read, (job, {
            "path": doc.path, "name": doc.name, "kind": doc.kind, "pages": doc.pages,
            "bytes": doc.bytes, "text": doc.text, "tokens": tokens, "model": lm.manifest["name"],
            **self.kv_cost(tokens)},)

    def kv_cost(self, tokens: int) -> dict[str, Any]:
        """What `tokens` more tokens of context cost the loaded model's KV cache, under the KV
        settings in force: kv_bytes, bytes_per_token, the KV RAM budget (the paged cache's;
        auto: a quarter of RAM), the KV mode and the model's context length."""
        from engine.kv import KVSettings  # loaded with the pool already

        lm = self.pool.lm
        if lm is None:
            return {}
        g = lm.kv_geometry
        kv = self.pool.settings.kv or KVSettings()
        bits = kv.bits if kv.mode != "mlx" else 16
        per_value = value_bytes(g.width, bits, kv.group() if bits != 16 else None)
        per_token = g.bytes_per_token() * per_value / g.width
        return {"kv_bytes": int(g.kv_bytes(tokens) * per_value / g.width),
                "bytes_per_token": per_token, "kv_ram_bytes": kv.ram_bytes(),
                "kv_mode": kv.mode, "context_length": int(lm.context_length)}

    def _prewarm_steps(self, job: int, chat_id: int, model: str, system: str
                       ) -> Iterator[Step]:
        info = self.pool.prewarm(chat_id, model, system, cancel=lambda: self._is_cancelled(job))
        if info is not None:
            yield self.prefix_warmed, (job, chat_id, info)

    def _plan_steps(self, job: int, path: Path) -> Iterator[Step]:
        from engine.importers import open_source  # start-up: loaded when an import is planned
        from engine.quant.quantize import import_options  # start-up: as above

        source = open_source(path)
        info = import_options(source)
        for opt in info["options"]:
            opt["fit"] = self._import_fit(source, opt.get("recipe"), opt.get("bytes"))
        yield self.import_planned, (job, info)

    def kv_fit_args(self) -> dict[str, Any]:
        """The pool's figures as the fit estimate counts them: the KV bits, the RAM budget
        where a paged cache puts the rest of its pages on the SSD, and the loaded model's
        weights, which any load frees first (one model at a time)."""
        pool: ModelPool | None = getattr(self, "pool", None)
        if pool is None:
            return {}
        out: dict[str, Any] = {"freed_bytes": int(pool.weights_bytes or 0)}
        kv = pool.settings.kv
        if kv is not None and kv.mode != "mlx":
            out.update(kv_bits=kv.bits, kv_group=kv.group(),
                       kv_ram_limit=kv.ram_bytes() if kv.ssd else None)
        return out

    def _import_fit(self, source: Source, recipe: str | None, size: int | None,
                    context: int | None = None) -> Fit:
        """The fit of `source` imported by `recipe` (None: as the import does by default;
        `size`: that option's bytes on disk, what the weights weigh when kept quantized)."""
        assert self.profile is not None
        return source.preflight(self.profile, context, stored_bytes=size if recipe else None,
                                **self.kv_fit_args())

    def _import_steps(self, job: int, path: Path, recipe: str | None,
                      context: int | None = None) -> Iterator[Step]:
        from engine.importers import detect, import_path, open_source  # start-up: when one runs
        from engine.quant.quantize import Requantize, expected_sizes  # start-up: as above

        kind = detect(path)
        yield self.import_started, (job, {"path": str(path), "kind": kind})
        # Will it fit: refused here, before the library is touched.
        source = open_source(path)
        size = None
        if recipe and self.profile is not None and not self.profile.dequantize:
            try:
                size = expected_sizes(source, [recipe])[recipe][1]
            except StrataError:
                size = None  # 'auto' or a file: its size is known once it is planned
        fit = self._import_fit(source, recipe, size, context)
        if not fit.fits:
            raise ImportFailed(fit.refusal(source.path.name))
        last = [-1]

        def on_progress(done: int, total: int) -> None:
            permille = int(1000 * done / max(total, 1))
            if permille != last[0]:
                last[0] = permille
                self.import_progress.emit(job, permille, 1000)
            self._sample()

        # An import with a recipe: the importer opens the source, quantization makes the model.
        manifest = import_path(self.library, path, progress=on_progress,
                               cancel=lambda: self._is_cancelled(job),
                               requantize=Requantize(recipe) if recipe else None,
                               context=context)
        yield self.import_finished, (job, manifest)

    def _prefix_clear_steps(self, job: int) -> Iterator[Step]:
        runs, size = self.pool.clear_prefix()
        yield self.prefix_cleared, (job, {"runs": runs, "bytes": size})

    def _remove_steps(self, job: int, name: str) -> Iterator[Step]:
        manifest = self.library.get(name)
        if self.pool.lm is not None and self.pool.lm.manifest["name"] == manifest["name"]:
            self.pool.unload()
        self.library.remove(manifest["name"])
        yield self.model_removed, (job, manifest["name"])


# -- the GUI-side handle ------------------------------------------------------------------
class Engine(QObject):
    """Starts the engine thread, forwards requests to it, and re-emits its events here.

    The event signals below mirror `EngineWorker`'s and are emitted on the GUI thread, so
    anything connected to them (a lambda, pytest-qt's waitSignal) runs there too.
    """

    busy_changed = Signal(bool)
    starter_progressed = Signal(str, int, int)
    starter_ready = Signal(dict)
    model_loading = Signal(str)
    model_loaded = Signal(dict)
    reply_started = Signal(int)
    reply_delta = Signal(int, str)
    reply_finished = Signal(int, dict)
    import_planned = Signal(int, dict)
    import_started = Signal(int, dict)
    import_progress = Signal(int, int, int)
    import_finished = Signal(int, dict)
    model_removed = Signal(int, str)
    error_occurred = Signal(int, str, str)
    memory_sampled = Signal(object)
    prefix_warmed = Signal(int, int, dict)
    settings_applied = Signal(dict)
    prefix_cleared = Signal(int, dict)
    profile_chosen = Signal(object)
    document_read = Signal(int, dict)

    starter_requested = Signal(int, bool)
    load_requested = Signal(int, str)
    load_across_requested = Signal(int, str, list, str)  # job, model, waiters, key ("": none)
    reply_requested = Signal(int, object)
    import_planned_requested = Signal(int, str)
    import_requested = Signal(int, str, str, int)  # job, path, recipe ("": as stored), context
    remove_requested = Signal(int, str)
    chat_forgotten = Signal(int)
    prewarm_requested = Signal(int, int, str, str)
    settings_requested = Signal(dict)
    prefix_clear_requested = Signal(int)
    document_requested = Signal(int, str, str)  # job, path, model
    server_job_requested = Signal(object, object)  # host, job (emitted from HTTP threads)
    shutdown_requested = Signal()

    def __init__(self, home: Path, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._jobs = itertools.count(1)
        self._thread = QThread()
        self._thread.setObjectName("strata-engine")
        self.worker = EngineWorker(home)
        self.worker.moveToThread(self._thread)
        self._thread.started.connect(self.worker._on_thread_started)
        self.starter_requested.connect(self.worker._on_starter_requested)
        self.load_requested.connect(self.worker._on_load_requested)
        self.load_across_requested.connect(self.worker._on_load_across_requested)
        self.reply_requested.connect(self.worker._on_reply_requested)
        self.import_requested.connect(self.worker._on_import_requested)
        self.import_planned_requested.connect(self.worker._on_import_planned_requested)
        self.remove_requested.connect(self.worker._on_remove_requested)
        self.chat_forgotten.connect(self.worker._on_chat_forgotten)
        self.prewarm_requested.connect(self.worker._on_prewarm_requested)
        self.settings_requested.connect(self.worker._on_settings_requested)
        self.prefix_clear_requested.connect(self.worker._on_prefix_clear_requested)
        self.document_requested.connect(self.worker._on_document_requested)
        self.server_job_requested.connect(self.worker._on_server_job_requested)
        self.shutdown_requested.connect(self.worker._on_shutdown_requested)
        for name in ("busy_changed", "starter_progressed", "starter_ready", "model_loading",
                     "model_loaded", "reply_started", "reply_delta", "reply_finished",
                     "import_planned", "import_started", "import_progress", "import_finished",
                     "model_removed", "error_occurred", "memory_sampled", "prefix_warmed",
                     "settings_applied", "prefix_cleared", "profile_chosen", "document_read"):
            getattr(self.worker, name).connect(getattr(self, name))  # queued: GUI thread
        self.busy_changed.connect(self._on_busy_changed)
        self._busy = False
        self._thread.start()

    @property
    def home(self) -> Path:
        return Path(self.worker.library.home)

    def manifests(self) -> list[dict[str, Any]]:
        """The library's models. Reads manifest files only, so the GUI thread may call it."""
        return list(self.worker.library.manifests())

    @property
    def busy(self) -> bool:
        """Whether the engine thread is running a job (as last reported by it)."""
        return self._busy

    @Slot(bool)
    def _on_busy_changed(self, busy: bool) -> None:
        self._busy = busy

    def _next(self) -> int:
        return next(self._jobs)

    def ensure_starter(self, load: bool = True) -> int:
        job = self._next()
        self.starter_requested.emit(job, load)
        return job

    def load(self, name: str) -> int:
        job = self._next()
        self.load_requested.emit(job, name)
        return job

    def load_across(self, name: str, waiters: list[str], key: str | None = None) -> int:
        """Load `name` split across this Mac and the Macs waiting at `waiters`; `key` is the
        server's key, proved to Macs off loopback (None: $STRATA_API_KEY)."""
        job = self._next()
        self.load_across_requested.emit(job, name, list(waiters), key or "")
        return job

    def reply(self, request: ReplyRequest) -> int:
        job = self._next()
        self.reply_requested.emit(job, request)
        return job

    def plan_import(self, path: Path | str) -> int:
        """Ask what an import of `path` can do (kind, recipes, sizes): `import_planned`."""
        job = self._next()
        self.import_planned_requested.emit(job, str(path))
        return job

    def import_path(self, path: Path | str, recipe: str | None = None,
                    context: int | None = None) -> int:
        """Import `path` as stored, or requantized by `recipe` (a built-in name or file); an
        import that would not fit at `context` (None: the chosen one) is refused first."""
        job = self._next()
        self.import_requested.emit(job, str(path), recipe or "", int(context or 0))
        return job

    @property
    def profile(self) -> ComputeProfile | None:
        """The compute profile models load in (None until the engine thread has started)."""
        return self.worker.profile

    def fits(self, manifests: list[dict[str, Any]]) -> dict[str, Fit]:
        """Each library model's fit at its chosen context, from its config.json and its
        weights' headers (else the manifest's params and bytes): file reads and psutil only.
        The loaded model's weights count as free (a load replaces it). Empty until the
        profile is known."""
        profile = self.profile
        if profile is None:
            return {}
        kv = self.worker.kv_fit_args()
        out: dict[str, Fit] = {}
        for m in manifests:
            folder = Path(str(m.get("path", "")))
            try:
                config = json.loads((folder / "config.json").read_text())
            except (OSError, ValueError):
                continue  # no figure rather than a wrong one
            params, size = int(m.get("params") or 0), int(m.get("bytes") or 0)
            try:
                # the headers say which weights are quantized how (and so what a load keeps
                # for its decode steps); the manifest's two figures where they cannot
                sizes = WeightSizes.from_folder(config, folder)
            except (StrataError, OSError, ValueError):
                sizes = WeightSizes(quant_params=params, quant_bytes=size)
            try:
                out[str(m["name"])] = estimate(config, sizes, profile,
                                               chosen_context(config, folder), **kv)
            except StrataError:
                continue  # a bad STRATA_CONTEXT or memory cap: the load will say so
        return out

    def remove(self, name: str) -> int:
        job = self._next()
        self.remove_requested.emit(job, name)
        return job

    def forget_chat(self, chat_id: int) -> None:
        self.chat_forgotten.emit(chat_id)

    def prewarm(self, chat_id: int, model: str, system: str) -> int:
        """Prefill `system` for chat `chat_id` if `model` is loaded (see the module doc)."""
        job = self._next()
        self.prewarm_requested.emit(job, chat_id, model, system)
        return job

    def apply_settings(self, settings: dict[str, Any]) -> None:
        """Engine settings (app.chat.store.EngineSettings.as_dict()) for the loaded model and
        every later one; `settings_applied` or an error_occurred('settings') answers."""
        self.settings_requested.emit(dict(settings))

    def read_document(self, path: Path | str, model: str) -> int:
        """Read a document for a chat and measure it on `model` (see the module doc)."""
        job = self._next()
        self.document_requested.emit(job, str(path), model)
        return job

    def clear_prefix_cache(self) -> int:
        """Remove every stored prefix from the disk; `prefix_cleared` answers."""
        job = self._next()
        self.prefix_clear_requested.emit(job)
        return job

    def run_server_job(self, host: ServerHost, job: Job) -> None:
        """Queue a server request on the engine thread (any thread may call this)."""
        self.server_job_requested.emit(host, job)

    def cancel(self, job: int) -> None:
        self.worker.cancel(job)

    def shutdown(self, timeout_ms: int = 30_000) -> None:
        """Stop every job at its next step, end the thread and wait for it (window close)."""
        if not self._thread.isRunning():
            return
        self.worker.cancel_all()
        self.shutdown_requested.emit()
        self._thread.wait(timeout_ms)

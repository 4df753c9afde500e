"""The one engine thread: requests in as queued slot calls, engine events out as Qt signals.

Contract: `Engine` (GUI thread) starts a QThread and moves an `EngineWorker` onto it. Every
engine call (fetch the starter, load, generate, import, remove) runs on that thread, so MLX
streams stay with the thread that made them. Each job is a generator of (signal, args)
steps; the runner emits each step and checks the job's cancel flag between steps, as in
superqt's generator workers. The GUI thread never waits on the engine, except in
`Engine.shutdown()` when the window closes. `Engine` re-emits the worker's events on the
GUI thread; the rest of the app connects to those, never to the worker itself.

Caches: every model the worker loads gets the app's engine settings (`apply_settings`: the KV
mode and budgets as `lm.kv_settings`, for sessions made after them) and, unless turned off,
the SSD prefix cache under STRATA_HOME/prefix, so prompt prefixes stay warm across restarts.
`prewarm(chat, model, system)` prefills a chat's system prompt (with the chat template's
preamble) into that chat's session, restoring it from the prefix cache where it is stored,
so the chat's first message prefills only its own tokens. Server jobs (app/server.py) run on
the same thread between chat jobs, over the same model and prefix cache.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, QThread, QTimer, Signal, SignalInstance, Slot

import app.compat  # noqa: F401  (PySide6 work-around, see there)
from engine.errors import Cancelled, StrataError
from engine.platform import release_freed_memory

if TYPE_CHECKING:
    from engine.server.host import Host, Job, ModelPool

log = logging.getLogger(__name__)

Step = tuple[SignalInstance, tuple[Any, ...]]
MAX_SESSIONS = 8  # chats whose KV stays in RAM; older ones prefill again when reopened
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


# -- the worker (lives on the engine thread) ----------------------------------------------
class EngineWorker(QObject):
    """Owns the library, the loaded model and the chat sessions. Lives on the engine thread."""

    busy_changed = Signal(bool)
    starter_progressed = Signal(str, int, int)  # message, done, total (0: no measure)
    starter_ready = Signal(dict)
    model_loading = Signal(str)
    model_loaded = Signal(dict)  # name, path, weights_bytes, profile, phases
    reply_started = Signal(int)
    reply_delta = Signal(int, str)
    reply_finished = Signal(int, dict)  # job, stats
    import_planned = Signal(int, dict)  # job, engine.quant.quantize.import_options(...)
    import_started = Signal(int, dict)  # job, {"path", "kind"}
    import_progress = Signal(int, int, int)  # job, done, total
    import_finished = Signal(int, dict)  # job, manifest
    model_removed = Signal(int, str)
    error_occurred = Signal(int, str, str)  # job, what ("reply", "import", ...), message
    memory_sampled = Signal(object)  # engine.platform.MemorySnapshot
    prefix_warmed = Signal(int, int, dict)  # job, chat, {tokens, cached, prefilled, seconds}
    settings_applied = Signal(dict)  # the engine settings now in force
    prefix_cleared = Signal(int, dict)  # job, {"runs", "bytes"} removed from the disk

    def __init__(self, home: Path) -> None:
        super().__init__()
        from engine.library import Library

        self.library = Library(home)
        self.home = Path(self.library.home)
        self._lm: Any = None
        self._kv_settings: Any = None  # engine.kv.KVSettings once settings are applied
        self._prefix_enabled = True
        self._prefix_mb: float | None = None  # the prefix folder's budget; None: environment's
        self._prefix_reason = "no model loaded"
        self._server_models: ModelPool | None = None
        self._weights_bytes: int | None = None
        self._sessions: OrderedDict[int, Any] = OrderedDict()
        self._cancelled: set[int] = set()
        self._cancel_all = False
        self._lock = threading.Lock()
        self._last_sample = 0.0
        self._timer: QTimer | None = None

    def _close_sessions(self, chat_id: int | None = None) -> None:
        """Drop one chat's session (or all), releasing what its KV cache holds."""
        ids = list(self._sessions) if chat_id is None else [chat_id]
        for key in ids:
            session = self._sessions.pop(key, None)
            close = getattr(getattr(session, "cache", None), "close", None)
            if close is not None:
                close()  # a paged cache's threads and files; nothing for mlx-lm's
        if chat_id is None and self._server_models is not None:
            for pc in list(self._server_models.caches):
                self._server_models.discard(pc)
        release_freed_memory()  # what the dropped KV held goes back to the OS (glibc)

    def _unload(self) -> None:
        """Forget the loaded model: sessions closed, queued prefix pages written."""
        self._close_sessions()
        lm, self._lm, self._weights_bytes = self._lm, None, None
        if lm is not None and lm.prefix_cache is not None:
            lm.prefix_cache.close()  # flushes pages still queued for the disk
            lm.prefix_cache = None
        del lm
        release_freed_memory()

    def _prompt_caches(self) -> list[Any]:
        """Every PromptCache the worker holds: the chats' and the server's."""
        caches = [s.cache for s in self._sessions.values()]
        if self._server_models is not None:
            caches += list(self._server_models.caches)
        return caches

    # -- engine settings (engine thread) -------------------------------------------------
    def _kv_from(self, settings: dict[str, Any]) -> Any:
        from engine.kv import settings_from_env

        ram = int(settings.get("kv_ram_mb") or 0)
        mode = str(settings.get("kv_mode") or "mlx")
        # KV bits apply to the paged cache only; mlx-lm's in-memory cache stays 16-bit.
        bits = int(settings.get("kv_bits") or 16) if mode != "mlx" else 16
        return settings_from_env(mode=mode, bits=bits,
                                 ram_mb=ram if ram > 0 else None,
                                 budget_tokens=int(settings.get("kv_budget_tokens") or 2048),
                                 ssd_dir=self.home / "kv")

    def _prefix_settings(self) -> Any:
        import os

        from engine.kv.prefix import settings_from_env

        folder = None if os.environ.get("STRATA_PREFIX_DIR") else self.home / "prefix"
        return settings_from_env(folder=folder, budget_mb=self._prefix_mb)

    def _apply_to(self, lm: Any) -> None:
        """Give `lm` the KV settings and the prefix cache (or take it away)."""
        lm.kv_settings = self._kv_settings
        if not self._prefix_enabled:
            if lm.prefix_cache is not None:
                lm.prefix_cache.close()
                lm.prefix_cache = None
            self._prefix_reason = "prefix cache off in the settings"
            return
        if lm.prefix_cache is not None:
            budget = self._prefix_settings().budget_mb
            if budget != lm.prefix_cache.settings.budget_mb:
                lm.prefix_cache.set_budget(budget)  # evicts down to it in the background
        else:
            try:
                lm.enable_prefix_cache(self._prefix_settings())
            except StrataError as exc:  # an unwritable folder: the cache is optional
                log.warning("prefix cache off: %s", exc)
                self._prefix_reason = f"prefix cache unavailable: {exc}"

    def ensure_model(self, name: str) -> Any:
        """Load `name` unless it is loaded (emitting model_loading/model_loaded); the model.
        Engine thread only: server jobs call it through their `Models`."""
        for signal, args in self._load_steps(name):
            signal.emit(*args)
        return self._lm

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
        self._unload()
        thread = self.thread()
        if thread is not None:
            thread.quit()

    @Slot(int, bool)
    def _on_starter_requested(self, job: int, load: bool) -> None:
        self._run(job, "starter", self._starter_steps(job, load))

    @Slot(int, str)
    def _on_load_requested(self, job: int, name: str) -> None:
        self._run(job, "load", self._load_steps(name))

    @Slot(int, object)
    def _on_reply_requested(self, job: int, request: ReplyRequest) -> None:
        self._run(job, "reply", self._reply_steps(job, request))

    @Slot(int, str)
    def _on_import_planned_requested(self, job: int, path: str) -> None:
        self._run(job, "import", self._plan_steps(job, Path(path)))

    @Slot(int, str, str)
    def _on_import_requested(self, job: int, path: str, recipe: str) -> None:
        self._run(job, "import", self._import_steps(job, Path(path), recipe or None))

    @Slot(int, str)
    def _on_remove_requested(self, job: int, name: str) -> None:
        self._run(job, "remove", self._remove_steps(job, name))

    @Slot(int)
    def _on_chat_forgotten(self, chat_id: int) -> None:
        self._close_sessions(chat_id)
        self._sample(force=True)

    @Slot(int, int, str, str)
    def _on_prewarm_requested(self, job: int, chat_id: int, model: str, system: str) -> None:
        self._run(job, "prewarm", self._prewarm_steps(job, chat_id, model, system))

    @Slot(dict)
    def _on_settings_requested(self, settings: dict[str, Any]) -> None:
        """New engine settings: they apply to sessions made from now on, so the open chats'
        sessions are dropped (their next message restores or prefills again)."""
        try:
            kv = self._kv_from(settings)
            mb = settings.get("prefix_mb")
            prefix_mb = None if mb is None else max(0.0, float(mb))
        except (StrataError, ValueError, TypeError) as exc:
            self.error_occurred.emit(0, "settings", f"engine settings refused: {exc}")
            return
        self._kv_settings = kv
        self._prefix_enabled = bool(settings.get("prefix_cache", True))
        self._prefix_mb = prefix_mb
        self._prefix_reason = ("no model loaded" if self._prefix_enabled
                               else "prefix cache off in the settings")
        if self._lm is not None:
            self._close_sessions()
            self._apply_to(self._lm)
        self._sample(force=True)
        self.settings_applied.emit(dict(settings))

    @Slot(int)
    def _on_prefix_clear_requested(self, job: int) -> None:
        self._run(job, "prefix clear", self._prefix_clear_steps(job))

    @Slot(object, object)
    def _on_server_job_requested(self, host: Host, job: Job) -> None:
        """One request of the app's local server (app/server.py), run here like a chat job."""
        from engine.server.host import ModelPool

        worker = self

        class _WorkerModels(ModelPool):
            """The server's `Models` over this worker: its loaded model, its own caches."""

            def get(self, name: str) -> Any:
                lm = worker.ensure_model(name)
                if self.lm is not lm:
                    for pc in list(self.caches):
                        self.discard(pc)
                    self.lm = lm
                return lm

        if self._server_models is None:
            self._server_models = _WorkerModels(self.library, caches_per_model=4)
        started = getattr(host, "job_started", None)
        finished = getattr(host, "job_finished", None)
        if started is not None:
            started(job)
        self.busy_changed.emit(True)
        try:
            if not job.cancelled and not self._cancel_all:
                job.run(self._server_models)
        except Exception:  # jobs report their own errors; this is a last resort
            log.error("server job failed:\n%s", traceback.format_exc())
        finally:
            if finished is not None:
                finished(job)
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
        from engine.platform import memory_snapshot

        caches = self._prompt_caches()
        kv = sum(int(pc.nbytes) for pc in caches) if self._lm else None
        kv_ssd, kv_reason = None, "paged KV off"
        settings = self._kv_settings
        if settings is not None and settings.mode != "mlx":
            if not settings.ssd:
                kv_reason = "SSD tier off"
            else:
                stores = {id(c.store): c.store for pc in caches for c in pc.cache
                          if hasattr(c, "store")}
                kv_ssd = sum(int(st.stats()["bytes_ssd"]) for st in stores.values())
        prefix, prefix_reason = None, self._prefix_reason
        lm = self._lm
        if lm is not None and lm.prefix_cache is not None:
            prefix = lm.prefix_cache.disk_bytes()
        elif lm is None and self._prefix_enabled:
            from engine.kv.prefix import prefix_folder_bytes

            try:
                prefix = prefix_folder_bytes(self._prefix_settings())  # earlier runs' pages
            except StrataError as exc:  # a bad STRATA_PREFIX_* value
                prefix_reason = f"prefix cache unavailable: {exc}"
        self.memory_sampled.emit(memory_snapshot(self._weights_bytes, kv, kv_ssd, prefix,
                                                 kv_reason, prefix_reason))

    # -- jobs --------------------------------------------------------------------------
    def _starter_steps(self, job: int, load: bool) -> Iterator[Step]:
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
        """Make `name` the loaded model (unloading another); no-op if it already is."""
        from engine.platform import parameter_bytes
        from engine.runtime.generate import LoadedModel
        from engine.telemetry import Timeline

        manifest = self.library.get(name)
        if self._lm is not None and self._lm.manifest["name"] == manifest["name"]:
            return
        yield self.model_loading, (manifest["name"],)
        self._unload()
        timeline = Timeline()
        lm = LoadedModel.load(manifest["name"], library=self.library, timeline=timeline)
        if self._kv_settings is None:
            self._kv_settings = self._kv_from({})  # the environment's (STRATA_KV_*)
        self._apply_to(lm)
        self._lm = lm
        self._weights_bytes = parameter_bytes(lm.model)
        info = {"name": manifest["name"], "path": manifest["path"],
                "weights_bytes": self._weights_bytes, "profile": lm.profile.name,
                "phases": timeline.durations()}
        self._sample(force=True)
        yield self.model_loaded, (info,)

    def _reply_steps(self, job: int, req: ReplyRequest) -> Iterator[Step]:
        from engine.runtime.sampling import SamplingParams
        from engine.telemetry import Timeline

        params = SamplingParams(temperature=req.temperature, top_p=req.top_p,
                                seed=req.seed).validate()
        loaded_before = self._lm
        load_s = 0.0
        for step in self._load_steps(req.model):
            if step[0] is self.model_loaded:
                load_s = sum(step[1][0]["phases"].values())
            yield step
        lm = self._lm
        assert lm is not None
        session = self._session_for(req.chat_id, lm)
        session.messages = ([{"role": "system", "content": req.system}] if req.system else [])
        session.messages += [dict(m) for m in req.history]
        yield self.reply_started, (job,)
        timeline = Timeline()
        last = None
        for ev in session.send(req.text, params, req.max_tokens,
                               cancel=lambda: self._is_cancelled(job), timeline=timeline):
            last = ev
            if ev.text:
                yield self.reply_delta, (job, ev.text)
        assert last is not None
        phases = {"load": load_s} if loaded_before is not lm and load_s else {}
        phases.update(timeline.durations())
        stats = {
            "model": lm.manifest["name"], "ttft_s": last.ttft_s, "decode_tps": last.decode_tps,
            "prefill_tps": last.prefill_tps, "prompt_tokens": last.prompt_tokens,
            "cached_tokens": last.cached_tokens, "generated_tokens": last.generated_tokens,
            "peak_memory_bytes": last.peak_memory_bytes,
            "finish_reason": last.finish_reason or "stop", "phases": phases,
        }
        yield self.reply_finished, (job, stats)

    def _session_for(self, chat_id: int, lm: Any) -> Any:
        """The chat's session on `lm` (a new one if none), most recently used last."""
        from engine.runtime.generate import ChatSession

        session = self._sessions.pop(chat_id, None)
        if session is None or session.lm is not lm:
            if session is not None:
                session.cache.close()
            session = ChatSession(lm)
        self._sessions[chat_id] = session
        while len(self._sessions) > MAX_SESSIONS:
            self._close_sessions(next(iter(self._sessions)))  # least recently used
        return session

    def _prewarm_steps(self, job: int, chat_id: int, model: str, system: str
                       ) -> Iterator[Step]:
        """Prefill the chat template's preamble and `system` into the chat's session (or
        restore them from the prefix cache); only if `model` is the one loaded."""
        from engine.runtime.generate import generate
        from engine.runtime.sampling import SamplingParams
        from engine.server.host import shared_prefix
        from engine.telemetry import Timeline

        lm = self._lm
        if lm is None or lm.manifest["name"] != model or not system.strip():
            return
        # What every first message of this chat starts with: the tokens two different user
        # messages share after the system prompt (preamble, system prompt, user header).
        a, b = ({"role": "user", "content": c} for c in ("a", "b"))
        sys_msg = {"role": "system", "content": system}
        ids_a = lm.tokenizer.encode_chat([sys_msg, a])
        prefix = ids_a[:shared_prefix(ids_a, lm.tokenizer.encode_chat([sys_msg, b]))]
        if len(prefix) < 2:
            return
        session = self._session_for(chat_id, lm)
        held = shared_prefix(session.cache.tokens, prefix)
        info: dict[str, Any] = {"model": model, "tokens": len(prefix), "cached": held,
                                "prefilled": 0, "seconds": 0.0, "phases": {}}
        if held < len(prefix) - 1:
            timeline = Timeline()
            t0 = time.perf_counter()
            last = None
            for ev in generate(lm, prefix, SamplingParams(temperature=0.0), max_tokens=1,
                               cancel=lambda: self._is_cancelled(job),
                               prompt_cache=session.cache, timeline=timeline):
                last = ev
            if last is not None and last.finish_reason == "cancelled":
                session.cache.clear()
                raise Cancelled("prewarm cancelled")
            cached = last.cached_tokens if last is not None else 0
            info.update(cached=cached, prefilled=len(prefix) - cached,
                        seconds=time.perf_counter() - t0, phases=timeline.durations())
        yield self.prefix_warmed, (job, chat_id, info)

    def _plan_steps(self, job: int, path: Path) -> Iterator[Step]:
        from engine.quant.quantize import import_options

        yield self.import_planned, (job, import_options(self.library, path))

    def _import_steps(self, job: int, path: Path, recipe: str | None) -> Iterator[Step]:
        from engine.importers import detect, import_path

        kind = detect(path)
        yield self.import_started, (job, {"path": str(path), "kind": kind})
        last = [-1]

        def on_progress(done: int, total: int) -> None:
            permille = int(1000 * done / max(total, 1))
            if permille != last[0]:
                last[0] = permille
                self.import_progress.emit(job, permille, 1000)
            self._sample()

        manifest = import_path(self.library, path, progress=on_progress, recipe=recipe,
                               cancel=lambda: self._is_cancelled(job))
        yield self.import_finished, (job, manifest)

    def _prefix_clear_steps(self, job: int) -> Iterator[Step]:
        lm = self._lm
        if lm is not None and lm.prefix_cache is not None:
            runs, size = lm.prefix_cache.clear()  # queued runs are written, then go too
        else:
            from engine.kv.prefix import clear_folder

            runs, size = clear_folder(self._prefix_settings().root())
        yield self.prefix_cleared, (job, {"runs": runs, "bytes": size})

    def _remove_steps(self, job: int, name: str) -> Iterator[Step]:
        manifest = self.library.get(name)
        if self._lm is not None and self._lm.manifest["name"] == manifest["name"]:
            self._unload()
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

    starter_requested = Signal(int, bool)
    load_requested = Signal(int, str)
    reply_requested = Signal(int, object)
    import_planned_requested = Signal(int, str)
    import_requested = Signal(int, str, str)  # job, path, recipe ("": as stored)
    remove_requested = Signal(int, str)
    chat_forgotten = Signal(int)
    prewarm_requested = Signal(int, int, str, str)
    settings_requested = Signal(dict)
    prefix_clear_requested = Signal(int)
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
        self.reply_requested.connect(self.worker._on_reply_requested)
        self.import_requested.connect(self.worker._on_import_requested)
        self.import_planned_requested.connect(self.worker._on_import_planned_requested)
        self.remove_requested.connect(self.worker._on_remove_requested)
        self.chat_forgotten.connect(self.worker._on_chat_forgotten)
        self.prewarm_requested.connect(self.worker._on_prewarm_requested)
        self.settings_requested.connect(self.worker._on_settings_requested)
        self.prefix_clear_requested.connect(self.worker._on_prefix_clear_requested)
        self.server_job_requested.connect(self.worker._on_server_job_requested)
        self.shutdown_requested.connect(self.worker._on_shutdown_requested)
        for name in ("busy_changed", "starter_progressed", "starter_ready", "model_loading",
                     "model_loaded", "reply_started", "reply_delta", "reply_finished",
                     "import_planned", "import_started", "import_progress", "import_finished",
                     "model_removed", "error_occurred", "memory_sampled", "prefix_warmed",
                     "settings_applied", "prefix_cleared"):
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

    def reply(self, request: ReplyRequest) -> int:
        job = self._next()
        self.reply_requested.emit(job, request)
        return job

    def plan_import(self, path: Path | str) -> int:
        """Ask what an import of `path` can do (kind, recipes, sizes): `import_planned`."""
        job = self._next()
        self.import_planned_requested.emit(job, str(path))
        return job

    def import_path(self, path: Path | str, recipe: str | None = None) -> int:
        """Import `path` as stored, or requantized by `recipe` (a built-in name or file)."""
        job = self._next()
        self.import_requested.emit(job, str(path), recipe or "")
        return job

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

    def clear_prefix_cache(self) -> int:
        """Remove every stored prefix from the disk; `prefix_cleared` answers."""
        job = self._next()
        self.prefix_clear_requested.emit(job)
        return job

    def run_server_job(self, host: Host, job: Job) -> None:
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

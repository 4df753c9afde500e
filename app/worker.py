"""The one engine thread: requests in as queued slot calls, engine events out as Qt signals.

Contract: `Engine` (GUI thread) starts a QThread and moves an `EngineWorker` onto it. Every
engine call (fetch the starter, load, generate, import, remove) runs on that thread, so MLX
streams stay with the thread that made them. Each job is a generator of (signal, args)
steps; the runner emits each step and checks the job's cancel flag between steps, as in
superqt's generator workers. The GUI thread never waits on the engine, except in
`Engine.shutdown()` when the window closes. `Engine` re-emits the worker's events on the
GUI thread; the rest of the app connects to those, never to the worker itself.
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
from typing import Any

from PySide6.QtCore import QObject, QThread, QTimer, Signal, SignalInstance, Slot

import app.compat  # noqa: F401  (PySide6 work-around, see there)
from engine.errors import Cancelled, StrataError

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
    import_started = Signal(int, dict)  # job, {"path", "kind"}
    import_progress = Signal(int, int, int)  # job, done, total
    import_finished = Signal(int, dict)  # job, manifest
    model_removed = Signal(int, str)
    error_occurred = Signal(int, str, str)  # job, what ("reply", "import", ...), message
    memory_sampled = Signal(object)  # engine.platform.MemorySnapshot

    def __init__(self, home: Path) -> None:
        super().__init__()
        from engine.library import Library

        self.library = Library(home)
        self._lm: Any = None
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
        self._close_sessions()
        self._lm = None
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
    def _on_import_requested(self, job: int, path: str) -> None:
        self._run(job, "import", self._import_steps(job, Path(path)))

    @Slot(int, str)
    def _on_remove_requested(self, job: int, name: str) -> None:
        self._run(job, "remove", self._remove_steps(job, name))

    @Slot(int)
    def _on_chat_forgotten(self, chat_id: int) -> None:
        self._close_sessions(chat_id)
        self._sample(force=True)

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

        kv = sum(int(s.cache.nbytes) for s in self._sessions.values()) if self._lm else None
        self.memory_sampled.emit(memory_snapshot(self._weights_bytes, kv))

    # -- jobs --------------------------------------------------------------------------
    def _starter_steps(self, job: int, load: bool) -> Iterator[Step]:
        from engine.library.starter import ensure_starter

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
        self._close_sessions()
        self._lm, self._weights_bytes = None, None
        timeline = Timeline()
        lm = LoadedModel.load(manifest["name"], library=self.library, timeline=timeline)
        self._lm = lm
        self._weights_bytes = parameter_bytes(lm.model)
        info = {"name": manifest["name"], "path": manifest["path"],
                "weights_bytes": self._weights_bytes, "profile": lm.profile.name,
                "phases": timeline.durations()}
        self._sample(force=True)
        yield self.model_loaded, (info,)

    def _reply_steps(self, job: int, req: ReplyRequest) -> Iterator[Step]:
        from engine.runtime.generate import ChatSession
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
        session = self._sessions.pop(req.chat_id, None)
        if session is None or session.lm is not lm:
            session = ChatSession(lm)
        self._sessions[req.chat_id] = session  # most recent last
        while len(self._sessions) > MAX_SESSIONS:
            self._close_sessions(next(iter(self._sessions)))  # least recently used
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

    def _import_steps(self, job: int, path: Path) -> Iterator[Step]:
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

        manifest = import_path(self.library, path, progress=on_progress,
                               cancel=lambda: self._is_cancelled(job))
        yield self.import_finished, (job, manifest)

    def _remove_steps(self, job: int, name: str) -> Iterator[Step]:
        manifest = self.library.get(name)
        if self._lm is not None and self._lm.manifest["name"] == manifest["name"]:
            self._close_sessions()
            self._lm, self._weights_bytes = None, None
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
    import_started = Signal(int, dict)
    import_progress = Signal(int, int, int)
    import_finished = Signal(int, dict)
    model_removed = Signal(int, str)
    error_occurred = Signal(int, str, str)
    memory_sampled = Signal(object)

    starter_requested = Signal(int, bool)
    load_requested = Signal(int, str)
    reply_requested = Signal(int, object)
    import_requested = Signal(int, str)
    remove_requested = Signal(int, str)
    chat_forgotten = Signal(int)
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
        self.remove_requested.connect(self.worker._on_remove_requested)
        self.chat_forgotten.connect(self.worker._on_chat_forgotten)
        self.shutdown_requested.connect(self.worker._on_shutdown_requested)
        for name in ("busy_changed", "starter_progressed", "starter_ready", "model_loading",
                     "model_loaded", "reply_started", "reply_delta", "reply_finished",
                     "import_started", "import_progress", "import_finished", "model_removed",
                     "error_occurred", "memory_sampled"):
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

    def import_path(self, path: Path | str) -> int:
        job = self._next()
        self.import_requested.emit(job, str(path))
        return job

    def remove(self, name: str) -> int:
        job = self._next()
        self.remove_requested.emit(job, name)
        return job

    def forget_chat(self, chat_id: int) -> None:
        self.chat_forgotten.emit(chat_id)

    def cancel(self, job: int) -> None:
        self.worker.cancel(job)

    def shutdown(self, timeout_ms: int = 30_000) -> None:
        """Stop every job at its next step, end the thread and wait for it (window close)."""
        if not self._thread.isRunning():
            return
        self.worker.cancel_all()
        self.shutdown_requested.emit()
        self._thread.wait(timeout_ms)

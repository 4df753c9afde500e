"""The app's local OpenAI-compatible server, sharing the app's engine thread and caches.

Contract: `AppHost` implements engine.server.host.Host over the app's `Engine`: every request
becomes a job queued on the app's engine thread (EngineWorker), in arrival order with the
chat's own jobs, so it runs on the loaded model, fills and reads the same SSD prefix cache
and loads models through the same worker (the window hears model_loading/model_loaded). The
queue depth counts server requests accepted and not finished (`queue_depth_changed`).
`LocalServer` binds a socket (loopback unless an API key is set), runs engine.server.api's
Starlette app on uvicorn in a Python thread, and stops it (cancelling queued and running
requests) on `stop()`. Starlette and uvicorn are imported only in `LocalServer.start()`, so
the app's start-up never pays for them.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, Signal

import app.compat  # noqa: F401  (PySide6 work-around, see there)
from engine.errors import StrataError

if TYPE_CHECKING:
    from app.worker import Engine
    from engine.server.host import Job

log = logging.getLogger(__name__)
DEFAULT_PORT = 8765
STOP_WAIT_S = 5.0


class AppHost(QObject):
    """engine.server.host.Host over the app's engine thread. Thread-safe: the HTTP thread
    calls submit/cancel/status, the engine thread job_started/job_finished."""

    queue_depth_changed = Signal(int)  # emitted from any thread; queued to the GUI

    def __init__(self, engine: Engine, default_model: str = "",
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.engine = engine
        self.default_model = default_model  # the GUI thread keeps it at the loaded model
        self._lock = threading.Lock()
        self._waiting: list[Job] = []
        self._running: Job | None = None
        self._closed = False
        self._counts = {"completed": 0, "cancelled": 0}

    # -- Host (HTTP thread) ------------------------------------------------------------
    def manifests(self) -> list[dict[str, Any]]:
        return self.engine.manifests()

    def resolve(self, name: str | None) -> dict[str, Any]:
        # Start-up: the server side of the engine loads when a request comes, not with the window.
        from engine.server.host import RequestError

        m = self.engine.worker.library.find(name or self.default_model)
        if m is None:
            raise RequestError(f"model {name!r} is not in the library", status=404,
                               code="model_not_found", param="model")
        return dict(m)

    def submit(self, job: Job) -> int:
        # Start-up: the server side of the engine loads when a request comes, not with the window.
        from engine.server.host import RequestError

        with self._lock:
            if self._closed:
                raise RequestError("the server is shutting down", status=503,
                                   kind="server_error")
            self._waiting.append(job)
            depth = self._depth()
        # Emitted before the engine thread can finish the job, so its "0" arrives last.
        self.queue_depth_changed.emit(depth)
        self.engine.run_server_job(self, job)
        return depth

    def cancel(self, job: Job) -> None:
        job.cancel()  # a queued job returns at once when its turn comes; a running one stops

    def status(self) -> dict[str, Any]:
        with self._lock:
            waiting, running = len(self._waiting), int(self._running is not None)
            counts = dict(self._counts)
        return {"queue_depth": waiting + running, "running": running, "waiting": waiting,
                **counts, "model": self.default_model or None, "host": "app"}

    # -- the engine thread ---------------------------------------------------------------
    def job_started(self, job: Job) -> None:
        with self._lock:
            if job in self._waiting:
                self._waiting.remove(job)
            self._running = job

    def job_finished(self, job: Job) -> None:
        with self._lock:
            if self._running is job:
                self._running = None
            self._counts["cancelled" if job.cancelled else "completed"] += 1
            depth = self._depth()
        self.queue_depth_changed.emit(depth)

    # -- life cycle (GUI thread) -----------------------------------------------------------
    def stop(self) -> None:
        """Refuse new requests, fail the queued ones and cancel the running one."""
        # Start-up: the server side of the engine loads when a request comes, not with the window.
        from engine.server.host import RequestError

        with self._lock:
            self._closed = True
            dropped, self._waiting = list(self._waiting), []
            running = self._running
        if running is not None:
            running.cancel()
        for job in dropped:
            job.cancel()
            job.fail(RequestError("the server is shutting down", status=503,
                                  kind="server_error"))
        self.queue_depth_changed.emit(int(running is not None))

    def _depth(self) -> int:
        return len(self._waiting) + (self._running is not None)


class LocalServer(QObject):
    """The HTTP side: uvicorn in a thread, over an `AppHost`. GUI thread only."""

    started = Signal(str)  # the base URL, e.g. http://127.0.0.1:8765/v1
    stopped = Signal()
    queue_depth_changed = Signal(int)

    def __init__(self, engine: Engine, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.engine = engine
        self.host: AppHost | None = None
        self.address = ""
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._sock: Any = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
              api_key: str | None = None, default_model: str = "") -> str:
        """Bind and serve; returns the base URL. Raises StrataError if it cannot bind or
        the address is not loopback and no API key is set."""
        if self.running:
            return self.address
        import uvicorn

        from engine.server.api import bind, create_app, is_loopback  # Starlette, uvicorn

        if not is_loopback(host) and not api_key:
            raise StrataError(f"serving on {host or 'all interfaces'} exposes the model to the "
                              "network: set an API key first")
        sock = bind(host, port)
        app_host = AppHost(self.engine, default_model, self)
        app_host.queue_depth_changed.connect(self.queue_depth_changed)
        config = uvicorn.Config(create_app(app_host, api_key), log_level="warning",
                                access_log=False, lifespan="off", loop="asyncio", http="h11",
                                ws="none", timeout_graceful_shutdown=3)
        server = uvicorn.Server(config)

        def http() -> None:
            try:
                server.run(sockets=[sock])
            except Exception:  # noqa: BLE001  (the thread must not die silently)
                log.exception("the local server stopped on an error")

        thread = threading.Thread(target=http, name="strata-app-http", daemon=True)
        self.host, self._server, self._sock, self._thread = app_host, server, sock, thread
        thread.start()
        bound_host, bound_port = sock.getsockname()[:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        self.address = f"http://{shown}:{bound_port}/v1"
        self.started.emit(self.address)
        return self.address

    def set_default_model(self, name: str) -> None:
        if self.host is not None:
            self.host.default_model = name

    def stop(self) -> None:
        """Cancel requests, stop uvicorn and wait for its thread (a few seconds at most)."""
        if self._thread is None:
            return
        assert self.host is not None
        self.host.stop()
        self._server.should_exit = True
        self._thread.join(STOP_WAIT_S)
        self._sock.close()
        self.host.deleteLater()
        self.host, self._server, self._sock, self._thread = None, None, None, None
        self.address = ""
        self.stopped.emit()

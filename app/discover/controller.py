"""Discover's logic: search the Hub, list a repository's variants with their fit, download
(pause, resume across restarts, cancel) and import into the library.

Contract: `DiscoverController(engine, home)` owns the view and two threads of its own, one
for searches and variant listings, one for downloads (engine.importers.hub: network and
files, no MLX), so a long download never holds up a search and neither holds up a reply.
Each finished download is imported through `Engine.import_path` on the engine thread, as a
dropped file is (the fit is checked again there), and its files under STRATA_HOME/downloads
are removed once the library holds the model. Downloads left unfinished by an earlier run
are listed paused at start (`pending_downloads`); Resume goes on from their parts. Signals:
`results_shown(count)`, `variants_shown(repo_id)`, `download_paused(folder)` and
`download_done(folder, imported, model name or the one-line reason)`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.discover.view import DiscoverView, DownloadRow
from app.worker import Engine
from engine.errors import Cancelled, StrataError
from engine.importers.hub import (
    Variant,
    discard_download,
    download,
    downloaded_bytes,
    list_variants,
    pending_downloads,
    search_models,
    start_download,
)
from engine.library import Library
from engine.runtime.fit import Fit

log = logging.getLogger(__name__)


class HubWorker(QObject):
    """Runs hub jobs on its thread: each a request in, a finished/failed/cancelled signal out."""

    progressed = Signal(int, object, object)  # job, done, total (bytes: past 2**31)
    finished = Signal(int, str, object)  # job, what, result
    failed = Signal(int, str, str)  # job, what, one-line message
    cancelled = Signal(int, str)

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._cancelled: set[int] = set()
        self._all = False

    def cancel(self, job: int) -> None:
        with self._lock:
            self._cancelled.add(job)

    def cancel_all(self) -> None:
        with self._lock:
            self._all = True

    def _is_cancelled(self, job: int) -> bool:
        with self._lock:
            return self._all or job in self._cancelled

    @Slot(int, str, object)
    def _on_requested(self, job: int, what: str, args: dict[str, Any]) -> None:
        try:
            if self._is_cancelled(job):
                raise Cancelled(what)
            result: Any
            if what == "search":
                result = search_models(**args)
            elif what == "variants":
                result = list_variants(args["repo_id"], lambda: self._is_cancelled(job))
            else:
                last = [-1]

                def progress(done: int, total: int) -> None:
                    permille = 1000 * done // max(total, 1)
                    if permille != last[0]:
                        last[0] = permille
                        self.progressed.emit(job, done, total)

                result = str(download(Path(args["folder"]), progress,
                                      lambda: self._is_cancelled(job)))
            self.finished.emit(job, what, result)
        except Cancelled:
            self.cancelled.emit(job, what)
        except StrataError as exc:
            self.failed.emit(job, what, str(exc))
        except Exception as exc:  # a bug: keep the thread alive and say so
            log.error("hub %s job failed:\n%s", what, traceback.format_exc())
            self.failed.emit(job, what, f"internal error: {exc!r}")
        finally:
            with self._lock:
                self._cancelled.discard(job)


class _HubThread(QObject):
    """A QThread with a HubWorker on it; `request` queues a job there."""

    requested = Signal(int, str, object)

    def __init__(self, name: str, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.qthread = QThread()
        self.qthread.setObjectName(name)
        self.worker = HubWorker()
        self.worker.moveToThread(self.qthread)
        self.requested.connect(self.worker._on_requested)
        self.qthread.start()

    def stop(self, timeout_ms: int = 10_000) -> None:
        if self.qthread.isRunning():
            self.worker.cancel_all()
            self.qthread.quit()
            self.qthread.wait(timeout_ms)


@dataclass
class _Download:
    folder: Path
    variant: Variant
    row: DownloadRow
    job: int = 0  # the running download job (0: none)
    import_job: int = 0
    discard: bool = False  # cancel: remove the files once the job has stopped


class DiscoverController(QObject):
    results_shown = Signal(int)
    variants_shown = Signal(str)
    download_paused = Signal(str)
    download_done = Signal(str, bool, str)  # folder, imported, model name or reason
    library_changed = Signal()  # a manifest was updated (its source: the Hub, not a path)

    def __init__(self, engine: Engine, home: Path | None = None,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.engine = engine
        self.home = Path(home) if home is not None else engine.home
        self.view = DiscoverView()
        self._jobs = itertools.count(1)
        self._hub = _HubThread("strata-hub", self)
        self._fetcher = _HubThread("strata-downloads", self)
        self._search_job = 0
        self._variants_job = 0
        self._variants_repo = ""
        self.downloads: dict[str, _Download] = {}
        self.last_error = ""
        v = self.view
        v.search_requested.connect(self._on_search_requested)
        v.repo_selected.connect(self._on_repo_selected)
        v.download_requested.connect(self._on_download_requested)
        for t in (self._hub, self._fetcher):
            t.worker.finished.connect(self._on_job_finished)
            t.worker.failed.connect(self._on_job_failed)
            t.worker.cancelled.connect(self._on_job_cancelled)
        self._fetcher.worker.progressed.connect(self._on_download_progressed)
        engine.import_progress.connect(self._on_import_progress)
        engine.import_finished.connect(self._on_import_finished)
        engine.error_occurred.connect(self._on_error_occurred)
        engine.profile_chosen.connect(self._on_profile_chosen)
        self._load_pending()

    # -- public ----------------------------------------------------------------------------
    def search(self, query: str, fmt: str = "all", architecture: str = "", min_params: int = 0,
               max_params: int = 0) -> int:
        """Ask the Hub; `results_shown` answers (the first result's variants follow)."""
        job = self._search_job = next(self._jobs)
        self.view.set_status(f"Searching the Hub for {query!r}…" if query
                             else "Searching the Hub…")
        self._hub.requested.emit(job, "search", {
            "query": query, "fmt": fmt, "architecture": architecture,
            "min_params": min_params, "max_params": max_params})
        return job

    def show_variants(self, repo_id: str) -> int:
        job = self._variants_job = next(self._jobs)
        self._variants_repo = repo_id
        self.view.variants.set_variants([], [])
        self.view.variants_label.setText(f"Variants of <b>{repo_id}</b>: reading the "
                                         "repository…")
        self._hub.requested.emit(job, "variants", {"repo_id": repo_id})
        return job

    def download(self, variant: Variant) -> str | None:
        """Start (or resume) downloading `variant`; its folder, or None when refused."""
        fit = self.fit(variant)
        if fit is not None and fit.max_context <= 0:
            self.view.set_status(f"{variant.label} is too large for this Mac: "
                                 f"{fit.numbers()}, {fit.available_bytes / 1e9:.2f} GB "
                                 f"available ({fit.limit}).")
            return None
        folder = start_download(self.home, variant)
        key = str(folder)
        state = self.downloads.get(key)
        if state is None:
            row = self.view.add_row(key, f"{variant.repo_id} · {variant.label}")
            self._connect_row(row)
            state = self.downloads[key] = _Download(folder, variant, row)
        if not state.job and not state.import_job:
            self._start(state)
        return key

    def pause(self, key: str) -> None:
        state = self.downloads.get(key)
        if state is not None and state.job:
            self._fetcher.worker.cancel(state.job)

    def resume(self, key: str) -> None:
        state = self.downloads.get(key)
        if state is not None and not state.job and not state.import_job:
            self._start(state)

    def cancel(self, key: str) -> None:
        """Stop a download and remove its files (or dismiss a finished one)."""
        state = self.downloads.get(key)
        if state is None:
            return
        if state.job:
            state.discard = True
            self._fetcher.worker.cancel(state.job)
            return
        if state.import_job:
            return  # the engine is importing it; its result comes next
        self._forget(state)

    def fit(self, variant: Variant) -> Fit | None:
        """`variant`'s fit once imported, as the engine would count it (None: not yet known)."""
        profile = self.engine.profile
        if profile is None:
            return None
        try:
            return variant.fit(profile, **self.engine.worker.kv_fit_args())
        except StrataError:
            return None  # a bad STRATA_CONTEXT or memory cap: the import will say so

    def shutdown(self) -> None:
        """Stop both threads; a running download stops with its parts kept (resumed later)."""
        self._hub.stop()
        self._fetcher.stop()

    # -- internals -------------------------------------------------------------------------
    def _connect_row(self, row: DownloadRow) -> None:
        row.pause_requested.connect(self.pause)
        row.resume_requested.connect(self.resume)
        row.cancel_requested.connect(self.cancel)

    def _load_pending(self) -> None:
        for folder, variant, done in pending_downloads(self.home):
            key = str(folder)
            row = self.view.add_row(key, f"{variant.repo_id} · {variant.label}")
            self._connect_row(row)
            self.downloads[key] = _Download(folder, variant, row)
            row.show_paused(done, variant.bytes)

    def _start(self, state: _Download) -> None:
        state.job = next(self._jobs)
        state.discard = False
        state.row.show_progress(downloaded_bytes(state.folder, state.variant),
                                state.variant.bytes)
        self._fetcher.requested.emit(state.job, "download", {"folder": str(state.folder)})

    def _forget(self, state: _Download) -> None:
        discard_download(state.folder)
        self.downloads.pop(str(state.folder), None)
        self.view.remove_row(str(state.folder))

    def _by_job(self, job: int) -> _Download | None:
        return next((d for d in self.downloads.values() if d.job == job), None)

    def _by_import(self, job: int) -> _Download | None:
        return next((d for d in self.downloads.values() if d.import_job == job), None)

    def _fits(self, variants: list[Variant]) -> list[Fit | None]:
        return [self.fit(v) for v in variants]

    # -- slots: view -----------------------------------------------------------------------
    @Slot(str, str, str, object, object)
    def _on_search_requested(self, query: str, fmt: str, architecture: str, lo: int,
                             hi: int) -> None:
        self.search(query, fmt, architecture, lo, hi)

    @Slot(str)
    def _on_repo_selected(self, repo_id: str) -> None:
        if repo_id != self._variants_repo:
            self.show_variants(repo_id)

    @Slot(int)
    def _on_download_requested(self, row: int) -> None:
        variants = self.view.variants.variants()
        if 0 <= row < len(variants):
            self.download(variants[row])

    # -- slots: hub threads ----------------------------------------------------------------
    @Slot(int, str, object)
    def _on_job_finished(self, job: int, what: str, result: Any) -> None:
        if what == "search" and job == self._search_job:
            self.view.results.set_models(result)
            self._variants_repo = ""
            self.view.set_status(f"{len(result)} repositories found." if result else
                                 "Nothing found: try another name, format or size.")
            if result:
                self.view.select_result(0)
            self.results_shown.emit(len(result))
        elif what == "variants" and job == self._variants_job:
            self.view.variants.set_variants(result, self._fits(result))
            if result:
                self.view.select_variant(0)
            count = len(result)
            self.view.variants_label.setText(
                f"Variants of <b>{self._variants_repo}</b>: {count} to choose from"
                if count else f"<b>{self._variants_repo}</b> has no GGUF file or MLX folder.")
            self.variants_shown.emit(self._variants_repo)
        elif what == "download":
            state = self._by_job(job)
            if state is None:
                return
            state.job = 0
            state.row.show_importing()
            state.import_job = self.engine.import_path(Path(str(result)))

    @Slot(int, str, str)
    def _on_job_failed(self, job: int, what: str, message: str) -> None:
        self.last_error = message
        if what == "download":
            state = self._by_job(job)
            if state is None:
                return
            state.job = 0
            kept = "checksum mismatch" not in message
            state.row.show_failed(message, kept)
            self.download_done.emit(str(state.folder), False, message)
        elif job in (self._search_job, self._variants_job):
            self.view.set_status(message)
            if what == "variants":
                self.view.variants_label.setText(f"Variants of <b>{self._variants_repo}</b>: "
                                                 "could not be read.")

    @Slot(int, str)
    def _on_job_cancelled(self, job: int, what: str) -> None:
        state = self._by_job(job) if what == "download" else None
        if state is None:
            return
        state.job = 0
        if state.discard:
            self._forget(state)
            return
        state.row.show_paused(downloaded_bytes(state.folder, state.variant),
                              state.variant.bytes)
        self.download_paused.emit(str(state.folder))

    @Slot(int, object, object)
    def _on_download_progressed(self, job: int, done: int, total: int) -> None:
        state = self._by_job(job)
        if state is not None:
            state.row.show_progress(int(done), int(total))

    # -- slots: engine ---------------------------------------------------------------------
    @Slot(int, int, int)
    def _on_import_progress(self, job: int, done: int, total: int) -> None:
        state = self._by_import(job)
        if state is not None:
            state.row.show_import_progress(done, total)

    @Slot(int, dict)
    def _on_import_finished(self, job: int, manifest: dict[str, Any]) -> None:
        state = self._by_import(job)
        if state is None:
            return
        state.import_job = 0
        v = state.variant
        with contextlib.suppress(StrataError, OSError):  # the model is in; this is a label
            Library(self.home).update(str(manifest["name"]),
                                      source=f"hub:{v.repo_id}@{v.commit}/{v.label}")
        discard_download(state.folder)  # the library holds its own copy now
        state.row.show_imported(str(manifest["name"]))
        self.library_changed.emit()
        self.download_done.emit(str(state.folder), True, str(manifest["name"]))

    @Slot(int, str, str)
    def _on_error_occurred(self, job: int, what: str, message: str) -> None:
        state = self._by_import(job) if what == "import" else None
        if state is None:
            return
        state.import_job = 0
        self.last_error = message
        state.row.show_failed(f"Downloaded, but the import was refused: {message}", False)
        self.download_done.emit(str(state.folder), False, message)

    @Slot(object)
    def _on_profile_chosen(self, _profile: object) -> None:
        variants = self.view.variants.variants()
        if variants:
            self.view.variants.set_fits(self._fits(variants))  # they can be reckoned now

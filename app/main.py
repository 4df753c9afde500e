"""Strata's QApplication and main window: chat, library and memory views over one engine.

Contract: `run()` is what `strata` with no subcommand calls. It opens the window, fetches
the starter model on first start (on the engine thread, with progress in the status bar) and
loads the default model. With `screenshot=FILE` it renders the window offscreen to a PNG once
start-up (and with `demo`, a short scripted exchange at temperature 0) is done, and exits.
Files dropped on the window, chosen with File > Import or opened from the Dock
(QFileOpenEvent) are imported into the library. Server > Local server (checkable) serves the
OpenAI API over the app's own engine thread (app/server.py), showing its address and queue
depth in the status bar; it stops when unchecked and when the window closes. Its address
comes from the settings table (server_host, default 127.0.0.1; server_port, default 8765, 0
for any free port; server_api_key, required off loopback).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from PySide6.QtCore import (
    QByteArray,
    QEvent,
    QMessageLogContext,
    QObject,
    Qt,
    QTimer,
    QtMsgType,
    Signal,
    Slot,
    qInstallMessageHandler,
)
from PySide6.QtGui import (
    QAction,
    QCloseEvent,
    QColor,
    QDragEnterEvent,
    QDragMoveEvent,
    QDropEvent,
    QFileOpenEvent,
    QKeySequence,
    QPalette,
)
from PySide6.QtWidgets import (
    QApplication,
    QLabel,
    QMainWindow,
    QProgressBar,
    QTabWidget,
    QWidget,
)

import app.compat  # noqa: F401  (PySide6 work-around, see there)
from app.bench.view import BenchmarkView
from app.chat.controller import ChatController
from app.chat.store import ChatStore, Sampling
from app.cluster.view import ClusterDialog
from app.discover.controller import DiscoverController
from app.library.controller import LibraryController
from app.memory.view import MemoryPanel
from app.server import DEFAULT_PORT, LocalServer
from app.smoke import app_icon
from app.worker import Engine
from engine.errors import StrataError
from engine.platform import MemorySnapshot, default_home

DEFAULT_SIZE = (1100, 720)
VIEWS = ("chat", "library", "memory", "benchmark", "discover")
DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list of numbers.",
)
DEMO_MAX_TOKENS = 120
# With --demo and STRATA_DEMO_DOCUMENT=FILE the demo attaches FILE and asks this (or
# STRATA_DEMO_QUESTION) instead: the screenshot of a chat with a document.
DEMO_DOCUMENT_QUESTION = "What is the name of the lighthouse keeper's cat?"


class StrataApplication(QApplication):
    """QApplication that turns macOS file-open events (Dock drops) into a signal."""

    file_open_requested = Signal(str)

    def event(self, e: QEvent) -> bool:
        if e.type() == QEvent.Type.FileOpen and isinstance(e, QFileOpenEvent):
            path = e.file() or e.url().toLocalFile()
            if path:
                self.file_open_requested.emit(path)
            return True
        return super().event(e)


class MainWindow(QMainWindow):
    """The three views, the menus, the status bar and drag-and-drop import."""

    ready = Signal()  # start-up done: the default model is loaded (or there is none)

    def __init__(self, home: Path | None = None, db_path: Path | str | None = None,
                 fetch_starter: bool = True, preload: bool = True,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.home = Path(home) if home is not None else default_home()
        self.setWindowTitle("Strata")
        self.setAccessibleName("Strata")
        self.resize(*DEFAULT_SIZE)
        self.setAcceptDrops(True)
        self._fetch_starter = fetch_starter
        self._preload = preload
        self._closed = False
        self._is_ready = False

        self.engine = Engine(self.home, self)
        self.store = ChatStore(db_path if db_path is not None else self.home / "chats.sqlite3")
        self.chat = ChatController(self.store, self.engine, self)
        self.library = LibraryController(self.store, self.engine, self)
        self.memory = MemoryPanel()
        self.bench = BenchmarkView(self.home)
        self.server = LocalServer(self.engine, self)
        self.discover = DiscoverController(self.engine, self.home, self)

        self.tabs = QTabWidget()
        self.tabs.setAccessibleName("Views")
        self.tabs.setDocumentMode(True)
        self.tabs.addTab(self.chat.view, "Chat")
        self.tabs.addTab(self.library.view, "Library")
        self.tabs.addTab(self.memory, "Memory")
        self.tabs.addTab(self.bench, "Benchmark")
        self.tabs.addTab(self.discover.view, "Discover")
        self.setCentralWidget(self.tabs)

        saved = self.store.setting("window_geometry") or ""
        if re.fullmatch(r"(?:[0-9a-f]{2})+", saved):  # where the user left it; Qt checks it
            self.restoreGeometry(QByteArray(bytes.fromhex(saved)))

        self.status_label = QLabel("Starting…")
        self.status_label.setAccessibleName("Status")
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Start-up progress")
        self.progress.setMaximumWidth(220)
        self.progress.setVisible(False)
        self.server_label = QLabel()
        self.server_label.setAccessibleName("Server address")
        self.server_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.server_label.setVisible(False)
        self.statusBar().addWidget(self.status_label, 1)
        self.statusBar().addPermanentWidget(self.server_label)
        self.statusBar().addPermanentWidget(self.progress)
        self._build_menus()

        w = self.engine
        self.library.models_changed.connect(self._on_models_changed)
        self.discover.library_changed.connect(self.library.refresh)
        w.starter_progressed.connect(self._on_starter_progressed)
        w.starter_ready.connect(self._on_starter_ready)
        w.model_loading.connect(self._on_model_loading)
        w.model_loaded.connect(self._on_model_loaded)
        w.memory_sampled.connect(self._on_memory_sampled)
        w.prefix_warmed.connect(self._on_prefix_warmed)
        w.error_occurred.connect(self._on_error_occurred)
        self.chat.reply_recorded.connect(self._on_reply_recorded)
        self.server.started.connect(self._on_server_started)
        self.server.stopped.connect(self._on_server_stopped)
        self.server.queue_depth_changed.connect(self._on_server_queue_depth_changed)
        self.memory.set_replies(self.store.recent_stats())
        self._startup_job: int | None = None
        self._server_depth = 0
        self._start()

    # -- start-up ----------------------------------------------------------------------
    def _start(self) -> None:
        self.library.refresh()
        names = self.library.model.names()
        if not names and self._fetch_starter:
            self.progress.setRange(0, 0)
            self.progress.setVisible(True)
            self.status_label.setText("Fetching the starter model…")
            self._startup_job = self.engine.ensure_starter(load=self._preload)
        elif names and self._preload:
            self._startup_job = self.engine.load(self.library.default_model())
        else:
            self.status_label.setText("Ready." if names else
                                      "No models: drop a .gguf file or a model folder here.")
            QTimer.singleShot(0, self._set_ready)

    def _set_ready(self) -> None:
        if not self._is_ready:
            self._is_ready = True
            self.ready.emit()

    @property
    def is_ready(self) -> bool:
        return self._is_ready

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        new_chat = QAction("New chat", self)
        new_chat.setShortcut(QKeySequence.StandardKey.New)
        new_chat.triggered.connect(self._on_new_chat_triggered)
        file_menu.addAction(new_chat)
        import_action = QAction("Import model…", self)
        import_action.setShortcut(QKeySequence.StandardKey.Open)
        import_action.triggered.connect(self.library._on_import_requested)
        file_menu.addAction(import_action)
        file_menu.addSeparator()
        quit_action = QAction("Quit", self)
        quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        quit_action.setMenuRole(QAction.MenuRole.QuitRole)
        quit_action.triggered.connect(self.close)
        file_menu.addAction(quit_action)
        view_menu = self.menuBar().addMenu("&View")
        for i, name in enumerate(("Chat", "Library", "Memory", "Benchmark", "Discover")):
            action = QAction(name, self)
            action.setShortcut(QKeySequence(f"Ctrl+{i + 1}"))
            action.triggered.connect(lambda _=False, i=i: self.tabs.setCurrentIndex(i))
            view_menu.addAction(action)
        server_menu = self.menuBar().addMenu("&Server")
        server_action = QAction("Local server", self)
        server_action.setCheckable(True)
        server_action.setToolTip("Serve the OpenAI API on this computer over Strata's engine")
        server_action.toggled.connect(self._on_server_toggled)
        server_menu.addAction(server_action)
        engine_menu = self.menuBar().addMenu("&Engine")
        macs_action = QAction("Run across several Macs…", self)
        macs_action.setToolTip("Macs running strata join on the local network, found or typed")
        macs_action.triggered.connect(self._on_macs_triggered)
        engine_menu.addAction(macs_action)
        self.macs_action = macs_action
        self.macs_dialog: ClusterDialog | None = None
        self.new_chat_action, self.import_action = new_chat, import_action
        self.server_action = server_action

    # -- public ------------------------------------------------------------------------
    def show_view(self, name: str) -> None:
        self.tabs.setCurrentIndex(VIEWS.index(name))

    def import_paths(self, paths: list[Path]) -> list[int]:
        self.show_view("library")
        return self.library.import_paths(paths, self)

    @Slot(str)
    def import_path(self, path: str) -> None:
        self.import_paths([Path(path)])

    # -- drag and drop -----------------------------------------------------------------
    @staticmethod
    def _dropped_paths(event: QDropEvent | QDragEnterEvent | QDragMoveEvent) -> list[Path]:
        mime = event.mimeData()
        if not mime.hasUrls():
            return []
        urls = mime.urls()
        if not urls or not all(u.isLocalFile() for u in urls):
            return []
        return [Path(u.toLocalFile()) for u in urls]

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if self._dropped_paths(event):
            event.acceptProposedAction()
        else:
            event.ignore()

    def dragMoveEvent(self, event: QDragMoveEvent) -> None:
        if self._dropped_paths(event):
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        paths = self._dropped_paths(event)
        if not paths:
            event.ignore()
            return
        event.acceptProposedAction()
        self.import_paths(paths)

    # -- slots -------------------------------------------------------------------------
    @Slot()
    def _on_new_chat_triggered(self) -> None:
        self.show_view("chat")
        self.chat.new_chat()

    @Slot(list, str)
    def _on_models_changed(self, names: list[str], default: str) -> None:
        self.chat.set_models(names, default)
        self.bench.set_models(names, default)

    @Slot()
    def _on_macs_triggered(self) -> None:
        model = self.chat.loaded_model or self.chat.default_model
        if self.macs_dialog is None or self.macs_dialog.view.model != model:
            self.macs_dialog = ClusterDialog(model, self.engine.worker.library, self)
            self.macs_dialog.view.run_across_requested.connect(self._on_run_across_requested)
        self.macs_dialog.show()

    @Slot(str, list)
    def _on_run_across_requested(self, model: str, waiters: list[str]) -> None:
        self.status_label.setText(f"Loading {model} across {len(waiters) + 1} Macs…")
        # Macs off loopback must prove the server's key before they are handed the model.
        self.engine.load_across(model, waiters, key=self.store.setting("server_api_key") or None)

    @Slot(bool)
    def _on_server_toggled(self, on: bool) -> None:
        if not on:
            self.server.stop()
            return
        if self.server.running:
            return
        try:
            port = int(self.store.setting("server_port", str(DEFAULT_PORT)) or DEFAULT_PORT)
            self.server.start(host=self.store.setting("server_host", "127.0.0.1") or "127.0.0.1",
                              port=port, api_key=self.store.setting("server_api_key") or None,
                              default_model=self.chat.loaded_model or self.chat.default_model)
        except (StrataError, ValueError) as exc:
            self.status_label.setText(f"The local server did not start: {exc}")
            self.server_action.blockSignals(True)
            self.server_action.setChecked(False)
            self.server_action.blockSignals(False)

    @Slot(str)
    def _on_server_started(self, address: str) -> None:
        self._server_depth = 0
        self._show_server()
        self.status_label.setText(f"Serving the OpenAI API at {address}")

    @Slot()
    def _on_server_stopped(self) -> None:
        self.server_label.setVisible(False)
        self.server_label.setText("")
        if self.server_action.isChecked():
            self.server_action.blockSignals(True)
            self.server_action.setChecked(False)
            self.server_action.blockSignals(False)
        self.status_label.setText("Local server stopped.")

    @Slot(int)
    def _on_server_queue_depth_changed(self, depth: int) -> None:
        self._server_depth = depth
        self._show_server()

    def _show_server(self) -> None:
        if not self.server.running:
            return
        self.server_label.setText(f"Server: {self.server.address} · "
                                  f"queue {self._server_depth}")
        self.server_label.setToolTip("OpenAI-compatible API (base URL); queue: requests "
                                     "running or waiting")
        self.server_label.setVisible(True)

    @Slot(str, int, int)
    def _on_starter_progressed(self, message: str, done: int, total: int) -> None:
        self.status_label.setText(message + ("…" if not total else f": {done}%"))
        self.progress.setVisible(True)
        self.progress.setRange(0, total)
        self.progress.setValue(done)

    @Slot(dict)
    def _on_starter_ready(self, manifest: dict[str, Any]) -> None:
        self.progress.setVisible(False)
        self.status_label.setText(f"Starter model ready: {manifest['name']}.")
        if not self._preload:
            self._set_ready()

    @Slot(str)
    def _on_model_loading(self, name: str) -> None:
        self.status_label.setText(f"Loading {name}…")

    @Slot(dict)
    def _on_model_loaded(self, info: dict[str, Any]) -> None:
        secs = sum(info.get("phases", {}).values())
        self.status_label.setText(f"{info['name']} loaded in {secs:.1f} s "
                                  f"({info.get('profile', '')}).")
        self.memory.set_model_name(str(info["name"]))
        self.server.set_default_model(str(info["name"]))
        self._set_ready()

    @Slot(int, int, dict)
    def _on_prefix_warmed(self, _job: int, _chat_id: int, info: dict[str, Any]) -> None:
        tokens, cached = int(info.get("tokens", 0)), int(info.get("cached", 0))
        how = ("all from the prefix cache" if cached >= tokens - 1 else
               f"{cached} from the cache, {tokens - cached} prefilled" if cached else
               f"prefilled in {float(info.get('seconds', 0.0)):.1f} s")
        self.status_label.setText(f"System prompt ready: {tokens} tokens ({how}).")

    @Slot(object)
    def _on_memory_sampled(self, snapshot: MemorySnapshot) -> None:
        self.memory.show_snapshot(snapshot)

    @Slot(int, dict)
    def _on_reply_recorded(self, _message_id: int, _stats: dict[str, Any]) -> None:
        self.memory.set_replies(self.store.recent_stats())

    @Slot(int, str, str)
    def _on_error_occurred(self, job: int, what: str, message: str) -> None:
        if what == "settings":
            self.status_label.setText(message)
        if what == "prefix clear":
            self.chat.view.set_status(f"The prefix cache could not be cleared: {message}")
        if what in ("starter", "load"):
            self.progress.setVisible(False)
            self.status_label.setText(message)
            self.chat.view.set_status(message)
        if job == self._startup_job:
            self._set_ready()

    # -- closing -----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine thread and close the database (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.server.stop()
        self.chat.shutdown()
        self.bench.shutdown()
        self.discover.shutdown()
        self.engine.shutdown()
        self.store.close()

    def closeEvent(self, event: QCloseEvent) -> None:
        if not self._closed:  # the database closes in shutdown()
            self.store.set_setting("window_geometry", bytes(self.saveGeometry().data()).hex())
        self.shutdown()
        super().closeEvent(event)


# -- themes -------------------------------------------------------------------------------
def apply_theme(app: QApplication, theme: str) -> None:
    """'light' or 'dark' set the Fusion style with a fixed palette; 'system' leaves Qt's."""
    if theme == "system":
        return
    app.setStyle("Fusion")
    if theme == "light":
        app.setPalette(app.style().standardPalette())
        return
    pal = QPalette()
    roles = {
        QPalette.ColorRole.Window: "#2b2b2e", QPalette.ColorRole.WindowText: "#e8e8ea",
        QPalette.ColorRole.Base: "#1f1f22", QPalette.ColorRole.AlternateBase: "#27272b",
        QPalette.ColorRole.Text: "#e8e8ea", QPalette.ColorRole.Button: "#36363a",
        QPalette.ColorRole.ButtonText: "#e8e8ea", QPalette.ColorRole.Highlight: "#3d6fb6",
        QPalette.ColorRole.HighlightedText: "#ffffff", QPalette.ColorRole.ToolTipBase: "#36363a",
        QPalette.ColorRole.ToolTipText: "#e8e8ea", QPalette.ColorRole.PlaceholderText: "#9a9aa0",
        QPalette.ColorRole.Link: "#7fb0ff", QPalette.ColorRole.Mid: "#4a4a50",
        QPalette.ColorRole.Light: "#45454a", QPalette.ColorRole.Dark: "#1a1a1c",
    }
    for role, colour in roles.items():
        pal.setColor(role, QColor(colour))
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text,
                 QPalette.ColorRole.ButtonText):
        pal.setColor(QPalette.ColorGroup.Disabled, role, QColor("#808086"))
    app.setPalette(pal)


# -- screenshots --------------------------------------------------------------------------
class ScreenshotDirector(QObject):
    """Waits for start-up (and the demo exchange), saves the window as a PNG, quits."""

    done = Signal(int)  # exit code

    def __init__(self, window: MainWindow, path: Path, view: str, demo: bool,
                 timeout_s: float = 600.0) -> None:
        super().__init__(window)
        self.window, self.path, self.view, self.demo = window, path, view, demo
        self._prompts = list(DEMO_PROMPTS) if demo else []
        self._document = os.environ.get("STRATA_DEMO_DOCUMENT", "") if demo else ""
        if self._document:
            self._prompts = [os.environ.get("STRATA_DEMO_QUESTION", DEMO_DOCUMENT_QUESTION)]
        self.error = ""
        window.ready.connect(self._on_ready)
        window.chat.streaming_changed.connect(self._on_streaming_changed)
        QTimer.singleShot(int(timeout_s * 1000), self._on_timeout)

    @Slot()
    def _on_ready(self) -> None:
        if self.view == "discover":  # a search on the Hub (HF_ENDPOINT) and its first variants
            discover = self.window.discover
            discover.variants_shown.connect(lambda _repo: QTimer.singleShot(300, self._capture))
            discover.results_shown.connect(
                lambda n: None if n else QTimer.singleShot(300, self._capture))
            discover.search(os.environ.get("STRATA_DISCOVER_QUERY", ""))
            return
        if self._prompts and self.window.chat.models:
            chat = self.window.chat.new_chat()
            self.window.store.update_chat(chat.id, title="Demo",
                                          sampling=Sampling(temperature=0.0, top_p=1.0,
                                                            max_tokens=DEMO_MAX_TOKENS))
            self.window.chat.chats.refresh()
            self.window.chat.select(chat.id)
            if self._document:  # sent once the document is read and measured
                self.window.store.update_chat(chat.id, title=Path(self._document).name)
                self.window.chat.chats.refresh()
                self.window.engine.document_read.connect(
                    lambda *_: QTimer.singleShot(0, self._send_next))
                self.window.chat.attach([self._document])
                return
            self._send_next()
        else:
            QTimer.singleShot(1200, self._capture)  # a memory reading arrives meanwhile

    def _send_next(self) -> None:
        prompt = self._prompts.pop(0)
        if self.window.chat.send(prompt) is None:
            self.error = "the demo message could not be sent"
            self._capture()

    @Slot(bool)
    def _on_streaming_changed(self, streaming: bool) -> None:
        if streaming or not self.demo:
            return
        if self._prompts:
            QTimer.singleShot(0, self._send_next)
        else:
            QTimer.singleShot(1200, self._capture)

    @Slot()
    def _on_timeout(self) -> None:
        self.error = "timed out waiting for start-up"
        self._capture()

    @Slot()
    def _capture(self) -> None:
        self.window.show_view(self.view)
        self.window.repaint()
        QApplication.processEvents()
        image = self.window.grab()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        ok = image.save(str(self.path), "PNG")
        if not ok:
            self.error = self.error or f"could not write {self.path}"
        if self.error:
            print(f"strata: error: {self.error}", file=sys.stderr)
        self.done.emit(0 if ok and not self.error else 1)


def _quiet_offscreen(mode: QtMsgType, _context: QMessageLogContext, message: str) -> None:
    """Qt's messages on stderr, less the offscreen plugin's note about size hints."""
    if "propagateSizeHints" not in message:
        print(message, file=sys.stderr)


def run(screenshot: str | Path | None = None, view: str = "chat", demo: bool = False,
        theme: str = "system", home: Path | None = None) -> int:
    """Open the window (or render a screenshot) and run the event loop; the exit code."""
    if screenshot is not None:
        if not os.environ.get("QT_QPA_PLATFORM"):
            os.environ["QT_QPA_PLATFORM"] = "offscreen"
        qInstallMessageHandler(_quiet_offscreen)
    existing = QApplication.instance()
    app = existing if isinstance(existing, QApplication) else StrataApplication(sys.argv[:1])
    app.setApplicationName("Strata")
    app.setOrganizationName("Strata")
    app.setWindowIcon(app_icon())  # Linux shows it; macOS takes the bundle's .icns
    apply_theme(app, theme)
    # --demo talks in a throwaway database, so screenshots never touch a person's chats.
    window = MainWindow(home, db_path=":memory:" if demo else None)
    if isinstance(app, StrataApplication):
        app.file_open_requested.connect(window.import_path)
    code = [0]
    if screenshot is not None:
        director = ScreenshotDirector(window, Path(screenshot), view, demo)

        def finish(rc: int) -> None:
            code[0] = rc
            window.close()
            app.quit()

        director.done.connect(finish)
        window.show_view(view)
        window.show()
    else:
        window.show()
    rc = app.exec()
    window.shutdown()
    return code[0] or rc

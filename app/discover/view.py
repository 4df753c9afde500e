"""Discover's widgets: the search row, results, variants and the downloads list.

Contract: widgets only. `DiscoverView` emits `search_requested(query, fmt, architecture,
min_params, max_params)`, `repo_selected(repo_id)` and `download_requested(row)` (a row of
the variants table); each `DownloadRow` emits `pause_requested`, `resume_requested` and
`cancel_requested` with its key (the download's folder). Keyboard: Ctrl+F goes to the search
field, Return searches, Ctrl+D downloads the selected variant; each row's buttons have
mnemonics (Alt+P pause, Alt+R resume, Alt+N cancel) and every control an accessible name.
Colours come from the palette only, so the dark theme applies unchanged.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QItemSelection, Qt, Signal, Slot
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSplitter,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.discover.model import ResultsModel, VariantsModel
from app.format import human_bytes

FORMATS = (("GGUF and MLX", "all"), ("GGUF", "gguf"), ("MLX", "mlx"))
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "mistral", "phi3",
                 "olmo2", "gpt_oss")
SIZES = (("Any size", 0, 0), ("Up to 1B", 0, 1_000_000_000),
         ("1B to 4B", 1_000_000_000, 4_000_000_000),
         ("4B to 10B", 4_000_000_000, 10_000_000_000),
         ("10B to 35B", 10_000_000_000, 35_000_000_000), ("Over 35B", 35_000_000_000, 0))


def _table(model: Any, name: str) -> QTableView:
    table = QTableView()
    table.setAccessibleName(name)
    table.setModel(model)
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
    table.setAlternatingRowColors(True)
    table.verticalHeader().setVisible(False)
    table.setWordWrap(False)
    header = table.horizontalHeader()
    header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
    header.setStretchLastSection(True)
    return table


class DownloadRow(QWidget):
    """One download: what it is, its progress bar, Pause/Resume and Cancel."""

    pause_requested = Signal(str)
    resume_requested = Signal(str)
    cancel_requested = Signal(str)

    def __init__(self, key: str, title: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.key = key
        self.title = QLabel(title)
        self.title.setAccessibleName("Download")
        self.title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.bar = QProgressBar()
        self.bar.setAccessibleName(f"Download progress of {title}")
        self.bar.setRange(0, 1000)
        self.status = QLabel("")
        self.status.setAccessibleName(f"Download status of {title}")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.pause_button = QPushButton("&Pause")
        self.pause_button.setAccessibleName(f"Pause download of {title}")
        self.resume_button = QPushButton("&Resume")
        self.resume_button.setAccessibleName(f"Resume download of {title}")
        self.cancel_button = QPushButton("Ca&ncel")
        self.cancel_button.setAccessibleName(f"Cancel download of {title}")
        self.title.setText(f"<b>{_escape(title)}</b>")
        words = QVBoxLayout()
        words.setSpacing(0)
        words.addWidget(self.title)
        words.addWidget(self.status)
        top = QHBoxLayout()
        top.addLayout(words, 1)
        top.addWidget(self.pause_button)
        top.addWidget(self.resume_button)
        top.addWidget(self.cancel_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 2, 0, 2)
        layout.setSpacing(2)
        layout.addLayout(top)
        layout.addWidget(self.bar)
        self.pause_button.clicked.connect(lambda: self.pause_requested.emit(self.key))
        self.resume_button.clicked.connect(lambda: self.resume_requested.emit(self.key))
        self.cancel_button.clicked.connect(lambda: self.cancel_requested.emit(self.key))
        self.state = ""
        self.show_paused(0, 1)

    def _buttons(self, pause: bool, resume: bool, cancel: bool, cancel_text: str = "Ca&ncel"
                 ) -> None:
        self.pause_button.setVisible(pause)
        self.resume_button.setVisible(resume)
        self.cancel_button.setVisible(cancel)
        self.cancel_button.setText(cancel_text)

    def show_progress(self, done: int, total: int) -> None:
        self.state = "running"
        self.bar.setRange(0, 1000)
        self.bar.setValue(int(1000 * done / max(total, 1)))
        self.status.setText(f"Downloading: {human_bytes(done)} of {human_bytes(total)}")
        self._buttons(True, False, True)

    def show_paused(self, done: int, total: int) -> None:
        self.state = "paused"
        self.bar.setValue(int(1000 * done / max(total, 1)))
        self.status.setText(f"Paused at {human_bytes(done)} of {human_bytes(total)}; the part "
                            "is kept, Resume goes on from there.")
        self._buttons(False, True, True)

    def show_importing(self) -> None:
        self.state = "importing"
        self.bar.setRange(0, 0)  # busy: the import reports its own progress
        self.status.setText("Downloaded and checked against the Hub's checksums. Importing…")
        self._buttons(False, False, False)

    def show_import_progress(self, done: int, total: int) -> None:
        self.bar.setRange(0, max(total, 1))
        self.bar.setValue(done)

    def show_imported(self, name: str) -> None:
        self.state = "imported"
        self.bar.setRange(0, 1)
        self.bar.setValue(1)
        self.status.setText(f"Imported into the library as <b>{_escape(name)}</b>.")
        self._buttons(False, False, True, "&Dismiss")

    def show_failed(self, message: str, kept: bool) -> None:
        self.state = "failed"
        self.bar.setRange(0, 1000)
        self.status.setText(_escape(message) + ("<br>The part is kept: Resume tries again."
                                                if kept else ""))
        self._buttons(False, kept, True, "Ca&ncel" if kept else "&Dismiss")


class DiscoverView(QWidget):
    # query, format, architecture, min and max parameters (object: past 2**31)
    search_requested = Signal(str, str, str, object, object)
    repo_selected = Signal(str)
    download_requested = Signal(int)  # row of the variants table

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.results = ResultsModel(self)
        self.variants = VariantsModel(self)
        self.search_box = QLineEdit()
        self.search_box.setAccessibleName("Search the Hugging Face Hub")
        self.search_box.setPlaceholderText("Search models on the Hugging Face Hub (Ctrl+F): "
                                           "qwen, llama, smollm…")
        self.search_box.setClearButtonEnabled(True)
        self.format_box = QComboBox()
        self.format_box.setAccessibleName("Format")
        for text, value in FORMATS:
            self.format_box.addItem(text, value)
        self.arch_box = QComboBox()
        self.arch_box.setAccessibleName("Architecture")
        self.arch_box.addItem("Any architecture", "")
        for arch in ARCHITECTURES:
            self.arch_box.addItem(arch, arch)
        self.size_box = QComboBox()
        self.size_box.setAccessibleName("Model size")
        for text, lo, hi in SIZES:
            self.size_box.addItem(text, (lo, hi))
        self.search_button = QPushButton("&Search")
        self.search_button.setAccessibleName("Search")
        self.search_button.setDefault(True)
        row = QHBoxLayout()
        row.addWidget(self.search_box, 1)
        row.addWidget(self.format_box)
        row.addWidget(self.arch_box)
        row.addWidget(self.size_box)
        row.addWidget(self.search_button)

        self.results_table = _table(self.results, "Search results")
        self.variants_table = _table(self.variants, "Variants")
        self.variants_label = QLabel("Variants: choose a repository above.")
        self.variants_label.setAccessibleName("Variants heading")
        self.download_button = QPushButton("&Download")
        self.download_button.setAccessibleName("Download variant")
        self.download_button.setToolTip("Download the selected variant and import it (Ctrl+D)")
        self.download_button.setEnabled(False)
        self.status = QLabel("Search the Hugging Face Hub for GGUF and MLX models.")
        self.status.setAccessibleName("Discover status")
        self.status.setWordWrap(True)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        variants_box = QWidget()
        vlayout = QVBoxLayout(variants_box)
        vlayout.setContentsMargins(0, 0, 0, 0)
        vhead = QHBoxLayout()
        vhead.addWidget(self.variants_label, 1)
        vhead.addWidget(self.download_button)
        vlayout.addLayout(vhead)
        vlayout.addWidget(self.variants_table, 1)

        self.downloads_box = QGroupBox("Downloads")
        self.downloads_box.setAccessibleName("Downloads")
        self.downloads_layout = QVBoxLayout()
        self.downloads_layout.addStretch(1)
        inner = QWidget()
        inner.setLayout(self.downloads_layout)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(inner)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        box_layout = QVBoxLayout(self.downloads_box)
        box_layout.setContentsMargins(6, 2, 6, 2)
        box_layout.addWidget(scroll)
        self.downloads_box.setMinimumHeight(110)  # one row whole
        self.downloads_box.setVisible(False)

        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(self.results_table)
        splitter.addWidget(variants_box)
        splitter.addWidget(self.downloads_box)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 2)
        splitter.setStretchFactor(2, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 12, 12, 12)
        layout.addLayout(row)
        layout.addWidget(splitter, 1)
        layout.addWidget(self.status)
        self.rows: dict[str, DownloadRow] = {}

        self.search_box.returnPressed.connect(self._on_search_clicked)
        self.search_button.clicked.connect(self._on_search_clicked)
        self.download_button.clicked.connect(self._on_download_clicked)
        self.results_table.selectionModel().selectionChanged.connect(self._on_result_selected)
        self.variants_table.selectionModel().selectionChanged.connect(self._on_variant_selected)
        self.variants.modelReset.connect(self._on_variant_selected)
        self.variants_table.doubleClicked.connect(self._on_download_clicked)
        find = QShortcut(QKeySequence.StandardKey.Find, self)
        find.activated.connect(self._on_find_activated)
        download = QShortcut(QKeySequence("Ctrl+D"), self)
        download.activated.connect(self._on_download_clicked)

    # -- public ----------------------------------------------------------------------------
    def selected_repo(self) -> str | None:
        rows = self.results_table.selectionModel().selectedRows()
        return self.results.repo_ids()[rows[0].row()] if rows else None

    def selected_variant(self) -> int:
        rows = self.variants_table.selectionModel().selectedRows()
        return rows[0].row() if rows else -1

    def select_result(self, row: int) -> None:
        self.results_table.selectRow(row)

    def select_variant(self, row: int) -> None:
        self.variants_table.selectRow(row)

    def set_status(self, text: str) -> None:
        self.status.setText(text)

    def add_row(self, key: str, title: str) -> DownloadRow:
        row = self.rows.get(key)
        if row is None:
            row = DownloadRow(key, title)
            self.rows[key] = row
            self.downloads_layout.insertWidget(self.downloads_layout.count() - 1, row)
        self.downloads_box.setVisible(True)
        return row

    def remove_row(self, key: str) -> None:
        row = self.rows.pop(key, None)
        if row is not None:
            row.setParent(None)
            row.deleteLater()
        self.downloads_box.setVisible(bool(self.rows))

    # -- slots -----------------------------------------------------------------------------
    @Slot()
    def _on_find_activated(self) -> None:
        self.search_box.setFocus(Qt.FocusReason.ShortcutFocusReason)
        self.search_box.selectAll()

    @Slot()
    def _on_search_clicked(self) -> None:
        lo, hi = self.size_box.currentData()
        self.search_requested.emit(self.search_box.text().strip(),
                                   str(self.format_box.currentData()),
                                   str(self.arch_box.currentData()), int(lo), int(hi))

    @Slot(QItemSelection, QItemSelection)
    def _on_result_selected(self, *_: Any) -> None:
        repo = self.selected_repo()
        if repo:
            self.repo_selected.emit(repo)

    @Slot()
    def _on_variant_selected(self, *_: Any) -> None:
        self.download_button.setEnabled(self.selected_variant() >= 0)

    @Slot()
    def _on_download_clicked(self, *_: Any) -> None:
        row = self.selected_variant()
        if row >= 0:
            self.download_requested.emit(row)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

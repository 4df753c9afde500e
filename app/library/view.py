"""The library screen's widgets and the import dialog.

Contract: widgets only. `LibraryView` emits `import_requested` (no path: ask for one),
`delete_requested(name)` and `default_requested(name)`; its details pane says whether the
selected model fits in memory. `ImportDialog` shows one import: first the choice of how to
quantize (as stored, or a recipe, each with the size it would have on disk, from
`show_options`) and the context, with whether the model would then fit in this machine's memory
(each option's engine.runtime.fit.Fit); one that would not is refused there, with the numbers
and the largest context that would fit offered instead. Then the job (progress, result or
refusal). It emits `import_confirmed(recipe, context)` ("" for as stored) and
`cancel_requested`.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QItemSelection, Qt, Signal, Slot
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QStackedWidget,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from app.format import human_bytes, quantization_details, quantization_summary
from app.library.found import FoundModel
from app.library.model import LibraryModel, NameRole
from engine.library.found import placement_text
from engine.runtime.fit import Fit

KIND_LABELS = {"gguf": "GGUF file", "mlx": "MLX folder", "hf": "Hugging Face folder"}
EMPTY_TEXT = ("No models yet.\n\nDrop a .gguf file or a model folder (MLX or Hugging Face) "
              "anywhere on this window,\nor use Import model… (Ctrl+O).")


class LibraryView(QWidget):
    import_requested = Signal()
    delete_requested = Signal(str)
    default_requested = Signal(str)
    add_found_requested = Signal(int)  # a row of the Found on this Mac table
    rescan_requested = Signal()

    def __init__(self, model: LibraryModel, found: FoundModel | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.found_model = found or FoundModel(self)
        self.table = QTableView()
        self.table.setAccessibleName("Model library")
        self.table.setModel(model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setAlternatingRowColors(True)
        self.table.verticalHeader().setVisible(False)
        self.table.setWordWrap(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        self.empty_label = QLabel(EMPTY_TEXT)
        self.empty_label.setAccessibleName("Library empty state")
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty_label.setWordWrap(True)
        self.stack = QStackedWidget()
        self.stack.addWidget(self.empty_label)
        self.stack.addWidget(self.table)

        self.import_button = QPushButton("Import model…")
        self.import_button.setAccessibleName("Import model")
        self.default_button = QPushButton("Set as default")
        self.default_button.setAccessibleName("Set as default")
        self.delete_button = QPushButton("Delete")
        self.delete_button.setAccessibleName("Delete model")
        self.details = QLabel()
        self.details.setAccessibleName("Model details")
        self.details.setWordWrap(True)
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        hint = QLabel("Drop a .gguf file or a model folder anywhere on the window to import it.")
        hint.setWordWrap(True)
        hint.setEnabled(False)  # drawn in the palette's disabled (muted) colour

        # Found on this Mac: what LM Studio, Ollama and the Hugging Face cache already hold.
        self.found_label = QLabel("<b>Found on this Mac</b>")
        self.found_label.setAccessibleName("Found on this Mac heading")
        self.found_table = QTableView()
        self.found_table.setAccessibleName("Found on this Mac")
        self.found_table.setModel(self.found_model)
        self.found_table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.found_table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.found_table.setAlternatingRowColors(True)
        self.found_table.verticalHeader().setVisible(False)
        self.found_table.setWordWrap(False)
        fh = self.found_table.horizontalHeader()
        fh.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        fh.setStretchLastSection(True)
        self.add_found_button = QPushButton("&Add to library")
        self.add_found_button.setAccessibleName("Add found model to library")
        self.add_found_button.setToolTip("Add the selected model to the library (Ctrl+Shift+A)")
        self.add_found_button.setShortcut(QKeySequence("Ctrl+Shift+A"))
        self.rescan_button = QPushButton("&Rescan")
        self.rescan_button.setAccessibleName("Rescan for models on this Mac")
        self.rescan_button.setToolTip("Look again in LM Studio's, Ollama's and the Hugging "
                                      "Face cache's folders (F5)")
        self.rescan_button.setShortcut(QKeySequence(QKeySequence.StandardKey.Refresh))
        self.found_status = QLabel("")
        self.found_status.setAccessibleName("Found on this Mac status")
        self.found_status.setWordWrap(True)
        self.found_status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        found_head = QHBoxLayout()
        found_head.addWidget(self.found_label, 1)
        found_head.addWidget(self.add_found_button)
        found_head.addWidget(self.rescan_button)
        self.found_box = QWidget()
        found_layout = QVBoxLayout(self.found_box)
        found_layout.setContentsMargins(0, 0, 0, 0)
        found_layout.addLayout(found_head)
        found_layout.addWidget(self.found_table, 1)
        found_layout.addWidget(self.found_status)

        buttons = QHBoxLayout()
        buttons.addWidget(self.import_button)
        buttons.addStretch(1)
        buttons.addWidget(self.default_button)
        buttons.addWidget(self.delete_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 12, 12, 12)
        layout.addLayout(buttons)
        layout.addWidget(self.stack, 3)
        layout.addWidget(self.details)
        layout.addWidget(self.found_box, 2)
        layout.addWidget(hint)

        self.import_button.clicked.connect(self.import_requested)
        self.default_button.clicked.connect(self._on_default_clicked)
        self.delete_button.clicked.connect(self._on_delete_clicked)
        self.table.selectionModel().selectionChanged.connect(self._on_selection_changed)
        model.modelReset.connect(self._on_model_reset)
        model.dataChanged.connect(self._on_data_changed)
        self.add_found_button.clicked.connect(self._on_add_found_clicked)
        self.rescan_button.clicked.connect(self.rescan_requested)
        self.found_table.doubleClicked.connect(self._on_add_found_clicked)
        self.found_table.selectionModel().selectionChanged.connect(self._on_found_selected)
        self.found_model.modelReset.connect(self._on_found_reset)
        self._on_model_reset()
        self._on_found_reset()

    def selected_name(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        return str(rows[0].data(NameRole)) if rows else None

    def select_name(self, name: str) -> None:
        for row, n in enumerate(self.model.names()):
            if n == name:
                self.table.selectRow(row)

    def selected_found(self) -> int:
        rows = self.found_table.selectionModel().selectedRows()
        return rows[0].row() if rows else -1

    def select_found(self, label: str) -> None:
        for row, text in enumerate(self.found_model.labels()):
            if text == label:
                self.found_table.selectRow(row)

    @Slot()
    def _on_found_reset(self) -> None:
        count = self.found_model.rowCount()
        self.found_table.setVisible(count > 0)
        if not count:
            self.found_status.setText("Nothing found in LM Studio's or Ollama's models or the "
                                      "Hugging Face cache.")
        elif not self.found_status.text() or self.found_status.text().startswith("Nothing"):
            self.found_status.setText(f"{count} models other apps keep on this Mac: add one "
                                      "without downloading it again.")
        self._on_found_selected()

    @Slot()
    def _on_found_selected(self, *_: Any) -> None:
        row = self.selected_found()
        self.add_found_button.setEnabled(row >= 0 and not self.found_model.added_as(row))

    @Slot()
    def _on_add_found_clicked(self, *_: Any) -> None:
        row = self.selected_found()
        if row >= 0 and not self.found_model.added_as(row):
            self.add_found_requested.emit(row)

    @Slot()
    def _on_model_reset(self) -> None:
        empty = self.model.rowCount() == 0
        self.stack.setCurrentWidget(self.empty_label if empty else self.table)
        if not empty and not self.table.selectionModel().hasSelection():
            self.table.selectRow(0)
        self._on_selection_changed()

    @Slot()
    def _on_data_changed(self) -> None:
        self._on_selection_changed()  # the fits changed: the details pane says them

    @Slot(QItemSelection, QItemSelection)
    def _on_selection_changed(self, *_: Any) -> None:
        name = self.selected_name()
        self.default_button.setEnabled(name is not None and name != self.model.default)
        self.delete_button.setEnabled(name is not None)
        row = self.model.names().index(name) if name in self.model.names() else -1
        m = self.model.manifest(row)
        if m is None:
            self.details.setText("")
            return
        params = m.get("params")
        lines = [
            f"<b>{m['name']}</b> &nbsp; {m.get('architecture') or ''}"
            f"{f', {params / 1e6:.0f}M parameters' if params else ''}",
            f"aliases: {', '.join(m.get('aliases', [])) or 'none'} &nbsp;·&nbsp; "
            f"{human_bytes(m.get('bytes'))} on disk",
            "quantization: " + quantization_details(m).replace("\n", "; "),
            f"source: {m.get('source', '')}",
            f"folder: {m.get('path', '')}",
        ]
        placed = placement_text(m)
        if placed:
            lines.insert(4, f"on disk: {_escape(placed)}")
        fit = self.model.fit(str(m["name"]))
        if fit is not None:
            lines.insert(3, "memory: " + fit_html(fit))
        self.details.setText("<br>".join(lines))

    @Slot()
    def _on_default_clicked(self) -> None:
        name = self.selected_name()
        if name:
            self.default_requested.emit(name)

    @Slot()
    def _on_delete_clicked(self) -> None:
        name = self.selected_name()
        if name:
            self.delete_requested.emit(name)


class ImportDialog(QDialog):
    """One import: how to quantize (with sizes), progress, then the result or the refusal."""

    import_confirmed = Signal(str, int)  # recipe name ("" for as stored), context in tokens
    cancel_requested = Signal()

    def __init__(self, path: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Import model")
        self.setAccessibleName("Import dialog")
        self.setMinimumWidth(560)
        self.path_label = QLabel(path)
        self.path_label.setWordWrap(True)
        self.path_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.kind_label = QLabel("checking…")
        self.recipe_box = QComboBox()
        self.recipe_box.setAccessibleName("Quantization recipe")
        self.recipe_box.setEnabled(False)
        self.recipe_label = QLabel("")
        self.recipe_label.setAccessibleName("Recipe details")
        self.recipe_label.setWordWrap(True)
        self.context_box = QSpinBox()
        self.context_box.setAccessibleName("Context tokens")
        self.context_box.setRange(1, 1)
        self.context_box.setSingleStep(1024)
        self.context_box.setGroupSeparatorShown(True)
        self.context_box.setSuffix(" tokens")
        self.context_box.setEnabled(False)
        self.offer_button = QPushButton("")
        self.offer_button.setAccessibleName("Use the largest context that fits")
        self.offer_button.setVisible(False)
        context_row = QHBoxLayout()
        context_row.addWidget(self.context_box)
        context_row.addWidget(self.offer_button)
        context_row.addStretch(1)
        self.fit_label = QLabel("")
        self.fit_label.setAccessibleName("Memory fit")
        self.fit_label.setWordWrap(True)
        self.fit_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Import progress")
        self.progress.setRange(0, 0)  # busy until the first progress report
        self.progress.setVisible(False)
        self.message = QLabel("")
        self.message.setAccessibleName("Import message")
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.import_button = self.buttons.addButton(
            "Import", QDialogButtonBox.ButtonRole.AcceptRole)
        self.import_button.setAccessibleName("Start import")
        self.import_button.setEnabled(False)  # until the options are known
        cancel = self.buttons.button(QDialogButtonBox.StandardButton.Cancel)
        cancel.setAccessibleName("Cancel import")
        self.form = QFormLayout()
        self.form.addRow("File", self.path_label)
        self.form.addRow("Kind", self.kind_label)
        self.form.addRow("Quantization", self.recipe_box)
        self.form.addRow("", self.recipe_label)
        self._context_row = self.form.rowCount()
        self.form.addRow("Context", context_row)
        self.form.addRow("Memory", self.fit_label)
        layout = QVBoxLayout(self)
        layout.addLayout(self.form)
        layout.addWidget(self.progress)
        layout.addWidget(self.message)
        layout.addWidget(self.buttons)
        self.buttons.rejected.connect(self._on_rejected)
        self.buttons.accepted.connect(self._on_accepted)
        self.recipe_box.currentIndexChanged.connect(self._on_recipe_changed)
        self.context_box.valueChanged.connect(self._on_context_changed)
        self.offer_button.clicked.connect(self._on_offer_clicked)
        self.options: list[dict[str, Any]] = []
        self.started = False
        self.finished_ok: bool | None = None

    # -- choosing --------------------------------------------------------------------------
    def show_options(self, info: dict[str, Any]) -> None:
        """The engine's import_options: the kind, then one entry per way to quantize."""
        self.kind_label.setText(KIND_LABELS.get(str(info.get("kind")), str(info.get("kind"))))
        self.options = list(info.get("options", []))
        self.recipe_box.blockSignals(True)
        self.recipe_box.clear()
        for opt in self.options:
            self.recipe_box.addItem(option_text(opt), opt.get("recipe") or "")
        self.recipe_box.blockSignals(False)
        self.recipe_box.setEnabled(bool(self.options))
        self.import_button.setEnabled(bool(self.options))
        fit = self.option_fit(0)
        if fit is not None:  # the chosen context; up to the larger of it and the trained one
            self.context_box.blockSignals(True)
            self.context_box.setRange(1, max(fit.context, fit.trained_context))
            self.context_box.setValue(fit.context)
            self.context_box.blockSignals(False)
            self.context_box.setEnabled(True)
        self.message.setText("Choose how to quantize it, then Import.")
        self.recipe_box.setCurrentIndex(0)
        self._on_recipe_changed(0)

    def selected_recipe(self) -> str:
        return str(self.recipe_box.currentData() or "")

    def select_recipe(self, recipe: str) -> None:
        i = self.recipe_box.findData(recipe)
        if i >= 0:
            self.recipe_box.setCurrentIndex(i)

    def option_fit(self, index: int | None = None) -> Fit | None:
        """The fit of option `index` (None: the selected one) at the context chosen here."""
        index = self.recipe_box.currentIndex() if index is None else index
        opt = self.options[index] if 0 <= index < len(self.options) else None
        fit = opt.get("fit") if opt else None
        if not isinstance(fit, Fit):
            return None
        return fit.at(self.context_box.value()) if self.context_box.isEnabled() else fit

    def selected_context(self) -> int:
        return int(self.context_box.value()) if self.context_box.isEnabled() else 0

    @Slot(int)
    def _on_recipe_changed(self, index: int) -> None:
        opt = self.options[index] if 0 <= index < len(self.options) else None
        self.recipe_label.setText(str(opt.get("description", "")) if opt else "")
        self._show_fit()

    @Slot(int)
    def _on_context_changed(self, _value: int) -> None:
        self._show_fit()

    @Slot()
    def _on_offer_clicked(self) -> None:
        fit = self.option_fit()
        if fit is not None and fit.max_context > 0:
            self.context_box.setValue(fit.max_context)

    def _show_fit(self) -> None:
        """The selected option's fit at the chosen context; one that does not fit is refused
        here (Import stays off) with the largest context that would fit offered."""
        if self.started or self.finished_ok is not None:
            return
        fit = self.option_fit()
        self.offer_button.setVisible(False)
        if fit is None:
            self.fit_label.setText("")
            return
        self.fit_label.setText(fit_html(fit))
        self.import_button.setEnabled(fit.fits)
        if fit.fits:
            self.message.setText("Choose how to quantize it, then Import.")
            return
        most = fit.max_context
        text = (f"<b>This model does not fit in memory at {fit.context:,} tokens.</b><br>"
                f"It {_escape(fit.numbers())} but only {fit.available_bytes / 1e9:.2f} GB is "
                f"available ({_escape(fit.limit)}).<br>")
        if most > 0:
            text += (f"It would fit with a context of up to {most:,} tokens: take it with "
                     f"the Use {most:,} tokens button, then Import.")
            self.offer_button.setText(f"Use {most:,} tokens")
            self.offer_button.setVisible(True)
        else:
            text += ("The weights alone are more than that: close other programs or choose a "
                     "smaller quantization.")
        self.message.setText(text)

    @Slot()
    def _on_accepted(self) -> None:
        if self.started or not self.options:
            return
        fit = self.option_fit()
        if fit is not None and not fit.fits:
            return  # refused above; the button is off
        recipe, context = self.selected_recipe(), self.selected_context()
        self.started = True
        self.recipe_box.setEnabled(False)
        self.context_box.setEnabled(False)
        self.offer_button.setVisible(False)
        self.import_button.setEnabled(False)
        self.progress.setVisible(True)
        self.message.setText("Importing…")
        self.import_confirmed.emit(recipe, context)

    # -- the job ---------------------------------------------------------------------------
    def show_started(self, kind: str) -> None:
        self.kind_label.setText(KIND_LABELS.get(kind, kind))
        self.message.setText("Importing…")

    def show_progress(self, done: int, total: int) -> None:
        self.progress.setRange(0, max(total, 1))
        self.progress.setValue(done)

    def show_finished(self, manifest: dict[str, Any]) -> None:
        self.finished_ok = True
        self.progress.setRange(0, 1)
        self.progress.setValue(1)
        self.recipe_label.setText(quantization_summary(manifest))
        self.message.setText(f"Imported <b>{manifest['name']}</b>: "
                             f"{human_bytes(manifest.get('bytes'))}, "
                             f"{manifest.get('bits_per_weight')} bits per weight.")
        self._to_close_button()

    def show_refused(self, reason: str, cancelled: bool = False) -> None:
        self.finished_ok = False
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.progress.setVisible(False)
        self.recipe_box.setEnabled(False)
        self.context_box.setEnabled(False)
        self.offer_button.setVisible(False)
        if cancelled:
            self.message.setText("Import cancelled. The library is unchanged.")
        else:
            self.message.setText("<b>This cannot be imported.</b><br>"
                                 f"{_escape(reason)}<br>The library is unchanged.")
        if self.kind_label.text() == "checking…":
            self.kind_label.setText("not a model")
            for row in (self.recipe_box, self.recipe_label, self.fit_label):
                self.form.setRowVisible(row, False)
            self.form.setRowVisible(self._context_row, False)
        self._to_close_button()

    def _to_close_button(self) -> None:
        self.buttons.clear()
        close = self.buttons.addButton(QDialogButtonBox.StandardButton.Close)
        close.setAccessibleName("Close")
        self.buttons.rejected.connect(self.accept)

    @Slot()
    def _on_rejected(self) -> None:
        if self.finished_ok is not None:
            return
        if not self.started:
            self.finished_ok = False  # nothing started: closing is all there is to do
            self.reject()
            return
        self.cancel_requested.emit()
        self.message.setText("Cancelling…")


def option_text(opt: dict[str, Any]) -> str:
    """One line per way to import: name, bits per weight and size on disk where known."""
    size = opt.get("bytes")
    bpw = opt.get("bits_per_weight")
    parts = [f"{bpw:.2f} bits/weight" if bpw is not None else "",
             f"{human_bytes(size)}" if size is not None else ""]
    details = ", ".join(p for p in parts if p)
    return f"{opt.get('label')} ({details})" if details else str(opt.get("label"))


def fit_html(fit: Fit) -> str:
    """A Fit in one line of rich text: the numbers, the verdict in bold when it does not fit."""
    line = _escape(fit.summary())
    if fit.fits:
        return line
    most = fit.max_context
    offer = (f"up to {most:,} tokens would fit" if most > 0
             else "the weights alone do not fit")
    return f"<b>{line}</b> ({offer})"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

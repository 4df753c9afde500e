"""The chat screen's widgets: chat list, message view, input, and per-chat settings.

Contract: widgets only. `ChatView` shows what it is given and emits requests
(`send_requested`, `stop_requested`, `new_chat_requested`, `regenerate_requested`,
`attach_requested`, `export_requested`, ...); `ChatController` decides. `MessageView`
(app.chat.messages) renders finished messages once and re-renders only the streaming
reply. Documents dropped on the chat (or picked with Attach) are requested by path; model
files and folders are left to the window, which imports them. Every control has an
accessible name; SHORTCUTS lists the keys of the chat's actions.
The right-hand panel also holds the app-wide engine settings (KV cache mode and budgets,
the prefix cache on disk); `engine_settings_edited` carries them as an `EngineSettings`.
"""

from __future__ import annotations

import os

from PySide6.QtCore import QEvent, QModelIndex, QObject, QPoint, Qt, QUrl, Signal, Slot
from PySide6.QtGui import (
    QDragEnterEvent,
    QDropEvent,
    QKeyEvent,
    QKeySequence,
    QShortcut,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListView,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QSplitter,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.chat.messages import MessageView
from app.chat.model import ChatIdRole, ChatListModel
from app.chat.store import EngineSettings, Sampling

MODEL_SUFFIXES = (".gguf", ".safetensors", ".npz", ".bin")  # dropped: the window imports
SHORTCUTS = {
    "search": "Ctrl+F", "attach": "Ctrl+Shift+A", "regenerate": "Ctrl+R",
    "edit": "Ctrl+Shift+E", "continue": "Ctrl+Shift+Return", "previous branch": "Alt+Left",
    "next branch": "Alt+Right", "copy code": "Ctrl+Shift+C", "export": "Ctrl+Shift+S",
    "import": "Ctrl+Shift+I", "save preset": "Ctrl+Shift+P",
    "remove attachments": "Ctrl+Shift+Backspace",
}
DOCUMENT_FILTER = ("Documents (*.txt *.md *.markdown *.rst *.pdf *.py *.json *.csv *.html "
                   "*.c *.h *.cpp *.rs *.go *.js *.ts *.java *.sh *.toml *.yaml *.yml);;"
                   "All files (*)")


def document_paths(urls: list[QUrl]) -> list[str]:
    """The dropped files a chat takes as documents: local files that are not model files
    (empty if any is not, so a model dropped with a note still goes to the library)."""
    paths = [u.toLocalFile() for u in urls if u.isLocalFile()]
    if not paths or len(paths) != len(urls):
        return []
    for path in paths:
        if os.path.isdir(path) or path.lower().endswith(MODEL_SUFFIXES):
            return []
    return paths
KV_MODE_LABELS = (("mlx", "In RAM (mlx-lm)"), ("exact", "Paged, exact"),
                  ("sparse", "Paged, sparse"))
KV_BITS_LABELS = ((16, "16-bit (as computed)"), (8, "8-bit"), (4, "4-bit"))
# Speculative decoding: the settings, then each library model as a draft model.
DRAFT_LABELS = (("auto", "Auto (when it pays)"), ("off", "Off"), ("lookup", "Prompt lookup"))


# -- the chat screen ----------------------------------------------------------------------
class ChatView(QWidget):
    """Chat list | messages and input | model and sampling settings."""

    send_requested = Signal(str)
    stop_requested = Signal()
    new_chat_requested = Signal()
    chat_selected = Signal(int)
    delete_requested = Signal(int)
    model_chosen = Signal(str)
    system_prompt_edited = Signal(str)
    sampling_edited = Signal(object)  # Sampling
    engine_settings_edited = Signal(object)  # EngineSettings
    prefix_clear_requested = Signal()
    search_edited = Signal(str)
    attach_requested = Signal(list)  # paths
    attachments_cleared = Signal()
    regenerate_requested = Signal(int)  # assistant message id; 0: the last reply
    edit_requested = Signal(int)  # user message id; 0: the last one
    edit_cancelled = Signal()
    continue_requested = Signal(int)  # assistant message id; 0: the last reply
    branch_requested = Signal(int, int)  # message id (0: the last with alternatives), step
    export_requested = Signal(str)  # path: .md or .json
    import_requested = Signal(str)  # path of a .json export
    preset_chosen = Signal(str)
    preset_saved = Signal(str)  # name
    preset_deleted = Signal(str)

    def __init__(self, chats: ChatListModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.chats = chats
        self._loading_settings = False
        self.setAcceptDrops(True)

        # left: chats
        self.new_chat_button = QPushButton("New chat")
        self.new_chat_button.setAccessibleName("New chat")
        self.new_chat_button.setToolTip("Start a new chat (Ctrl+N)")
        self.chat_list = QListView()
        self.chat_list.setAccessibleName("Chats")
        self.chat_list.setModel(chats)
        self.chat_list.setEditTriggers(QAbstractItemView.EditTrigger.DoubleClicked
                                       | QAbstractItemView.EditTrigger.EditKeyPressed)
        self.chat_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.rename_button = QPushButton("Rename")
        self.rename_button.setAccessibleName("Rename chat")
        self.delete_button = QPushButton("Delete")
        self.delete_button.setAccessibleName("Delete chat")
        self.search = QLineEdit()
        self.search.setAccessibleName("Search chats")
        self.search.setPlaceholderText(f"Search chats ({SHORTCUTS['search']})")
        self.search.setClearButtonEnabled(True)
        self.export_button = QPushButton("Export…")
        self.export_button.setAccessibleName("Export chat")
        self.export_button.setToolTip(f"Save this chat as Markdown or JSON "
                                      f"({SHORTCUTS['export']})")
        self.import_button = QPushButton("Import…")
        self.import_button.setAccessibleName("Import chat")
        self.import_button.setToolTip(f"Open a chat exported as JSON ({SHORTCUTS['import']})")
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(8, 8, 4, 8)
        ll.addWidget(self.new_chat_button)
        ll.addWidget(self.search)
        ll.addWidget(self.chat_list, 1)
        row = QHBoxLayout()
        row.addWidget(self.rename_button)
        row.addWidget(self.delete_button)
        ll.addLayout(row)
        row = QHBoxLayout()
        row.addWidget(self.export_button)
        row.addWidget(self.import_button)
        ll.addLayout(row)

        # centre: messages, empty state, input
        self.messages = MessageView()
        self.empty_label = QLabel()
        self.empty_label.setAccessibleName("Chat empty state")
        self.empty_label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty_label.setWordWrap(True)
        self.empty_label.setMargin(32)
        self.stack = QStackedWidget()
        self.stack.addWidget(self.empty_label)
        self.stack.addWidget(self.messages)
        self.input = QPlainTextEdit()
        self.input.setAccessibleName("Chat input")
        self.input.setPlaceholderText("Message the model. Ctrl+Enter sends.")
        self.input.setMaximumHeight(110)
        self.input.setAcceptDrops(False)  # a dropped file is a document for the chat
        self.input.setTabChangesFocus(True)
        self.send_button = QPushButton("Send")
        self.send_button.setAccessibleName("Send")
        self.send_button.setToolTip("Send (Ctrl+Enter)")
        self.send_button.setDefault(True)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setAccessibleName("Stop")
        self.stop_button.setToolTip("Stop the reply (Ctrl+.)")
        self.stop_button.setEnabled(False)
        self.attach_button = QPushButton("Attach…")
        self.attach_button.setAccessibleName("Attach document")
        self.attach_button.setToolTip("Add a text, Markdown, source or PDF file to the next "
                                      f"message ({SHORTCUTS['attach']}), or drop it here")
        self.attachments_label = QLabel()
        self.attachments_label.setAccessibleName("Attached documents")
        self.attachments_label.setWordWrap(True)
        self.attachments_label.setTextInteractionFlags(
            Qt.TextInteractionFlag.TextSelectableByMouse)
        self.clear_attachments_button = QPushButton("Remove")
        self.clear_attachments_button.setAccessibleName("Remove attached documents")
        self.clear_attachments_button.setToolTip("Send the next message without them "
                                                 f"({SHORTCUTS['remove attachments']})")
        attach_row = QHBoxLayout()
        attach_row.setContentsMargins(0, 0, 0, 0)
        attach_row.addWidget(self.attachments_label, 1)
        attach_row.addWidget(self.clear_attachments_button)
        self.attachments_row = QWidget()
        self.attachments_row.setLayout(attach_row)
        self.attachments_row.setVisible(False)
        self.status_label = QLabel()
        self.status_label.setAccessibleName("Chat status")
        self.status_label.setWordWrap(True)
        self.status_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.attach_button)
        buttons.addStretch(1)
        input_row = QHBoxLayout()
        input_row.addWidget(self.input, 1)
        input_row.addLayout(buttons)
        centre = QWidget()
        cl = QVBoxLayout(centre)
        cl.setContentsMargins(4, 8, 4, 8)
        cl.addWidget(self.stack, 1)
        cl.addWidget(self.status_label)
        cl.addWidget(self.attachments_row)
        cl.addLayout(input_row)

        # right: settings for this chat
        self.model_picker = QComboBox()
        self.model_picker.setAccessibleName("Model picker")
        self.model_picker.setSizeAdjustPolicy(
            QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.model_picker.setMinimumContentsLength(16)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setAccessibleName("System prompt")
        self.system_prompt.setPlaceholderText("Optional: how the model should behave in this chat")
        self.system_prompt.setTabChangesFocus(True)
        self.temperature = QDoubleSpinBox()
        self.temperature.setAccessibleName("Temperature")
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setDecimals(2)
        self.temperature.setToolTip("0 always picks the most likely token")
        self.top_p = QDoubleSpinBox()
        self.top_p.setAccessibleName("Top-p")
        self.top_p.setRange(0.01, 1.0)
        self.top_p.setSingleStep(0.05)
        self.top_p.setDecimals(2)
        self.max_tokens = QSpinBox()
        self.max_tokens.setAccessibleName("Max tokens")
        self.max_tokens.setRange(1, 32768)
        self.max_tokens.setSingleStep(64)
        self.preset_picker = QComboBox()
        self.preset_picker.setAccessibleName("Preset")
        self.preset_picker.setToolTip("Apply a saved system prompt and sampling to this chat")
        self.preset_save = QPushButton("Save…")
        self.preset_save.setAccessibleName("Save preset")
        self.preset_save.setToolTip("Save this chat's system prompt and sampling as a preset "
                                    f"({SHORTCUTS['save preset']})")
        self.preset_delete = QPushButton("Delete")
        self.preset_delete.setAccessibleName("Delete preset")
        self.preset_delete.setToolTip("Delete the chosen preset")
        preset_row = QHBoxLayout()
        preset_row.setContentsMargins(0, 0, 0, 0)
        preset_row.addWidget(self.preset_picker, 1)
        preset_row.addWidget(self.preset_save)
        preset_row.addWidget(self.preset_delete)
        chat_settings = QWidget()
        rl = QVBoxLayout(chat_settings)
        rl.setContentsMargins(0, 0, 0, 0)
        preset_label = QLabel("&Preset")  # Alt+P
        preset_label.setBuddy(self.preset_picker)
        rl.addWidget(preset_label)
        rl.addLayout(preset_row)
        rl.addSpacing(6)
        rl.addWidget(QLabel("Model"))
        rl.addWidget(self.model_picker)
        rl.addSpacing(6)
        rl.addWidget(QLabel("System prompt"))
        rl.addWidget(self.system_prompt, 1)
        rl.addSpacing(6)
        form = QFormLayout()
        form.setContentsMargins(0, 0, 0, 0)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Max tokens", self.max_tokens)
        rl.addLayout(form)
        self.settings_panel = chat_settings  # disabled while no chat is open
        right = QWidget()
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(4, 8, 8, 8)
        right_layout.addWidget(chat_settings, 1)
        right_layout.addSpacing(6)
        right_layout.addWidget(self._build_engine_settings())

        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(left)
        splitter.addWidget(centre)
        splitter.addWidget(right)
        splitter.setStretchFactor(0, 0)
        splitter.setStretchFactor(1, 1)
        splitter.setStretchFactor(2, 0)
        splitter.setSizes([220, 640, 240])
        splitter.setChildrenCollapsible(False)
        self.splitter = splitter
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(splitter)

        # wiring: widgets -> requests
        self.new_chat_button.clicked.connect(self.new_chat_requested)
        self.send_button.clicked.connect(self._on_send_clicked)
        self.stop_button.clicked.connect(self.stop_requested)
        self.rename_button.clicked.connect(self._on_rename_clicked)
        self.delete_button.clicked.connect(self._on_delete_clicked)
        self.chat_list.selectionModel().currentChanged.connect(self._on_current_changed)
        self.chat_list.customContextMenuRequested.connect(self._on_context_menu_requested)
        self.model_picker.activated.connect(self._on_model_activated)
        self.system_prompt.textChanged.connect(self._on_system_prompt_changed)
        for spin in (self.temperature, self.top_p):
            spin.valueChanged.connect(self._on_sampling_changed)
        self.max_tokens.valueChanged.connect(self._on_sampling_changed)
        self.kv_mode.activated.connect(self._on_engine_setting_changed)
        self.kv_bits.activated.connect(self._on_engine_setting_changed)
        self.kv_ram_mb.editingFinished.connect(self._on_engine_setting_changed)
        self.kv_budget.editingFinished.connect(self._on_engine_setting_changed)
        self.prefix_cache.toggled.connect(self._on_engine_setting_changed)
        self.prefix_mb.editingFinished.connect(self._on_engine_setting_changed)
        self.prefix_clear.clicked.connect(self.prefix_clear_requested)
        self.draft.activated.connect(self._on_engine_setting_changed)
        self.search.textChanged.connect(self.search_edited)
        self.export_button.clicked.connect(self._on_export_clicked)
        self.import_button.clicked.connect(self._on_import_clicked)
        self.attach_button.clicked.connect(self._on_attach_clicked)
        self.clear_attachments_button.clicked.connect(self.attachments_cleared)
        self.preset_picker.activated.connect(self._on_preset_activated)
        self.preset_save.clicked.connect(self._on_preset_save_clicked)
        self.preset_delete.clicked.connect(self._on_preset_delete_clicked)
        m = self.messages
        m.regenerate_requested.connect(self.regenerate_requested)
        m.edit_requested.connect(self.edit_requested)
        m.continue_requested.connect(self.continue_requested)
        m.branch_requested.connect(self.branch_requested)
        m.copied.connect(self._on_copied)
        actions = {
            "search": self._on_search_shortcut_activated, "attach": self._on_attach_clicked,
            "regenerate": lambda: self.regenerate_requested.emit(0),
            "edit": lambda: self.edit_requested.emit(0),
            "continue": lambda: self.continue_requested.emit(0),
            "previous branch": lambda: self.branch_requested.emit(0, -1),
            "next branch": lambda: self.branch_requested.emit(0, 1),
            "copy code": lambda: self.messages.copy_code(-1),
            "export": self._on_export_clicked, "import": self._on_import_clicked,
            "save preset": self._on_preset_save_clicked,
            "remove attachments": self.attachments_cleared.emit,
        }
        self.shortcuts: dict[str, QShortcut] = {}
        for name, slot in actions.items():
            self.shortcuts[name] = QShortcut(QKeySequence(SHORTCUTS[name]), self, slot,
                                             context=Qt.ShortcutContext.WindowShortcut)
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(keys), self, self._on_send_clicked,
                      context=Qt.ShortcutContext.WindowShortcut)
        QShortcut(QKeySequence("Ctrl+."), self, self._on_stop_shortcut_activated,
                  context=Qt.ShortcutContext.WindowShortcut)
        self.input.installEventFilter(self)
        self.set_empty_text("")

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        """Ctrl+Enter and Ctrl+. in the input even when the window-wide shortcuts cannot fire
        (an inactive window, offscreen)."""
        if watched is self.input and event.type() == QEvent.Type.KeyPress:
            assert isinstance(event, QKeyEvent)
            ctrl = bool(event.modifiers() & Qt.KeyboardModifier.ControlModifier)
            shift = bool(event.modifiers() & Qt.KeyboardModifier.ShiftModifier)
            if ctrl and shift and event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
                self.continue_requested.emit(0)
                return True
            if ctrl and event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
                self._on_send_clicked()
                return True
            if event.key() == Qt.Key.Key_Escape and self.editing:
                self.edit_cancelled.emit()
                return True
            if ctrl and event.key() == Qt.Key.Key_Period:
                self.stop_requested.emit()
                return True
        return super().eventFilter(watched, event)

    def _build_engine_settings(self) -> QGroupBox:
        """KV cache mode and budgets, prefix cache: for every chat (and the local server)."""
        self.kv_mode = QComboBox()
        self.kv_mode.setAccessibleName("KV cache mode")
        for mode, label in KV_MODE_LABELS:
            self.kv_mode.addItem(label, mode)
        self.kv_mode.setToolTip("In RAM: mlx-lm's cache. Paged: pages in RAM spill to the SSD;"
                                " sparse attends to the most relevant pages only.")
        self.kv_bits = QComboBox()
        self.kv_bits.setAccessibleName("KV precision")
        for bits, label in KV_BITS_LABELS:
            self.kv_bits.addItem(label, bits)
        self.kv_bits.setToolTip("Paged cache only: 8 or 4 bits keep each page quantized, "
                                "in less memory; 4 bits costs some accuracy")
        self.kv_ram_mb = QSpinBox()
        self.kv_ram_mb.setAccessibleName("KV RAM budget")
        self.kv_ram_mb.setRange(0, 1 << 20)
        self.kv_ram_mb.setSingleStep(256)
        self.kv_ram_mb.setSuffix(" MB")
        self.kv_ram_mb.setSpecialValueText("auto")
        self.kv_ram_mb.setToolTip("RAM for the paged KV cache's pages; auto: a quarter of RAM")
        self.kv_budget = QSpinBox()
        self.kv_budget.setAccessibleName("Sparse budget")
        self.kv_budget.setRange(768, 1 << 20)  # sinks + window + one page at the defaults
        self.kv_budget.setSingleStep(256)
        self.kv_budget.setSuffix(" tok")
        self.kv_budget.setToolTip("Tokens each query attends to in sparse mode")
        self.prefix_cache = QCheckBox("Prefix cache on disk")
        self.prefix_cache.setAccessibleName("Prefix cache on disk")
        self.prefix_cache.setToolTip("Keep system prompts and conversation prefixes warm "
                                     "across restarts (STRATA_HOME/prefix)")
        self.prefix_mb = QSpinBox()
        self.prefix_mb.setAccessibleName("Prefix cache budget")
        self.prefix_mb.setRange(0, 1 << 20)
        self.prefix_mb.setSingleStep(512)
        self.prefix_mb.setSuffix(" MB")
        self.prefix_mb.setToolTip("Disk space for stored prefixes; the least recently used "
                                  "leave past it")
        self.draft = QComboBox()
        self.draft.setAccessibleName("Drafting")
        self.draft.setToolTip("Speculative decoding: drafted tokens checked in one pass, the "
                              "same text faster. Auto drafts from the prompt and the reply "
                              "when it pays; a draft model needs the same vocabulary")
        self._fill_draft([], "auto")
        self.prefix_clear = QPushButton("Clear")
        self.prefix_clear.setAccessibleName("Clear prefix cache")
        self.prefix_clear.setToolTip("Remove every stored prefix from the disk")
        prefix_row = QHBoxLayout()
        prefix_row.setContentsMargins(0, 0, 0, 0)
        prefix_row.addWidget(self.prefix_mb, 1)
        prefix_row.addWidget(self.prefix_clear)
        box = QGroupBox("Engine (all chats)")
        box.setAccessibleName("Engine settings")
        form = QFormLayout(box)
        form.setContentsMargins(6, 6, 6, 6)
        form.addRow("KV cache", self.kv_mode)
        form.addRow("KV bits", self.kv_bits)
        form.addRow("KV RAM", self.kv_ram_mb)
        form.addRow("Sparse", self.kv_budget)
        form.addRow(self.prefix_cache)
        form.addRow("Prefix disk", prefix_row)
        form.addRow("Drafting", self.draft)
        self.engine_box = box
        return box

    # -- showing ---------------------------------------------------------------------------
    def show_engine_settings(self, settings: EngineSettings) -> None:
        self._loading_settings = True
        try:
            modes = [m for m, _ in KV_MODE_LABELS]
            self.kv_mode.setCurrentIndex(modes.index(settings.kv_mode)
                                         if settings.kv_mode in modes else 0)
            found = self.kv_bits.findData(settings.kv_bits)
            self.kv_bits.setCurrentIndex(max(found, 0))
            self.kv_ram_mb.setValue(settings.kv_ram_mb)
            self.kv_budget.setValue(settings.kv_budget_tokens)
            self.prefix_cache.setChecked(settings.prefix_cache)
            self.prefix_mb.setValue(settings.prefix_mb)
            self._fill_draft(self._draft_models, settings.draft)
            self._enable_engine_fields()
        finally:
            self._loading_settings = False

    def engine_settings(self) -> EngineSettings:
        return EngineSettings(kv_mode=str(self.kv_mode.currentData()),
                              kv_bits=int(self.kv_bits.currentData()),
                              kv_ram_mb=self.kv_ram_mb.value(),
                              kv_budget_tokens=self.kv_budget.value(),
                              prefix_cache=self.prefix_cache.isChecked(),
                              prefix_mb=self.prefix_mb.value(),
                              draft=str(self.draft.currentData() or "auto"))

    def _fill_draft(self, models: list[str], current: str) -> None:
        """The drafting choices: the settings, then `models` as draft models; `current`
        selected (a model no longer listed stays, named, until another is chosen)."""
        self._draft_models = list(models)
        self.draft.blockSignals(True)
        self.draft.clear()
        for value, label in DRAFT_LABELS:
            self.draft.addItem(label, value)
        names = list(models) + ([current] if current not in models and current not in
                                dict(DRAFT_LABELS) else [])
        for name in names:
            self.draft.addItem(f"Draft model: {name}", name)
        self.draft.setCurrentIndex(max(self.draft.findData(current), 0))
        self.draft.blockSignals(False)

    def _enable_engine_fields(self) -> None:
        mode = str(self.kv_mode.currentData())
        self.kv_ram_mb.setEnabled(mode != "mlx")
        self.kv_bits.setEnabled(mode != "mlx")
        self.kv_budget.setEnabled(mode == "sparse")
        self.prefix_mb.setEnabled(self.prefix_cache.isChecked())

    def set_empty_text(self, text: str) -> None:
        self.empty_label.setText(text)
        self.stack.setCurrentWidget(self.empty_label if text else self.messages)

    def set_busy(self, busy: bool) -> None:
        """A reply is streaming: Stop on, Send off."""
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)

    def set_status(self, text: str) -> None:
        self.status_label.setText(text)
        self.status_label.setVisible(bool(text))

    @property
    def editing(self) -> bool:
        return bool(self.input.property("editing"))

    def set_editing(self, editing: bool, text: str = "") -> None:
        """Editing a sent message: its text in the input, Send makes a new branch."""
        self.input.setProperty("editing", editing)
        if editing:
            self.input.setPlainText(text)
            self.input.setFocus()
            self.send_button.setText("Send edit")
            self.set_status("Editing a message: Send (Ctrl+Enter) sends it as a new branch "
                            "(the earlier one stays); Esc cancels.")
        else:
            self.send_button.setText("Send")

    def set_attachments(self, lines: list[str]) -> None:
        """The documents waiting for the next message, one line each (empty: none)."""
        self.attachments_label.setText("\n".join(lines))
        self.attachments_row.setVisible(bool(lines))

    def set_presets(self, names: list[str], current: str = "") -> None:
        self.preset_picker.blockSignals(True)
        self.preset_picker.clear()
        self.preset_picker.addItem("(none)", "")
        for name in names:
            self.preset_picker.addItem(name, name)
        found = self.preset_picker.findData(current)
        self.preset_picker.setCurrentIndex(max(found, 0))
        self.preset_picker.blockSignals(False)
        self.preset_delete.setEnabled(bool(names))

    def set_models(self, names: list[str], current: str) -> None:
        self.model_picker.blockSignals(True)
        self.model_picker.clear()
        self.model_picker.addItems(names)
        if current in names:
            self.model_picker.setCurrentIndex(names.index(current))
        self.model_picker.blockSignals(False)
        self._fill_draft(names, str(self.draft.currentData() or "auto"))

    def show_settings(self, system_prompt: str, sampling: Sampling) -> None:
        self._loading_settings = True
        try:
            if self.system_prompt.toPlainText() != system_prompt:
                self.system_prompt.setPlainText(system_prompt)
            self.temperature.setValue(sampling.temperature)
            self.top_p.setValue(sampling.top_p)
            self.max_tokens.setValue(sampling.max_tokens)
        finally:
            self._loading_settings = False

    def select_chat(self, chat_id: int) -> None:
        row = self.chats.row_of(chat_id)
        if row >= 0:
            self.chat_list.setCurrentIndex(self.chats.index(row))

    def current_chat_id(self) -> int | None:
        index = self.chat_list.currentIndex()
        return int(index.data(ChatIdRole)) if index.isValid() else None

    # -- slots -------------------------------------------------------------------------
    @Slot()
    def _on_stop_shortcut_activated(self) -> None:
        self.stop_requested.emit()

    @Slot()
    def _on_send_clicked(self) -> None:
        text = self.input.toPlainText().strip()
        if text and self.send_button.isEnabled():
            self.send_requested.emit(text)

    @Slot(QModelIndex, QModelIndex)
    def _on_current_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if current.isValid():
            self.chat_selected.emit(int(current.data(ChatIdRole)))

    @Slot()
    def _on_rename_clicked(self) -> None:
        index = self.chat_list.currentIndex()
        if index.isValid():
            self.chat_list.edit(index)

    @Slot()
    def _on_delete_clicked(self) -> None:
        index = self.chat_list.currentIndex()
        if index.isValid():
            self._confirm_delete(index)

    def _confirm_delete(self, index: QModelIndex) -> None:
        """Deleting a chat cannot be undone, so ask first (Cancel is the default)."""
        # Read both now: a streaming reply may refresh the list while the box is open.
        chat_id = int(index.data(ChatIdRole))
        title = str(index.data(Qt.ItemDataRole.DisplayRole) or "this chat")
        box = QMessageBox(QMessageBox.Icon.Question, "Delete chat",
                          f"Delete “{title}” and all its messages? This cannot be undone.",
                          QMessageBox.StandardButton.Cancel, self)
        delete = box.addButton("Delete", QMessageBox.ButtonRole.DestructiveRole)
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        box.setAccessibleName("Delete chat?")
        box.exec()
        if box.clickedButton() is delete:
            self.delete_requested.emit(chat_id)

    @Slot(QPoint)
    def _on_context_menu_requested(self, pos: QPoint) -> None:
        index = self.chat_list.indexAt(pos)
        if not index.isValid():
            return
        menu = QMenu(self)
        menu.addAction("Rename", lambda: self.chat_list.edit(index))
        menu.addAction("Delete…", lambda: self._confirm_delete(index))
        menu.exec(self.chat_list.viewport().mapToGlobal(pos))

    @Slot(int)
    def _on_model_activated(self, row: int) -> None:
        if row >= 0:
            self.model_chosen.emit(self.model_picker.itemText(row))

    @Slot()
    def _on_system_prompt_changed(self) -> None:
        if not self._loading_settings:
            self.system_prompt_edited.emit(self.system_prompt.toPlainText())

    @Slot()
    def _on_engine_setting_changed(self) -> None:
        self._enable_engine_fields()
        if not self._loading_settings:
            self.engine_settings_edited.emit(self.engine_settings())

    @Slot()
    def _on_sampling_changed(self) -> None:
        if not self._loading_settings:
            self.sampling_edited.emit(Sampling(temperature=self.temperature.value(),
                                               top_p=self.top_p.value(),
                                               max_tokens=self.max_tokens.value()))

    # -- drops: documents for the chat ---------------------------------------------------
    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if document_paths(event.mimeData().urls() if event.mimeData().hasUrls() else []):
            event.acceptProposedAction()
        else:
            event.ignore()  # model files and folders: the window imports them

    def dropEvent(self, event: QDropEvent) -> None:
        paths = document_paths(event.mimeData().urls() if event.mimeData().hasUrls() else [])
        if not paths:
            event.ignore()
            return
        event.acceptProposedAction()
        self.attach_requested.emit(paths)

    # -- slots: new controls -----------------------------------------------------------------
    @Slot()
    def _on_search_shortcut_activated(self) -> None:
        self.search.setFocus()
        self.search.selectAll()

    @Slot(str)
    def _on_copied(self, what: str) -> None:
        self.set_status(f"Copied the {what} to the clipboard.")

    @Slot()
    def _on_attach_clicked(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach documents", "", DOCUMENT_FILTER)
        if paths:
            self.attach_requested.emit(list(paths))

    @Slot()
    def _on_export_clicked(self) -> None:
        path, chosen = QFileDialog.getSaveFileName(
            self, "Export chat", "chat.md", "Markdown (*.md);;JSON, to import again (*.json)")
        if path:
            if not path.lower().endswith((".md", ".json")):
                path += ".json" if "json" in chosen.lower() else ".md"
            self.export_requested.emit(path)

    @Slot()
    def _on_import_clicked(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Import chat", "",
                                              "Strata chat (*.json);;All files (*)")
        if path:
            self.import_requested.emit(path)

    @Slot(int)
    def _on_preset_activated(self, row: int) -> None:
        name = self.preset_picker.itemData(row)
        if name:
            self.preset_chosen.emit(str(name))

    @Slot()
    def _on_preset_save_clicked(self) -> None:
        current = str(self.preset_picker.currentData() or "")
        name, ok = QInputDialog.getText(self, "Save preset",
                                        "Name for this system prompt and sampling:",
                                        text=current)
        if ok and name.strip():
            self.preset_saved.emit(name.strip())

    @Slot()
    def _on_preset_delete_clicked(self) -> None:
        name = str(self.preset_picker.currentData() or "")
        if name:
            self.preset_deleted.emit(name)

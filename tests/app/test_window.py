"""The main window: first start fetches the starter with progress; names and shortcuts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import (
    QAbstractButton,
    QAbstractItemView,
    QAbstractSpinBox,
    QComboBox,
    QPlainTextEdit,
    QTextEdit,
    QWidget,
)

from tests.app.conftest import LOAD_TIMEOUT_MS, WindowFactory

REQUIRED_NAMES = ("Chat input", "Send", "Stop", "Messages", "Chats", "New chat",
                  "Model picker", "System prompt", "Temperature", "Top-p", "Max tokens",
                  "Model library", "Import model", "Set as default", "Delete model",
                  "Memory panel", "Rename chat", "Delete chat")


def test_first_start_fetches_the_starter_with_progress(make_window: WindowFactory,
                                                       tmp_path: Path, qtbot: Any) -> None:
    home = tmp_path / "fresh-home"
    window = make_window(home=home, preload=False)
    assert window.progress.isVisible()
    assert "starter" in window.chat.view.empty_label.text()
    messages: list[str] = []
    window.engine.starter_progressed.connect(lambda text, _d, _t: messages.append(text))
    with qtbot.waitSignal(window.engine.starter_ready, timeout=LOAD_TIMEOUT_MS):
        pass
    assert any("starter" in m.lower() for m in messages)
    assert not window.progress.isVisible()
    assert window.library.model.names() == ["smollm2-135m-instruct"]
    assert window.chat.models == ["smollm2-135m-instruct"]
    assert "Ctrl+Enter" in window.chat.view.empty_label.text()


def test_every_interactive_widget_has_an_accessible_name(make_window: WindowFactory) -> None:
    window = make_window(preload=False, fetch_starter=False)
    names = {w.accessibleName() for w in window.findChildren(QWidget)}
    missing = [n for n in REQUIRED_NAMES if n not in names]
    assert not missing
    kinds = (QAbstractButton, QAbstractItemView, QAbstractSpinBox, QComboBox, QPlainTextEdit,
             QTextEdit)
    for tab in range(window.tabs.count()):
        window.tabs.setCurrentIndex(tab)
        for widget in window.tabs.currentWidget().findChildren(QWidget):
            inner = isinstance(widget.parent(), kinds)  # a combo box's popup list, ...
            if isinstance(widget, kinds) and widget.isVisible() and not inner:
                assert widget.accessibleName(), f"{type(widget).__name__} has no name"


def test_shortcuts(make_window: WindowFactory) -> None:
    window = make_window(preload=False, fetch_starter=False)
    assert window.new_chat_action.shortcut() == QKeySequence(QKeySequence.StandardKey.New)
    assert window.import_action.shortcut() == QKeySequence(QKeySequence.StandardKey.Open)
    before = window.store.chats()
    window.new_chat_action.trigger()
    assert len(window.store.chats()) == len(before) + 1
    assert window.tabs.currentWidget() is window.chat.view


def test_the_window_reopens_where_it_was_left(make_window: WindowFactory,
                                              tmp_path: Path) -> None:
    db = tmp_path / "geometry.sqlite3"
    first = make_window(db=db, preload=False, fetch_starter=False)
    # Inside the (offscreen) screen: a restore clamps a saved geometry to it.
    room = first.screen().availableGeometry()
    first.resize(min(first.minimumSizeHint().width() + 123, room.width() - 20),
                 min(first.minimumSizeHint().height() + 45, room.height() - 20))
    left = first.size()
    assert left != _default_window(make_window, tmp_path).size()
    first.close()  # saves the geometry into the chat database
    again = make_window(db=db, preload=False, fetch_starter=False)
    assert again.size() == left


def _default_window(make_window: WindowFactory, tmp_path: Path) -> Any:
    """A window over another database opens at the default size."""
    return make_window(db=tmp_path / "other.sqlite3", preload=False, fetch_starter=False)


def test_a_bad_saved_geometry_is_ignored(make_window: WindowFactory, tmp_path: Path) -> None:
    from app.chat.store import ChatStore

    db = tmp_path / "bad.sqlite3"
    store = ChatStore(db)
    store.set_setting("window_geometry", "not hex at all")
    store.close()
    window = make_window(db=db, preload=False, fetch_starter=False)
    assert window.width() > 0

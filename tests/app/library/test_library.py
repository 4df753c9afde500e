"""The library screen: drop a GGUF and see it listed; drop a text file and see the refusal."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QFileOpenEvent
from PySide6.QtWidgets import QApplication

from app.main import MainWindow
from tests.app.conftest import REPLY_TIMEOUT_MS, WindowFactory


def _drop(window: MainWindow, *paths: Path) -> None:
    """What the window sees when files are dragged over it and released."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    args = (Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
            Qt.KeyboardModifier.NoModifier)
    enter = QDragEnterEvent(QPoint(200, 200), *args)
    window.dragEnterEvent(enter)
    assert enter.isAccepted()
    drop = QDropEvent(QPointF(200, 200), *args)
    window.dropEvent(drop)
    assert drop.isAccepted()


def _library_state(home: Path) -> list[str]:
    return sorted(p.name for p in (home / "models").iterdir())


def _drop_and_import(window: MainWindow, qtbot: Any, path: Path, recipe: str = "") -> Any:
    """Drop `path`, wait for the dialog's options, pick `recipe` ("" as stored), Import."""
    with qtbot.waitSignal(window.library.import_planned, timeout=REPLY_TIMEOUT_MS) as planned:
        _drop(window, path)
        assert window.tabs.currentWidget() is window.library.view
    dialog = window.library.dialogs[planned.args[0]]
    dialog.select_recipe(recipe)
    assert dialog.selected_recipe() == recipe
    with qtbot.waitSignal(window.library.import_done, timeout=REPLY_TIMEOUT_MS) as blocker:
        dialog.import_button.click()
    return blocker


def test_dropping_a_gguf_imports_it(make_window: WindowFactory, tmp_path: Path,
                                    qtbot: Any) -> None:
    from engine.importers.starter import starter_gguf

    home = tmp_path / "home"
    window = make_window(home=home, fetch_starter=False, preload=False)
    assert window.library.model.rowCount() == 0
    assert window.library.view.stack.currentWidget() is window.library.view.empty_label
    dropped = tmp_path / "My Little Model.gguf"
    shutil.copyfile(starter_gguf(), dropped)
    blocker = _drop_and_import(window, qtbot, dropped)
    job, ok, name = blocker.args
    assert ok, name
    assert name == "my-little-model"
    assert window.library.model.names() == ["my-little-model"]
    assert window.library.view.stack.currentWidget() is window.library.view.table
    table = window.library.view.table
    assert table.model().index(0, 0).data().startswith("my-little-model")
    assert table.model().index(0, 3).data() == "4-bit, 8-bit embedding"
    assert window.chat.models == ["my-little-model"]
    dialog = window.library.dialogs[job]
    assert "Imported" in dialog.message.text()
    assert dialog.kind_label.text() == "GGUF file"

    # set as default, then delete: the library empties again
    window.library.set_default("my-little-model")
    assert "(default)" in table.model().index(0, 0).data()
    with qtbot.waitSignal(window.engine.model_removed, timeout=REPLY_TIMEOUT_MS):
        window.library.delete("my-little-model")
    assert window.library.model.rowCount() == 0
    assert _library_state(home) == []


def test_dropping_a_text_file_is_refused_with_the_reason(make_window: WindowFactory,
                                                         tmp_path: Path, qtbot: Any) -> None:
    home = tmp_path / "home"
    window = make_window(home=home, fetch_starter=False, preload=False)
    before = _library_state(home)
    notes = tmp_path / "notes.txt"
    notes.write_text("just some notes, not a model\n")
    with qtbot.waitSignal(window.library.import_done, timeout=REPLY_TIMEOUT_MS) as blocker:
        _drop(window, notes)
    job, ok, reason = blocker.args
    assert not ok
    assert "not a model file" in reason and "notes.txt" in reason
    message = window.library.dialogs[job].message.text()
    assert "cannot be imported" in message and "not a model file" in message
    assert "library is unchanged" in message
    assert _library_state(home) == before
    assert window.library.model.rowCount() == 0


def test_dropping_a_gguf_of_an_unknown_architecture_is_refused_at_once(
        make_window: WindowFactory, tmp_path: Path, qtbot: Any) -> None:
    """The issue's user: a GGUF whose architecture Strata cannot run, with a 262,144-entry
    vocabulary, dropped on the window: a readable refusal naming the architecture and what
    is supported, from the header, and the library unchanged."""
    import time

    import gguf
    import numpy as np

    home = tmp_path / "home"
    window = make_window(home=home, fetch_starter=False, preload=False)
    path = tmp_path / "recurrent.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv7")
    w.add_block_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(262_144)])
    w.add_tensor("token_embd.weight", np.zeros((262_144, 8), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    start = time.perf_counter()
    with qtbot.waitSignal(window.library.import_done, timeout=REPLY_TIMEOUT_MS) as blocker:
        _drop(window, path)
    elapsed = time.perf_counter() - start
    job, ok, reason = blocker.args
    assert not ok and "unsupported architecture 'rwkv7'" in reason and "gemma3" in reason
    message = window.library.dialogs[job].message.text()
    assert "cannot be imported" in message and "rwkv7" in message
    assert _library_state(home) == []
    assert elapsed < 5.0, f"refused after {elapsed:.1f} s"  # the issue saw 26 s (Qt included)


def test_a_file_open_event_imports_like_a_drop(make_window: WindowFactory, tmp_path: Path,
                                               qapp: Any, qtbot: Any) -> None:
    window = make_window(home=tmp_path / "home", fetch_starter=False, preload=False)
    qapp.file_open_requested.connect(window.import_path)
    notes = tmp_path / "dock.txt"
    notes.write_text("dropped on the Dock\n")
    with qtbot.waitSignal(window.library.import_done, timeout=REPLY_TIMEOUT_MS) as blocker:
        QApplication.sendEvent(qapp, QFileOpenEvent(str(notes)))
    assert not blocker.args[1]
    assert "dock.txt" in blocker.args[2]

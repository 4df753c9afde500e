"""Rich chats on the real starter model: Markdown replies (a table, highlighted code, a copy
link), reasoning folded, regenerate and edit as branches kept across a restart, continue,
export and import, search, presets, and documents (a PDF quoted; unreadable files in one line).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import (
    QDragEnterEvent,
    QDropEvent,
    QGuiApplication,
    QTextFrame,
    QTextTable,
)

from app.chat.store import ChatStore, Sampling
from app.chat.view import SHORTCUTS
from app.main import MainWindow
from tests.app.conftest import REPLY_TIMEOUT_MS, WindowFactory
from tests.engine.importers.test_documents import encrypt_pdf, write_pdf

DOC_TIMEOUT_MS = 30_000


def _fresh_chat(window: MainWindow, max_tokens: int, temperature: float = 0.0) -> int:
    chat = window.chat.new_chat()
    window.store.update_chat(chat.id, sampling=Sampling(temperature=temperature,
                                                        max_tokens=max_tokens))
    window.chat.select(chat.id)
    return chat.id


def _reply(window: MainWindow, qtbot: Any, action: Any, *args: Any) -> dict[str, Any]:
    with qtbot.waitSignal(window.engine.reply_finished, timeout=REPLY_TIMEOUT_MS) as blocker:
        assert action(*args) is not None
    qtbot.waitUntil(lambda: window.chat.streaming is None, timeout=REPLY_TIMEOUT_MS)
    return dict(blocker.args[1])


def _colours(frame: QTextFrame) -> dict[str, str]:
    """Each text fragment in `frame` with its foreground colour."""
    out: dict[str, str] = {}
    it = frame.begin()
    while not it.atEnd():
        block = it.currentBlock()
        fragments = block.begin()
        while not fragments.atEnd():
            f = fragments.fragment()
            out[f.text().strip()] = f.charFormat().foreground().color().name()
            fragments += 1
        it += 1
    return out


def _click(window: MainWindow, href: str) -> None:
    """A link in the messages, activated as a click or Enter on it would."""
    assert f'href="{href}"' in window.chat.view.messages.toHtml(), href
    window.chat.view.messages.anchorClicked.emit(QUrl(href))


def test_a_markdown_reply_renders_a_table_and_highlighted_code(loaded_window: MainWindow,
                                                               qtbot: Any) -> None:
    window = loaded_window
    _fresh_chat(window, max_tokens=36)
    _reply(window, qtbot, window.chat.send,
           "Make a Markdown table of three fruits and their colours.")
    doc = window.chat.view.messages.document()
    tables = [f for f in doc.rootFrame().childFrames() if isinstance(f, QTextTable)]
    assert tables and tables[0].columns() == 2 and tables[0].rows() >= 3
    assert tables[0].cellAt(0, 0).firstCursorPosition().block().text().strip() == "Fruit"

    window.store.update_chat(window.chat.current.id,  # type: ignore[union-attr]
                             sampling=Sampling(temperature=0.0, max_tokens=24))
    window.chat.current = window.store.chat(window.chat.current.id)  # type: ignore[union-attr]
    _reply(window, qtbot, window.chat.send,
           "Write a Python function that returns the sum of a list of numbers.")
    view = window.chat.view.messages
    frames = [f for f in doc.rootFrame().childFrames() if type(f) is QTextFrame]
    assert frames, view.toPlainText()
    colours = _colours(frames[-1])
    assert colours["def"] != colours["sum_list"] != colours["(numbers):"]  # highlighted
    assert view.code_blocks()[-1].startswith("def sum_list(numbers):")
    _click(window, f"copycode:{len(view.code_blocks()) - 1}")
    assert QGuiApplication.clipboard().text() == view.code_blocks()[-1]
    assert "Copied the code block" in window.chat.view.status_label.text()


def test_reasoning_is_folded_until_opened(loaded_window: MainWindow) -> None:
    window = loaded_window
    chat_id = _fresh_chat(window, max_tokens=8)
    store = window.store
    store.add_message(chat_id, "user", "Why?")
    reply = store.add_message(chat_id, "assistant",
                              "<think>the sky scatters blue light</think>Because of Rayleigh.")
    window.chat.select(chat_id)
    shown = window.chat.view.messages.toPlainText()
    assert "Reasoning (5 words)" in shown and "Because of Rayleigh." in shown
    assert "scatters" not in shown
    _click(window, f"think:{reply.id}")
    assert "the sky scatters blue light" in window.chat.view.messages.toPlainText()


def test_markdown_renders_while_it_streams(loaded_window: MainWindow) -> None:
    """An open fence is code as it streams; an open think block says it is thinking."""
    window = loaded_window
    chat_id = _fresh_chat(window, max_tokens=8)
    store = window.store
    store.add_message(chat_id, "user", "Code?")
    reply = store.add_message(chat_id, "assistant", "", status="streaming")
    view = window.chat.view.messages
    view.set_messages(store.messages(chat_id), streaming_id=reply.id)
    view.update_stream("<think>first I plan")
    assert "Thinking… (3 words)" in view.toPlainText()
    view.update_stream("<think>planned</think>Here:\n\n```python\ndef f(x):\n    return")
    frames = [f for f in view.document().rootFrame().childFrames() if type(f) is QTextFrame]
    assert len(frames) == 1 and "python  (streaming…)" in view.toPlainText()
    colours = _colours(frames[0])
    assert colours["def"] != colours["f"]  # keyword and function name
    view.update_stream("<think>planned</think>Here:\n\n```python\ndef f(x):\n    return x\n```"
                       "\n\n| a | b |\n|---|---|\n| 1 | 2 |")
    assert view.code_blocks() == ["def f(x):\n    return x"]
    assert [type(f).__name__ for f in view.document().rootFrame().childFrames()] == [
        "QTextFrame", "QTextTable"]


def test_regenerate_and_edit_keep_both_branches_across_a_restart(
        loaded_window: MainWindow, make_window: WindowFactory, qtbot: Any) -> None:
    window = loaded_window
    chat_id = _fresh_chat(window, max_tokens=6, temperature=0.9)
    _reply(window, qtbot, window.chat.send, "Name a colour.")
    first_question, first_reply = window.store.messages(chat_id)
    _click(window, f"regenerate:{first_reply.id}")
    qtbot.waitUntil(lambda: window.chat.streaming is None, timeout=REPLY_TIMEOUT_MS)
    path = window.store.messages(chat_id)
    assert [m.id for m in window.store.siblings(path[1].id)] == [first_reply.id, path[1].id]
    assert "‹ 2/2 ›" in window.chat.view.messages.toPlainText()

    _click(window, f"edit:{first_question.id}")
    assert window.chat.view.input.toPlainText() == "Name a colour."
    window.chat.view.input.setPlainText("Name a fruit.")
    with qtbot.waitSignal(window.engine.reply_finished, timeout=REPLY_TIMEOUT_MS):
        qtbot.keyClick(window.chat.view.input, Qt.Key.Key_Return,
                       Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: window.chat.streaming is None, timeout=REPLY_TIMEOUT_MS)
    edited = window.store.messages(chat_id)
    assert [m.content for m in edited][0] == "Name a fruit." and len(edited) == 2
    assert len(window.store.all_messages(chat_id)) == 5

    # A restart: a second database connection and window see every branch.
    assert window.store.path is not None
    again = make_window(db=window.store.path, preload=False, fetch_starter=False)
    again.chat.select(chat_id)
    assert [m.content for m in ChatStore(window.store.path).messages(chat_id)][0] == \
        "Name a fruit."
    assert "‹ 2/2 ›" in again.chat.view.messages.toPlainText()
    _click(again, f"branch:-1:{edited[0].id}")
    shown = again.chat.view.messages.toPlainText()
    assert "Name a colour." in shown and "Name a fruit." not in shown
    assert again.store.messages(chat_id)[1].id == path[1].id  # its latest reply
    _click(again, f"branch:-1:{path[1].id}")
    assert again.store.messages(chat_id)[1].id == first_reply.id


def test_a_reply_cut_at_the_token_limit_continues(loaded_window: MainWindow,
                                                  qtbot: Any) -> None:
    window = loaded_window
    chat_id = _fresh_chat(window, max_tokens=5)
    stats = _reply(window, qtbot, window.chat.send, "Tell me about the sea.")
    assert stats["finish_reason"] == "length"
    cut = window.store.messages(chat_id)[-1]
    assert "Continue" in window.chat.view.messages.toPlainText()
    with qtbot.waitSignal(window.engine.reply_finished, timeout=REPLY_TIMEOUT_MS):
        _click(window, f"continue:{cut.id}")
    qtbot.waitUntil(lambda: window.chat.streaming is None, timeout=REPLY_TIMEOUT_MS)
    after = window.store.messages(chat_id)
    assert len(after) == 2 and after[-1].id == cut.id  # the same reply, longer
    assert after[-1].content.startswith(cut.content) and len(after[-1].content) > len(
        cut.content)


def test_export_import_search_and_presets(loaded_window: MainWindow, tmp_path: Path) -> None:
    window = loaded_window
    chat = window.chat
    chat_id = _fresh_chat(window, max_tokens=8)
    window.store.update_chat(chat_id, title="Lighthouse notes", system_prompt="Be brief.")
    window.store.add_message(chat_id, "user", "Where is the **lighthouse**?")
    window.store.add_message(chat_id, "assistant",
                             "On the *rock*.\n\n| a | b |\n|--|--|\n| 1 | 2 |")
    chat.select(chat_id)
    assert chat.export_chat(tmp_path / "chat.json") and chat.export_chat(tmp_path / "chat.md")
    data = json.loads((tmp_path / "chat.json").read_text(encoding="utf-8"))
    assert "| 1 | 2 |" in (tmp_path / "chat.md").read_text(encoding="utf-8")
    copy = chat.import_chat(tmp_path / "chat.json")
    assert copy is not None and chat.current is not None and chat.current.id == copy.id
    assert window.store.export_chat(copy.id) == data
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    assert chat.import_chat(tmp_path / "bad.json") is None
    assert chat.view.status_label.text().startswith("bad.json: is not JSON")

    assert chat.search("LIGHTHOUSE") == 2  # the chat and its copy, by title and message
    assert chat.chats.rowCount() == 2
    assert chat.search("") >= 2 and chat.chats.rowCount() >= 2

    chat.select(chat_id)
    assert chat.save_preset("Brief and cold")
    other = _fresh_chat(window, max_tokens=64)
    assert chat.apply_preset("Brief and cold")
    applied = window.store.chat(other)
    assert applied is not None and applied.system_prompt == "Be brief."
    assert applied.sampling == Sampling(temperature=0.0, max_tokens=8)
    assert chat.view.system_prompt.toPlainText() == "Be brief."
    chat.delete_preset("Brief and cold")
    assert window.store.presets() == []


def test_every_new_control_has_a_name_and_a_key(loaded_window: MainWindow) -> None:
    v = loaded_window.chat.view
    for widget in (v.search, v.export_button, v.import_button, v.attach_button,
                   v.clear_attachments_button, v.attachments_label, v.preset_picker,
                   v.preset_save, v.preset_delete):
        assert widget.accessibleName(), widget
    keys = {name: s.key().toString() for name, s in v.shortcuts.items()}
    assert keys == SHORTCUTS
    assert len(set(keys.values())) == len(keys)


def test_a_pdf_attached_and_asked_about_is_quoted(loaded_window: MainWindow, qtbot: Any,
                                                  tmp_path: Path) -> None:
    window = loaded_window
    chat = window.chat
    _fresh_chat(window, max_tokens=14)
    filler = ["The harbour town keeps its boats in a long row by the pier.",
              "Every morning the fishermen check their nets and ropes.",
              "The market opens at seven and closes before noon.",
              "Gulls circle the masts and wait for scraps of fish."]
    pages = [[filler[(i + j) % 4] for j in range(6)] for i in range(4)]
    pages[2].insert(3, "The lighthouse keeper's cat is named Marmalade.")
    pdf = write_pdf(tmp_path / "harbour.pdf", pages)
    # A KV RAM budget this document's KV is past: the send switches to the paged cache.
    before = chat.engine_settings
    chat.set_engine_settings(before.__class__(kv_mode="mlx", kv_ram_mb=4))
    try:
        with qtbot.waitSignal(window.engine.document_read, timeout=REPLY_TIMEOUT_MS) as got:
            chat.attach([pdf])
        info = got.args[1]
        assert info["pages"] == 4 and 200 < info["tokens"] < 1000
        # The starter's KV: 30 layers x 3 heads x 64 x (K, V), float16 or float32 (CPU).
        assert info["bytes_per_token"] in (23_040, 46_080)
        assert info["kv_bytes"] == info["tokens"] * info["bytes_per_token"]
        line = chat.view.attachments_label.text()
        assert line.startswith("harbour.pdf: 4 pages · ") and "MB of KV cache" in line
        assert chat.view.attachments_row.isVisibleTo(chat.view)
        _reply(window, qtbot, chat.send, "What is the name of the lighthouse keeper's cat?")
        assert chat.engine_settings.kv_mode == "exact"
        assert "the KV cache is now paged" in chat.view.status_label.text()
        reply = window.store.messages(chat.current.id)[-1]  # type: ignore[union-attr]
        assert "Marmalade" in reply.content, reply.content
        assert not chat.view.attachments_row.isVisibleTo(chat.view)
        shown = chat.view.messages.toPlainText()
        assert "Attached: harbour.pdf · 4 pages · " in shown and "MB of KV cache" in shown
        atts = window.store.attachments(chat.current.id)  # type: ignore[union-attr]
        assert [a.name for v in atts.values() for a in v] == ["harbour.pdf"]
    finally:
        chat.set_engine_settings(before)


def test_unreadable_documents_get_one_line(loaded_window: MainWindow, qtbot: Any,
                                           tmp_path: Path) -> None:
    window = loaded_window
    chat = window.chat
    _fresh_chat(window, max_tokens=8)
    text_pdf = write_pdf(tmp_path / "text.pdf", [["hello"]])
    files = {
        "scan.pdf": (write_pdf(tmp_path / "scan.pdf", [[], []], image_only=True),
                     "no text layer"),
        "locked.pdf": (encrypt_pdf(text_pdf, tmp_path / "locked.pdf"), "encrypted PDF"),
    }
    binary = tmp_path / "weights.dat"
    binary.write_bytes(bytes(range(256)) * 16)
    for name, (path, reason) in files.items():
        with qtbot.waitSignal(window.engine.error_occurred, timeout=DOC_TIMEOUT_MS):
            chat.attach([path])
        status = chat.view.status_label.text()
        assert status.startswith(f"{name}: ") and reason in status and "\n" not in status
    # A file dropped on the chat is a document for it; a model file is left to the window.
    # (Qt delivers drop events only during a real drag: the view's handlers are called.)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    for path, taken in ((model, False), (binary, True)):
        mime = QMimeData()
        mime.setUrls([QUrl.fromLocalFile(str(path))])
        enter = QDragEnterEvent(QPoint(20, 20), Qt.DropAction.CopyAction, mime,
                                Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
        chat.view.dragEnterEvent(enter)
        assert enter.isAccepted() is taken
    drop = QDropEvent(QPointF(20, 20), Qt.DropAction.CopyAction, mime,
                      Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    with qtbot.waitSignal(window.engine.error_occurred, timeout=DOC_TIMEOUT_MS):
        chat.view.dropEvent(drop)
    status = chat.view.status_label.text()
    assert status.startswith("weights.dat: is a binary file") and "\n" not in status
    assert chat.pending.get(chat.current.id if chat.current else 0, []) == []

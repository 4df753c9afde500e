"""The chat screen on the real starter model: streaming, Stop, a live event loop, restart."""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import Qt, QTimer

from app.chat.store import ChatStore, Sampling
from app.main import MainWindow
from tests.app.conftest import REPLY_TIMEOUT_MS, WindowFactory


def _fresh_chat(window: MainWindow, max_tokens: int, temperature: float = 0.0) -> int:
    chat = window.chat.new_chat()
    window.store.update_chat(chat.id, sampling=Sampling(temperature=temperature,
                                                        max_tokens=max_tokens))
    window.chat.select(chat.id)
    return chat.id


def test_send_streams_a_reply(loaded_window: MainWindow, qtbot: Any) -> None:
    window = loaded_window
    chat_id = _fresh_chat(window, max_tokens=24)
    view = window.chat.view
    deltas: list[str] = []
    window.engine.reply_delta.connect(lambda _job, text: deltas.append(text))
    view.input.setPlainText("What is the capital of France?")
    with qtbot.waitSignal(window.engine.reply_finished, timeout=REPLY_TIMEOUT_MS):
        qtbot.keyClick(view.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ControlModifier)
        assert view.stop_button.isEnabled() and not view.send_button.isEnabled()
    messages = window.store.messages(chat_id)
    assert [m.role for m in messages] == ["user", "assistant"]
    reply = messages[1]
    assert reply.status == "complete"
    assert "Paris" in reply.content
    assert reply.content == "".join(deltas)
    assert len(deltas) > 1  # streamed, not delivered whole
    assert 1 <= window.chat.repaints <= len(deltas)  # repaints coalesced
    for key in ("ttft_s", "decode_tps", "prompt_tokens", "cached_tokens"):
        assert key in reply.stats
    shown = view.messages.toPlainText()
    assert "Paris" in shown and "first token" in shown and "prompt tokens" in shown
    assert view.send_button.isEnabled() and not view.stop_button.isEnabled()
    assert view.input.toPlainText() == ""
    assert window.chat.chats.chat_at(0) is not None
    assert window.chat.chats.chat_at(0).title.startswith("What is the capital")  # type: ignore[union-attr]


def test_second_turn_reuses_the_kv_cache(loaded_window: MainWindow, qtbot: Any) -> None:
    window = loaded_window
    chat_id = _fresh_chat(window, max_tokens=8)
    worker = window.engine
    for text in ("Name a colour.", "Name another one."):
        with qtbot.waitSignal(worker.reply_finished, timeout=REPLY_TIMEOUT_MS) as blocker:
            window.chat.send(text)
    stats = blocker.args[1]
    assert stats["cached_tokens"] > 0
    assert stats["cached_tokens"] < stats["prompt_tokens"]
    assert len(window.store.messages(chat_id)) == 4


def test_stop_keeps_the_partial_reply_and_the_worker_goes_idle(
        loaded_window: MainWindow, qtbot: Any) -> None:
    window = loaded_window
    chat_id = _fresh_chat(window, max_tokens=400, temperature=0.7)
    worker = window.engine
    with qtbot.waitSignal(worker.reply_delta, timeout=REPLY_TIMEOUT_MS):
        window.chat.send("Write a long story about a lighthouse keeper.")
    with qtbot.waitSignal(worker.reply_finished, timeout=REPLY_TIMEOUT_MS) as blocker:
        qtbot.keyClick(window.chat.view.input, Qt.Key.Key_Period,
                       Qt.KeyboardModifier.ControlModifier)
    assert blocker.args[1]["finish_reason"] == "cancelled"
    qtbot.waitUntil(lambda: not window.engine.busy, timeout=REPLY_TIMEOUT_MS)
    reply = window.store.messages(chat_id)[-1]
    assert reply.status == "interrupted"
    assert reply.content.strip()
    assert blocker.args[1]["generated_tokens"] < 400
    assert window.chat.streaming is None
    assert window.chat.view.send_button.isEnabled()
    assert "interrupted" in window.chat.view.messages.toPlainText()


def test_the_event_loop_keeps_turning_during_a_reply(loaded_window: MainWindow,
                                                     qtbot: Any) -> None:
    window = loaded_window
    _fresh_chat(window, max_tokens=48, temperature=0.7)
    ticks: list[float] = []
    timer = QTimer()
    timer.setInterval(10)
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    worker = window.engine
    with qtbot.waitSignal(worker.reply_delta, timeout=REPLY_TIMEOUT_MS):
        window.chat.send("Tell me about the sea.")
    timer.start()
    started = time.perf_counter()
    with qtbot.waitSignal(worker.reply_finished, timeout=REPLY_TIMEOUT_MS):
        pass
    timer.stop()
    elapsed = time.perf_counter() - started
    assert len(ticks) >= 10
    gaps = [b - a for a, b in zip([started, *ticks], ticks, strict=False)]
    # The GUI thread never blocks on the engine: no gap near the length of the reply.
    assert max(gaps) < max(1.0, elapsed / 4), (max(gaps), elapsed, len(ticks))


def test_a_restart_shows_the_earlier_chat(loaded_window: MainWindow, make_window: WindowFactory,
                                          qtbot: Any) -> None:
    window = loaded_window
    chat_id = _fresh_chat(window, max_tokens=8)
    with qtbot.waitSignal(window.engine.reply_finished, timeout=REPLY_TIMEOUT_MS):
        window.chat.send("Say hello to the lighthouse.")
    reply = window.store.messages(chat_id)[-1].content
    assert window.store.path is not None
    again = make_window(db=window.store.path, preload=False, fetch_starter=False)
    assert again.chat.chats.row_of(chat_id) >= 0
    again.chat.select(chat_id)
    shown = again.chat.view.messages.toPlainText()
    assert "Say hello to the lighthouse." in shown
    assert reply.strip().splitlines()[0] in shown
    assert ChatStore(window.store.path).messages(chat_id)[-1].status == "complete"


def test_chats_can_be_renamed_and_deleted(loaded_window: MainWindow) -> None:
    window = loaded_window
    chat_id = _fresh_chat(window, max_tokens=8)
    model = window.chat.chats
    index = model.index(model.row_of(chat_id))
    assert model.setData(index, "Renamed")
    assert window.store.chat(chat_id).title == "Renamed"  # type: ignore[union-attr]
    view = window.chat.view
    view.select_chat(chat_id)
    _answer_delete_box("Cancel")
    view.delete_button.click()  # the box is modal: the click returns once it is answered
    assert window.store.chat(chat_id) is not None  # cancelled: nothing lost
    _answer_delete_box("Delete")
    view.delete_button.click()
    assert window.store.chat(chat_id) is None
    assert model.row_of(chat_id) == -1


def _answer_delete_box(answer: str) -> None:
    """Press `answer` in the confirmation box as soon as it is shown."""
    from PySide6.QtWidgets import QApplication, QMessageBox

    def press() -> None:
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(20, press)
            return
        assert "cannot be undone" in box.text()
        (button,) = [b for b in box.buttons() if b.text() == answer]
        button.click()

    QTimer.singleShot(0, press)

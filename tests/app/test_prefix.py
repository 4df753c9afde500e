"""Warm system prompts across restarts, the prefix cache on the memory panel, KV settings.

The SSD prefix cache is on in the app: a chat's system prompt is prefilled (or restored) when
the model loads, so after a restart the first message restores it from disk and prefills
only its own tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.chat.store import ChatStore, EngineSettings, Sampling
from app.main import MainWindow
from tests.app.conftest import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, WindowFactory

SYSTEM = ("You are the lighthouse keeper's assistant in a test of Strata's prefix cache. "
          + " ".join(f"Rule {i}: answer in one short sentence and mention beacon {i} only "
                     "if asked." for i in range(30)))


def _bytes(text: str) -> float:
    """The bytes a panel figure shows first ("237.3 MB of a 4.3 GB budget": 237.3 MB)."""
    value, unit = text.split()[:2]
    return float(value) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit]


def _wait_warmed(window: MainWindow, qtbot: Any) -> dict[str, Any]:
    with qtbot.waitSignal(window.engine.prefix_warmed, timeout=LOAD_TIMEOUT_MS) as warmed:
        pass
    return dict(warmed.args[2])


def test_a_system_prompt_stays_warm_across_a_restart(
        make_window: WindowFactory, starter: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, qtbot: Any) -> None:
    monkeypatch.setenv("STRATA_PREFIX_DIR", str(tmp_path / "prefix"))  # starts empty
    db = tmp_path / "chats.sqlite3"
    store = ChatStore(db)
    chat = store.create_chat(model=starter["name"], system_prompt=SYSTEM,
                             sampling=Sampling(temperature=0.0, max_tokens=8))
    store.close()

    first = make_window(db=db)
    info = _wait_warmed(first, qtbot)  # prefilled when the model loaded
    assert info["tokens"] > 256 and info["cached"] == 0 and info["prefilled"] == info["tokens"]
    panel = first.memory
    qtbot.waitUntil(lambda: _bytes(panel.value_text("prefix_disk")) > 0, timeout=10_000)
    assert panel.value_text("kv_ssd") != "unavailable"  # the default: the page store
    first.close()  # the window's engine writes its queued pages before it ends
    first.shutdown()

    again = make_window(db=db)
    warm = _wait_warmed(again, qtbot)
    assert warm["tokens"] == info["tokens"]
    assert warm["cached"] >= 256  # restored from the SSD, in full pages
    with qtbot.waitSignal(again.engine.reply_finished, timeout=REPLY_TIMEOUT_MS) as done:
        assert again.chat.send("Hello, who are you?") is not None
    stats = done.args[1]
    assert stats["cached_tokens"] >= warm["tokens"] - 1
    assert stats["prompt_tokens"] - stats["cached_tokens"] < 32  # only the message itself
    assert again.store.messages(chat.id)[-1].status == "complete"
    assert f"({stats['cached_tokens']} cached)" in again.chat.view.messages.toPlainText()
    # After a reply with the prefix cache on, the panel shows what it holds on disk.
    qtbot.waitUntil(lambda: _bytes(again.memory.value_text("prefix_disk")) > 0,
                    timeout=10_000)
    # The page table's row: the stored pages, and the restore's pages counted as found.
    qtbot.waitUntil(lambda: "found" in again.memory.value_text("store_pages"), timeout=10_000)
    pages = again.memory.value_text("store_pages")
    assert int(pages.split(" pages")[0].replace(",", "")) >= 2, pages


def test_kv_settings_are_stored_and_reach_the_engine(
        make_window: WindowFactory, tmp_path: Path, qtbot: Any) -> None:
    window = make_window()
    qtbot.waitUntil(lambda: window.is_ready, timeout=LOAD_TIMEOUT_MS)
    view = window.chat.view
    assert view.kv_mode.accessibleName() == "KV cache mode"
    assert not view.kv_budget.isEnabled()  # sparse only
    with qtbot.waitSignal(window.engine.settings_applied, timeout=LOAD_TIMEOUT_MS) as applied:
        view.kv_mode.setCurrentIndex(view.kv_mode.findData("sparse"))
        view.kv_mode.activated.emit(view.kv_mode.currentIndex())
    assert applied.args[0]["kv_mode"] == "sparse"
    assert view.kv_budget.isEnabled() and view.kv_ram_mb.isEnabled()
    assert EngineSettings.load(window.store).kv_mode == "sparse"
    # The paged cache's SSD tier is reported now (0 bytes until a page spills or is written).
    qtbot.waitUntil(lambda: window.memory.value_text("kv_ssd") != "unavailable",
                    timeout=10_000)
    chat = window.chat.new_chat()
    window.store.update_chat(chat.id, sampling=Sampling(temperature=0.0, max_tokens=8))
    window.chat.select(chat.id)
    with qtbot.waitSignal(window.engine.reply_finished, timeout=REPLY_TIMEOUT_MS) as done:
        window.chat.send("What is the capital of France?")
    assert done.args[1]["generated_tokens"] > 0
    lm = window.engine.worker.pool.lm
    assert lm is not None and lm.kv_settings.mode == "sparse"
    # A restart reads the stored settings back into the view.
    again = make_window(db=window.store.path, preload=False, fetch_starter=False)
    assert again.chat.view.engine_settings().kv_mode == "sparse"


def test_the_prefix_budget_and_clear_button_reach_the_disk(
        make_window: WindowFactory, starter: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, qtbot: Any) -> None:
    folder = tmp_path / "prefix"
    monkeypatch.setenv("STRATA_PREFIX_DIR", str(folder))
    db = tmp_path / "chats.sqlite3"
    store = ChatStore(db)
    store.create_chat(model=starter["name"], system_prompt=SYSTEM,
                      sampling=Sampling(temperature=0.0, max_tokens=4))
    store.close()

    def runs() -> int:
        return len(list(folder.glob("*.kvp")))

    window = make_window(db=db)
    _wait_warmed(window, qtbot)  # the system prompt's pages go to the disk
    qtbot.waitUntil(lambda: runs() == 1, timeout=10_000)
    view = window.chat.view
    assert view.prefix_mb.accessibleName() == "Prefix cache budget"
    assert view.prefix_mb.value() == 4096 and view.prefix_mb.isEnabled()
    # A budget of 0 MB: the stored prefix leaves the disk.
    with qtbot.waitSignal(window.engine.settings_applied, timeout=LOAD_TIMEOUT_MS) as applied:
        view.prefix_mb.setValue(0)
        view.prefix_mb.editingFinished.emit()
    assert applied.args[0]["prefix_mb"] == 0
    qtbot.waitUntil(lambda: runs() == 0, timeout=10_000)
    assert EngineSettings.load(window.store).prefix_mb == 0
    # Room again: the next reply stores its prompt's pages, and Clear removes them.
    with qtbot.waitSignal(window.engine.settings_applied, timeout=LOAD_TIMEOUT_MS):
        view.prefix_mb.setValue(2048)
        view.prefix_mb.editingFinished.emit()
    with qtbot.waitSignal(window.engine.reply_finished, timeout=REPLY_TIMEOUT_MS):
        assert window.chat.send("Which beacon is first?") is not None
    qtbot.waitUntil(lambda: runs() >= 1, timeout=10_000)
    assert view.prefix_clear.accessibleName() == "Clear prefix cache"
    with qtbot.waitSignal(window.engine.prefix_cleared, timeout=LOAD_TIMEOUT_MS) as cleared:
        view.prefix_clear.click()
    assert cleared.args[1]["runs"] >= 1 and cleared.args[1]["bytes"] > 0
    assert runs() == 0
    assert "Prefix cache cleared" in view.status_label.text()
    qtbot.waitUntil(lambda: window.memory.value_text("prefix_disk").startswith("0 B of a "),
                    timeout=10_000)
    # The budget is a stored setting: a restart shows it.
    again = make_window(db=db, preload=False, fetch_starter=False)
    assert again.chat.view.engine_settings().prefix_mb == 2048

"""Speculative decoding in the window, on the real starter model: the engine settings' Drafting
choice reaches the engine (and the store), a reply's stats line and the Memory panel's speed
chart show the drafted tokens kept, and the benchmark tab runs the spec suite and shows it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt

from app.bench.view import BenchmarkView, spec_cells
from app.chat.store import EngineSettings, Sampling
from app.main import MainWindow
from app.memory.chart import draft_share, speed_title
from tests.app.conftest import REPLY_TIMEOUT_MS

# A sentence said twice: the reply that repeats it copies, and prompt lookup drafts it.
COPY = ("Repeat this line exactly: the quick brown fox jumps over the lazy dog near the "
        "river bank at dawn. The quick brown fox jumps over the lazy dog near the river")
RUN_TIMEOUT_MS = 240_000


def _choose_draft(window: MainWindow, qtbot: Any, value: str) -> None:
    combo = window.chat.view.draft
    index = combo.findData(value)
    assert index >= 0, [combo.itemData(i) for i in range(combo.count())]
    with qtbot.waitSignal(window.engine.settings_applied, timeout=REPLY_TIMEOUT_MS) as applied:
        combo.setCurrentIndex(index)
        combo.activated.emit(index)  # what a user's pick sends
    assert applied.args[0]["draft"] == value


def _reply(window: MainWindow, qtbot: Any) -> dict[str, Any]:
    chat = window.chat.new_chat()
    window.store.update_chat(chat.id, sampling=Sampling(temperature=0.0, max_tokens=24))
    window.chat.select(chat.id)
    with qtbot.waitSignal(window.chat.reply_recorded, timeout=REPLY_TIMEOUT_MS) as done:
        window.chat.send(COPY)
    stats: dict[str, Any] = done.args[1]
    reply = window.store.messages(chat.id)[-1]
    assert reply.role == "assistant" and reply.stats == stats
    return stats


def test_the_drafting_setting_reaches_the_engine_and_the_stats_show_it(
        loaded_window: MainWindow, qtbot: Any) -> None:
    window = loaded_window
    view = window.chat.view
    model = window.memory.model_name
    assert view.draft.findData(model) >= 0  # each library model is offered as a draft model
    assert view.draft.currentData() == "auto"

    _choose_draft(window, qtbot, "lookup")
    assert EngineSettings.load(window.store).draft == "lookup"  # kept for the next start
    stats = _reply(window, qtbot)
    assert stats["drafted_tokens"] >= stats["accepted_tokens"] > 0
    shown = view.messages.toPlainText()
    assert f"{stats['accepted_tokens']}/{stats['drafted_tokens']} drafted tokens kept" in shown
    chart = window.memory.chart  # the Memory panel's speed chart has this reply
    assert chart.replies[-1]["drafted_tokens"] == stats["drafted_tokens"]
    assert "drafts:" in speed_title(chart.replies) and 0 < draft_share(stats) <= 1
    assert not chart.grab().isNull()

    _choose_draft(window, qtbot, "off")
    stats = _reply(window, qtbot)
    assert stats["drafted_tokens"] == 0 and stats["accepted_tokens"] == 0
    assert draft_share(stats) == 0
    _choose_draft(window, qtbot, "auto")


def test_the_benchmark_tab_runs_the_spec_suite(qtbot: Any, starter: dict[str, Any],
                                               strata_home: Path, tmp_path: Path) -> None:
    view = BenchmarkView(strata_home)
    qtbot.addWidget(view)
    view.set_models([starter["name"]], starter["name"])
    view.suite.setCurrentIndex(view.suite.findData("spec"))
    view.trials.setValue(1)
    view.extra_args = ["--spec-tasks", "chat1", "--max-tokens", "12", "--drafters", "lookup"]
    view.show()
    with qtbot.waitSignal(view.run_finished, timeout=RUN_TIMEOUT_MS) as done:
        qtbot.mouseClick(view.run_button, Qt.MouseButton.LeftButton)
    path = Path(done.args[0])
    result = json.loads(path.read_text())
    assert result["schema"] == "strata-bench-spec/1" and result["suite"] == "spec"
    (r,) = result["results"]
    assert r["identical"] and set(r["median_tps"]) == {"off", "lookup"}
    assert r["drafted"]["lookup"] >= r["accepted"]["lookup"] >= 0
    assert view.selected_paths() == [str(path)]  # the new result is listed and shown
    rows = [view.table.verticalHeaderItem(i).text()  # type: ignore[union-attr]
            for i in range(view.table.rowCount())]
    assert rows == ["chat1 · plain", "chat1 · lookup"]
    item = view.table.item(1, 0)
    assert item is not None
    cell = item.text()
    assert cell == spec_cells(result)["chat1 · lookup"][0] and "kept" in cell and "×" in cell
    view.export_csv(tmp_path / "spec.csv")
    lines = (tmp_path / "spec.csv").read_text().splitlines()
    assert lines[0].startswith("task,drafter") and len(lines) == 3

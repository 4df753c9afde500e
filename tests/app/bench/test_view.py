"""The benchmark tab: runs a tiny quick suite in a child process, fills its table, cancels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt

from app.bench.view import BenchmarkView
from engine.bench.stats import validate
from tests.app.conftest import WindowFactory

TINY = ["--load-trials", "1", "--depths", "0,32", "--prompt-tokens", "16", "--max-tokens", "4",
        "--prefix-tokens", "24", "--suffix-tokens", "8"]
RUN_TIMEOUT_MS = 240_000


def _view(qtbot: Any, home: Path, names: list[str]) -> BenchmarkView:
    view = BenchmarkView(home)
    qtbot.addWidget(view)
    view.set_models(names, names[0])
    view.peer_llama.setChecked(False)
    view.trials.setValue(1)
    view.extra_args = list(TINY)
    view.resize(1100, 700)
    view.show()
    return view


def test_the_window_has_a_benchmark_tab(make_window: WindowFactory) -> None:
    window = make_window(preload=False)
    tabs = window.tabs
    titles = [tabs.tabText(i) for i in range(tabs.count())]
    assert "Benchmark" in titles
    window.show_view("benchmark")
    assert tabs.currentWidget() is window.bench
    assert window.bench.accessibleName() == "Benchmark"
    assert window.bench.run_button.accessibleName() == "Run benchmark"


def test_a_quick_run_from_the_tab_fills_the_table(qtbot: Any, starter: dict[str, Any],
                                                  strata_home: Path, tmp_path: Path) -> None:
    view = _view(qtbot, strata_home, [starter["name"]])
    with qtbot.waitSignal(view.run_finished, timeout=RUN_TIMEOUT_MS) as done:
        qtbot.mouseClick(view.run_button, Qt.MouseButton.LeftButton)
        assert not view.run_button.isEnabled() and view.cancel_button.isEnabled()
    path = Path(done.args[0])
    assert path.parent == strata_home / "bench"  # kept for later comparison
    result = json.loads(path.read_text())
    assert validate(result) == [] and result["complete"], view.status.text()
    assert view.progress.value() == 100
    assert view.selected_paths() == [str(path)]
    headers = [view.table.horizontalHeaderItem(i).text()
               for i in range(view.table.columnCount())]
    assert headers == ["strata", "mlx-lm", "strata / mlx-lm"]
    rows = [view.table.verticalHeaderItem(i).text() for i in range(view.table.rowCount())]
    assert "generated tok/s @ 32 (tok/s)" in rows and "load, cold (s)" in rows
    for col in range(2):
        assert all(view.table.item(r, col) is not None for r in range(view.table.rowCount()))
    # The default row is the page store: its KV tiers, which mlx-lm has not, show as a dash.
    ram = rows.index("KV in RAM (MB)")
    assert view.table.item(ram, 0).text() != "–" and view.table.item(ram, 1).text() == "–"
    assert [s.name for s in view.chart.series] == ["strata", "mlx-lm"]
    assert not view.chart.grab().isNull()
    view.export_json(tmp_path / "e.json")
    view.export_csv(tmp_path / "e.csv")
    assert json.loads((tmp_path / "e.json").read_text()) == result
    assert "decode_tps@32" in (tmp_path / "e.csv").read_text()


def test_cancel_keeps_what_finished(qtbot: Any, starter: dict[str, Any],
                                    strata_home: Path) -> None:
    view = _view(qtbot, strata_home, [starter["name"]])
    with qtbot.waitSignal(view.runner.progressed, timeout=RUN_TIMEOUT_MS,
                          check_params_cb=lambda pct, label: "warm-up" in label):
        assert view.start()
    with qtbot.waitSignal(view.run_finished, timeout=RUN_TIMEOUT_MS) as done:
        qtbot.mouseClick(view.cancel_button, Qt.MouseButton.LeftButton)
    result = json.loads(Path(done.args[0]).read_text())
    assert validate(result) == []
    assert result["complete"] is False and result["interrupted"] is True
    assert result["runs"][0]["status"] == "partial"
    assert "kept what finished" in view.status.text()
    assert view.run_button.isEnabled()


def test_the_tab_opens_on_the_last_result(make_window: WindowFactory, strata_home: Path,
                                          tmp_path: Path) -> None:
    from app.cli import build_parser

    assert build_parser().parse_args(["--view", "benchmark"]).view == "benchmark"
    home = tmp_path / "home"
    (home / "bench").mkdir(parents=True)
    doc = json.loads((Path(__file__).parent / "bench_result.json").read_text())
    assert validate(doc) == []
    (home / "bench" / "20260101-000000-quick.json").write_text(json.dumps(doc))
    window = make_window(home=home, preload=False, fetch_starter=False)
    window.show_view("benchmark")
    view = window.bench
    assert view.history.count() == 1 and view.selected_paths()
    assert view.table.rowCount() > 5 and view.table.columnCount() == 3

"""The benchmark tab: pick models, suite and options, run `strata bench`, compare results.

Contract: `BenchmarkView(home)` lists earlier results from STRATA_HOME/bench (newest
selected), runs a new one through `BenchRunner` with a progress bar and Cancel, and shows the
selected results side by side: a table (figures as rows; each subject of each result a
column, then Strata / peer ratios) and charts. Export writes the selected result's JSON or
CSV, the same files as `strata bench --json/--csv`. A spec result (`strata bench spec`,
speculative decoding) shows per task and drafter the median tok/s, its ratio to plain
decoding and the drafted tokens kept (`spec_cells`). Nothing here measures anything itself.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QFileDialog,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.bench.chart import BenchChart, series_of
from app.bench.runner import BenchRunner, history
from engine.bench.stats import FIGURES, base_figure, flat_figures, write_csv

ROLE_PATH = Qt.ItemDataRole.UserRole


def figure_label(key: str) -> str:
    unit, _, label = FIGURES.get(base_figure(key), ("", True, key))
    unit = "MB" if unit == "B" else unit
    depth = f" @ {key.split('@')[1]}" if "@" in key else ""
    return f"{label}{depth} ({unit})"


def figure_text(key: str, st: dict[str, float]) -> str:
    unit = FIGURES.get(base_figure(key), ("", True, ""))[0]
    scale = 1e-6 if unit == "B" else 1.0
    fmt = "{:.0f}" if unit == "B" else ("{:.3f}" if unit == "s" else "{:.1f}")
    return fmt.format(st["median"] * scale)


def _sort_key(key: str) -> tuple[int, int]:
    order = list(FIGURES)
    base = base_figure(key)
    return (order.index(base) if base in order else len(order),
            int(key.split("@")[1]) if "@" in key else -1)


def spec_cells(doc: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """A spec result's table cells: {"task · drafter": (text, tooltip)}, plain decoding's
    row first per task: '21.3 tok/s · ×1.85 · 120/160 kept', tooltip naming the trials and
    whether the text was the plain decode's."""
    out: dict[str, tuple[str, str]] = {}
    for r in doc.get("results", []):
        for d in doc.get("drafters") or list(r.get("median_tps", {})):
            tps = (r.get("median_tps") or {}).get(d)
            if tps is None:
                continue
            text = f"{tps:.1f} tok/s"
            if d != "off":
                drafted = int((r.get("drafted") or {}).get(d, 0))
                kept = int((r.get("accepted") or {}).get(d, 0))
                text += f" · ×{(r.get('ratio') or {}).get(d, 0.0):.2f} · {kept}/{drafted} kept"
            runs = ", ".join(f"{v:.1f}" for v in (r.get("tps") or {}).get(d, []))
            tip = (f"{r.get('prompt_tokens', 0)} prompt tokens; runs {runs} tok/s; text "
                   + ("identical to plain decoding" if r.get("identical") else
                      "NOT identical to plain decoding"))
            out[f"{r['task']} · {'plain' if d == 'off' else d}"] = (text, tip)
    return out


def write_spec_csv(doc: dict[str, Any], target: Path) -> None:
    """A spec result as CSV: one row per task and drafter."""
    with open(target, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["task", "drafter", "prompt_tokens", "median_tps", "ratio_vs_off",
                    "drafted_tokens", "accepted_tokens", "generated_tokens", "identical"])
        for r in doc.get("results", []):
            for d, tps in (r.get("median_tps") or {}).items():
                w.writerow([r["task"], d, r.get("prompt_tokens", 0), f"{tps:.3f}",
                            f"{(r.get('ratio') or {}).get(d, 0.0):.3f}",
                            (r.get("drafted") or {}).get(d, 0),
                            (r.get("accepted") or {}).get(d, 0),
                            (r.get("generated") or {}).get(d, 0), bool(r.get("identical"))])


def run_title(path: Path, result: dict[str, Any]) -> str:
    date = str(result.get("machine", {}).get("date", ""))[:16].replace("T", " ")
    models = ", ".join(m["name"] for m in result.get("models", []))
    state = "" if result.get("complete") else " (partial)"
    if result.get("suite") == "spec":
        state += f" · {result.get('max_tokens', '?')} tokens"
    return f"{date} · {result.get('suite', '?')} · {models}{state}"


class BenchmarkView(QWidget):
    run_finished = Signal(str)  # the result file

    def __init__(self, home: Path, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Benchmark")
        self.home = Path(home)
        self.runner = BenchRunner(self.home, self)
        self.extra_args: list[str] = []  # more `strata bench` options (tests: tiny settings)
        self.results: dict[str, dict[str, Any]] = {}

        # -- options --
        self.models = QListWidget()
        self.models.setAccessibleName("Benchmark models")
        self.models.setMaximumHeight(72)
        self.suite = QComboBox()
        self.suite.setAccessibleName("Suite")
        self.suite.addItem("quick (about 2 minutes)", "quick")
        self.suite.addItem("full (depth sweep to 16k, KV modes)", "full")
        self.suite.addItem("spec (speculative decoding: edit, summary, open chat)", "spec")
        self.trials = QSpinBox()
        self.trials.setAccessibleName("Trials")
        self.trials.setRange(0, 20)
        self.trials.setSpecialValueText("suite default")
        self.peer_mlx = QCheckBox("mlx-lm")
        self.peer_mlx.setChecked(True)
        self.peer_mlx.setAccessibleName("Peer mlx-lm")
        self.peer_llama = QCheckBox("llama.cpp (if installed)")
        self.peer_llama.setChecked(True)
        self.peer_llama.setAccessibleName("Peer llama.cpp")
        self.run_button = QPushButton("Run benchmark")
        self.run_button.setAccessibleName("Run benchmark")
        self.run_button.setDefault(True)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.setAccessibleName("Cancel benchmark")
        self.cancel_button.setEnabled(False)
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Benchmark progress")
        self.progress.setRange(0, 100)
        self.progress.setValue(0)
        self.status = QLabel("Each subject runs in its own process on the same weights; "
                             "a run keeps the machine busy.")
        self.status.setAccessibleName("Benchmark status")
        self.status.setWordWrap(True)

        opts = QGroupBox("New run")
        grid = QHBoxLayout(opts)
        col = QVBoxLayout()
        col.addWidget(QLabel("Models"))
        col.addWidget(self.models)
        grid.addLayout(col, 2)
        col = QVBoxLayout()
        for label, w in (("Suite", self.suite), ("Trials", self.trials)):
            row = QHBoxLayout()
            row.addWidget(QLabel(label))
            row.addWidget(w, 1)
            col.addLayout(row)
        peers = QHBoxLayout()
        peers.addWidget(QLabel("Peers"))
        peers.addWidget(self.peer_mlx)
        peers.addWidget(self.peer_llama)
        peers.addStretch(1)
        col.addLayout(peers)
        grid.addLayout(col, 2)
        col = QVBoxLayout()
        buttons = QHBoxLayout()
        buttons.addWidget(self.run_button)
        buttons.addWidget(self.cancel_button)
        col.addLayout(buttons)
        col.addWidget(self.progress)
        col.addWidget(self.status)
        grid.addLayout(col, 3)

        # -- earlier runs, table, charts --
        self.history = QListWidget()
        self.history.setAccessibleName("Earlier runs")
        self.history.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.export_json_button = QPushButton("Export JSON…")
        self.export_csv_button = QPushButton("Export CSV…")
        self.export_json_button.setAccessibleName("Export benchmark JSON")
        self.export_csv_button.setAccessibleName("Export benchmark CSV")
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        hint = QLabel("Earlier runs (select several to compare)")
        ll.addWidget(hint)
        ll.addWidget(self.history, 1)
        ex = QHBoxLayout()
        ex.addWidget(self.export_json_button)
        ex.addWidget(self.export_csv_button)
        ll.addLayout(ex)

        self.table = QTableWidget()
        self.table.setAccessibleName("Benchmark results")
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.chart = BenchChart()
        right = QSplitter(Qt.Orientation.Vertical)
        right.addWidget(self.table)
        right.addWidget(self.chart)
        right.setStretchFactor(0, 1)
        right.setStretchFactor(1, 1)
        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(left)
        split.addWidget(right)
        split.setStretchFactor(0, 1)
        split.setStretchFactor(1, 4)
        split.setSizes([230, 870])

        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 12, 12, 12)
        layout.addWidget(opts)
        layout.addWidget(split, 1)

        self.run_button.clicked.connect(self._on_run_clicked)
        self.cancel_button.clicked.connect(self.runner.cancel)
        self.history.itemSelectionChanged.connect(self._on_history_selection_changed)
        self.export_json_button.clicked.connect(self._on_export_json_clicked)
        self.export_csv_button.clicked.connect(self._on_export_csv_clicked)
        self.runner.progressed.connect(self._on_runner_progressed)
        self.runner.finished.connect(self._on_runner_finished)
        self.runner.failed.connect(self._on_runner_failed)
        self.reload_history()

    # -- public ------------------------------------------------------------------------
    def set_models(self, names: list[str], default: str = "") -> None:
        checked = set(self.checked_models()) or {default or (names[0] if names else "")}
        self.models.clear()
        for name in names:
            item = QListWidgetItem(name)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Checked if name in checked
                               else Qt.CheckState.Unchecked)
            self.models.addItem(item)

    def checked_models(self) -> list[str]:
        return [self.models.item(i).text() for i in range(self.models.count())
                if self.models.item(i).checkState() == Qt.CheckState.Checked]

    def reload_history(self, select: str | None = None) -> None:
        self.history.blockSignals(True)
        self.history.clear()
        self.results = {}
        for path, doc in history(self.home):
            self.results[str(path)] = doc
            item = QListWidgetItem(run_title(path, doc))
            item.setData(ROLE_PATH, str(path))
            item.setToolTip(str(path))
            self.history.addItem(item)
        self.history.blockSignals(False)
        target = next((i for i in range(self.history.count())
                       if self.history.item(i).data(ROLE_PATH) == select), 0)
        if self.history.count():
            self.history.setCurrentRow(target)  # newest first: the last run by default
        else:
            self.show_results([])

    def selected_paths(self) -> list[str]:
        return [str(i.data(ROLE_PATH)) for i in self.history.selectedItems()]

    def start(self) -> bool:
        models = self.checked_models()
        if not models:
            self.status.setText("Pick at least one model.")
            return False
        peers = [p for p, box in (("mlx-lm", self.peer_mlx), ("llama.cpp", self.peer_llama))
                 if box.isChecked()]
        self.runner.start(models, str(self.suite.currentData()),
                          self.trials.value() or None, peers, self.extra_args)
        self.run_button.setEnabled(False)
        self.cancel_button.setEnabled(True)
        self.progress.setValue(0)
        self.status.setText("Starting…")
        return True

    def show_results(self, paths: list[str]) -> None:
        """Fill the table and the charts with the runs of these result files."""
        spec = [p for p in paths if (self.results.get(p) or {}).get("suite") == "spec"]
        if spec and spec[0] == paths[0]:
            self._show_spec(spec)
            return
        paths = [p for p in paths if p not in spec]  # another table: the first's kind shows
        columns: list[tuple[str, dict[str, dict[str, float]]]] = []
        ratio_cols: list[tuple[str, dict[str, float]]] = []
        series = []
        several = len(paths) > 1
        for path in paths:
            doc = self.results.get(path) or {}
            when = str(doc.get("machine", {}).get("date", ""))[5:16].replace("T", " ")
            for run in doc.get("runs", []):
                name = run["subject"] + ("" if run.get("setting", "default") == "default"
                                         else f" [{run['setting']}]")
                if len(doc.get("models", [])) > 1:
                    name += f" · {run['model']}"
                if several:
                    name += f" · {when}"
                columns.append((name, flat_figures(run)))
                series.append(series_of(run, name))
            for r in doc.get("ratios", []):
                if r.get("setting", "default") == "default":
                    ratio_cols.append((f"strata / {r['peer']}" + (f" · {when}" if several
                                                                     else ""), r["figures"]))
        keys = sorted({k for _, figs in columns for k in figs}, key=_sort_key)
        self.table.clear()
        self.table.setRowCount(len(keys))
        self.table.setColumnCount(len(columns) + len(ratio_cols))
        self.table.setHorizontalHeaderLabels([c for c, _ in columns] + [c for c, _ in ratio_cols])
        self.table.setVerticalHeaderLabels([figure_label(k) for k in keys])
        for row, key in enumerate(keys):
            for col, (_, figs) in enumerate(columns):
                st = figs.get(key)
                if st is None:
                    # A figure this subject has not (a peer's KV tiers): a dash, as the CLI
                    # prints, never an empty cell that reads as a missing result.
                    item = QTableWidgetItem("–")
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight
                                          | Qt.AlignmentFlag.AlignVCenter)
                    item.setToolTip("not a figure of this subject")
                    self.table.setItem(row, col, item)
                    continue
                item = QTableWidgetItem(figure_text(key, st))
                item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if st["n"] > 1:
                    lo = figure_text(key, {"median": st["min"]})
                    hi = figure_text(key, {"median": st["max"]})
                    item.setToolTip(f"median of {int(st['n'])} trials; min {lo}, max {hi}")
                self.table.setItem(row, col, item)
            for j, (_, ratios) in enumerate(ratio_cols):
                r = ratios.get(key)
                if r:
                    item = QTableWidgetItem(f"×{r:.2f}")
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight
                                          | Qt.AlignmentFlag.AlignVCenter)
                    self.table.setItem(row, len(columns) + j, item)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.chart.set_series(series)

    def _show_spec(self, paths: list[str]) -> None:
        """Spec results: a row per task and drafter, a column per result (no charts)."""
        columns = []
        for path in paths:
            doc = self.results.get(path) or {}
            when = str(doc.get("machine", {}).get("date", ""))[5:16].replace("T", " ")
            columns.append((f"{doc.get('model', '?')} · {when}", spec_cells(doc)))
        keys = list(dict.fromkeys(k for _, cells in columns for k in cells))
        self.table.clear()
        self.table.setRowCount(len(keys))
        self.table.setColumnCount(len(columns))
        self.table.setHorizontalHeaderLabels([c for c, _ in columns])
        self.table.setVerticalHeaderLabels(keys)
        for row, key in enumerate(keys):
            for col, (_, cells) in enumerate(columns):
                if key in cells:
                    item = QTableWidgetItem(cells[key][0])
                    item.setToolTip(cells[key][1])
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight
                                          | Qt.AlignmentFlag.AlignVCenter)
                    self.table.setItem(row, col, item)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.chart.set_series([])

    def export_json(self, target: Path) -> None:
        paths = self.selected_paths()
        if paths:
            shutil.copyfile(paths[0], target)

    def export_csv(self, target: Path) -> None:
        paths = self.selected_paths()
        if paths and self.results[paths[0]].get("suite") == "spec":
            write_spec_csv(self.results[paths[0]], target)
        elif paths:
            write_csv(self.results[paths[0]], target)

    def shutdown(self) -> None:
        self.runner.shutdown()

    # -- slots -------------------------------------------------------------------------
    @Slot()
    def _on_run_clicked(self) -> None:
        self.start()

    @Slot()
    def _on_history_selection_changed(self) -> None:
        self.show_results(self.selected_paths())

    @Slot(int, str)
    def _on_runner_progressed(self, percent: int, label: str) -> None:
        self.progress.setValue(percent)
        self.status.setText(label)

    @Slot(str, object)
    def _on_runner_finished(self, path: str, result: dict[str, Any]) -> None:
        self.run_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        done = bool(result.get("complete"))
        skipped = "; ".join(f"{s['subject']} skipped: {s['reason']}"
                            for s in result.get("skipped", []))
        self.status.setText(("Done" if done else "Stopped: kept what finished")
                            + (f". {skipped}" if skipped else "."))
        if done:
            self.progress.setValue(100)
        self.reload_history(select=path)
        self.run_finished.emit(path)

    @Slot(str)
    def _on_runner_failed(self, message: str) -> None:
        self.run_button.setEnabled(True)
        self.cancel_button.setEnabled(False)
        self.status.setText(f"The benchmark did not run: {message}")

    @Slot()
    def _on_export_json_clicked(self) -> None:
        target, _ = QFileDialog.getSaveFileName(self, "Export benchmark", "bench.json",
                                                "JSON (*.json)")
        if target:
            self.export_json(Path(target))

    @Slot()
    def _on_export_csv_clicked(self) -> None:
        target, _ = QFileDialog.getSaveFileName(self, "Export benchmark", "bench.csv",
                                                "CSV (*.csv)")
        if target:
            self.export_csv(Path(target))


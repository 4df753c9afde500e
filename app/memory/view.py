"""The memory panel: figures from the engine's memory snapshots, a memory bar, the chart.

Contract: `show_snapshot(MemorySnapshot)` updates every figure (the worker samples about once
a second); a counter the engine does not have reads "unavailable", never 0, with the
snapshot's reason (e.g. "paged KV off") in the row's hint. The disk rows (KV cache on the SSD,
prefix cache on disk) are bytes on disk, not memory: they stay out of the memory bar.
`set_replies(stats)` feeds the latency chart. Nothing here reads the engine itself.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont
from PySide6.QtWidgets import (
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from app.cluster.memory_rows import MacsBox
from app.format import UNAVAILABLE, human_bytes
from app.memory.chart import LatencyChart, MemoryBar
from engine.platform import MemorySnapshot

WEIGHTS_COLOUR = QColor("#4a86d8")
KV_COLOUR = QColor("#e08a2e")
REST_COLOUR = QColor("#8e6bd1")
OTHERS_COLOUR = QColor("#9a9a9a")

PROCESS_ROWS = (
    ("weights", "Model weights", "parameters of the loaded model"),
    ("kv_ram", "KV cache in RAM", "keys and values of the open chats"),
    ("kv_ssd", "KV cache on SSD", "pages of the paged KV cache spilled to the SSD"),
    ("prefix_disk", "Prefix cache on disk", "prompt prefixes kept warm across restarts; "
     "the budget is the page store's, which the KV on SSD shares"),
    ("kv_shared", "KV shared with the prefix cache",
     "stored pages a chat reads in place, not copied"),
    ("prefix_hits", "Prefix cache hits", "prompts that found stored pages, this session"),
    ("store_pages", "Stored pages", "full pages in the page store; shared: on the chains of "
     "more than one stored prompt; hit rate: pages found of pages asked for, this session"),
    ("rest", "Rest of the process", "resident memory minus weights and KV cache"),
    ("rss", "Process resident (RSS)", "what the operating system counts for Strata"),
    ("mlx_active", "MLX active", "memory MLX has allocated and in use"),
    ("mlx_peak", "MLX peak (last reply)", "highest allocation since the last reply began"),
    ("mlx_cache", "MLX buffer cache", "freed buffers MLX keeps for reuse"),
)
SYSTEM_ROWS = (
    ("total", "Total", ""),
    ("available", "Available", "usable without swapping"),
    ("pressure", "In use", "share of memory in use"),
    ("swap", "Swap used", ""),
    ("wired", "Wired", "macOS only"),
    ("compressed", "Compressed", "not reported by psutil"),
)


def _hit_rate(hits: int | None, lookups: int | None) -> str:
    if hits is None or lookups is None:
        return "prefix cache off"
    if not lookups:
        return "no prompt yet"
    return f"{hits} of {lookups} prompts ({100 * hits / lookups:.0f}%)"


def _store_pages(s: MemorySnapshot) -> str:
    if s.store_pages is None:
        return "prefix cache off" if s.store_asked_pages is None else "page table unreadable"
    text = f"{s.store_pages:,} pages, {s.store_shared_pages or 0:,} shared"
    asked, found = s.store_asked_pages or 0, s.store_found_pages or 0
    if asked:
        text += f"; {found:,} of {asked:,} pages asked found ({100 * found / asked:.0f}%)"
    return text


def snapshot_figures(s: MemorySnapshot) -> dict[str, str]:
    """Label texts for every row key, from one snapshot."""
    rest: int | None = None
    if s.weights_bytes is not None:
        rest = s.process_rss_bytes - s.weights_bytes - (s.kv_ram_bytes or 0)
        rest = rest if rest >= 0 else None
    return {
        "weights": human_bytes(s.weights_bytes) if s.weights_bytes is not None
        else "no model loaded",
        "kv_ram": human_bytes(s.kv_ram_bytes) if s.kv_ram_bytes is not None
        else "no model loaded",
        "kv_ssd": human_bytes(s.kv_ssd_bytes),
        "prefix_disk": human_bytes(s.prefix_disk_bytes) if s.store_budget_bytes is None
        else f"{human_bytes(s.prefix_disk_bytes)} of a {human_bytes(s.store_budget_bytes)} "
             "budget",
        "kv_shared": human_bytes(s.kv_shared_bytes) if s.kv_shared_bytes is not None
        else "paged KV off",
        "prefix_hits": _hit_rate(s.prefix_hits, s.prefix_lookups),
        "store_pages": _store_pages(s),
        "rest": human_bytes(rest),
        "rss": human_bytes(s.process_rss_bytes),
        "mlx_active": human_bytes(s.mlx_active_bytes),
        "mlx_peak": human_bytes(s.mlx_peak_bytes),
        "mlx_cache": human_bytes(s.mlx_cache_bytes),
        "total": human_bytes(s.system_total_bytes),
        "available": human_bytes(s.system_available_bytes),
        "pressure": f"{s.system_used_percent:.0f}%",
        "swap": human_bytes(s.swap_used_bytes),
        "wired": human_bytes(s.wired_bytes),
        "compressed": human_bytes(s.compressed_bytes),
    }


class MemoryPanel(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Memory panel")
        self.values: dict[str, QLabel] = {}
        self.hints: dict[str, QLabel] = {}
        self._notes: dict[str, str] = {}
        self.snapshot: MemorySnapshot | None = None
        self.model_name = ""
        process = self._group("Strata", PROCESS_ROWS)
        system = self._group("This computer", SYSTEM_ROWS)
        self.bar = MemoryBar()
        self.chart = LatencyChart()
        self.updated_label = QLabel("Waiting for the first reading…")
        self.updated_label.setEnabled(False)
        figures = QHBoxLayout()
        figures.addWidget(process, 3)
        figures.addWidget(system, 2)
        chart_box = QGroupBox("First token and speed")
        cl = QVBoxLayout(chart_box)
        cl.addWidget(self.chart)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 12, 12, 12)
        layout.addLayout(figures)
        self.macs = MacsBox()  # a split model: a row a Mac (hidden otherwise)
        layout.addWidget(self.macs)
        layout.addWidget(self.bar)
        layout.addWidget(chart_box, 1)
        layout.addWidget(self.updated_label)

    def _group(self, title: str, rows: tuple[tuple[str, str, str], ...]) -> QGroupBox:
        box = QGroupBox(title)
        grid = QGridLayout(box)
        grid.setColumnStretch(2, 1)
        grid.setHorizontalSpacing(16)
        bold = QFont()
        bold.setBold(True)
        for i, (key, label, note) in enumerate(rows):
            name = QLabel(label)
            value = QLabel("…")
            value.setAccessibleName(label)
            value.setFont(bold)
            value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            hint = QLabel(note)
            hint.setEnabled(False)  # drawn in the palette's muted colour
            hint.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
            name.setToolTip(note)
            grid.addWidget(name, i, 0)
            grid.addWidget(value, i, 1)
            grid.addWidget(hint, i, 2)
            self.values[key] = value
            self.hints[key] = hint
            self._notes[key] = note
        grid.setRowStretch(len(rows), 1)  # rows keep their natural height, space goes below
        return box

    def set_model_name(self, name: str) -> None:
        self.model_name = name

    def show_snapshot(self, s: MemorySnapshot) -> None:
        self.snapshot = s
        for key, text in snapshot_figures(s).items():
            self.values[key].setText(text)
        self.macs.show_ranks(getattr(s, "ranks", ()))  # engine.runtime.cluster's snapshot
        for key, figure, reason in (("kv_ssd", s.kv_ssd_bytes, s.kv_ssd_reason),
                                    ("prefix_disk", s.prefix_disk_bytes, s.prefix_disk_reason)):
            hint = reason if figure is None and reason else self._notes[key]
            self.hints[key].setText(hint)
            self.values[key].setToolTip(hint)
        if self.model_name and s.weights_bytes is not None:
            self.values["weights"].setToolTip(self.model_name)
        weights = s.weights_bytes or 0
        kv = s.kv_ram_bytes or 0
        rest = max(s.process_rss_bytes - weights - kv, 0)
        others = max(s.system_total_bytes - s.system_available_bytes - s.process_rss_bytes, 0)
        self.bar.set_parts(s.system_total_bytes, [
            ("weights", weights, WEIGHTS_COLOUR), ("KV cache", kv, KV_COLOUR),
            ("rest of Strata", rest, REST_COLOUR), ("other programs", others, OTHERS_COLOUR),
        ])
        import time

        self.updated_label.setText(
            "Updated every second · " + time.strftime("%H:%M:%S", time.localtime(s.taken_at))
            + (f" · model: {self.model_name}" if self.model_name else ""))

    def set_replies(self, replies: list[dict[str, Any]]) -> None:
        self.chart.set_replies(replies)

    def value_text(self, key: str) -> str:
        return self.values[key].text()


__all__ = ["MemoryPanel", "snapshot_figures", "UNAVAILABLE"]

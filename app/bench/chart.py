"""Painted benchmark charts: tok/s against context depth, first-token latency, memory.

Contract: `BenchChart.set_series(series)` takes one `Series` per (result, subject, setting)
and draws four small panels with QPainter in the palette's colours; nothing here reads files
or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

SERIES_COLOURS = [QColor(c) for c in ("#4a86d8", "#e08a2e", "#4fa84f", "#8e6bd1", "#d14b6b",
                                      "#2fa3a8", "#9a9a9a")]


@dataclass
class Series:
    """What one subject measured in one result, reduced to the charted medians."""

    name: str
    prompt_tps: dict[int, float] = field(default_factory=dict)  # depth -> tok/s
    decode_tps: dict[int, float] = field(default_factory=dict)
    ttft_s: float | None = None
    ttft_cached_s: float | None = None
    memory: dict[str, float] = field(default_factory=dict)  # label -> bytes


# Memory per tier: a paged KV cache reports what sits in RAM and what sits on the SSD.
MEMORY_BARS = (("rss_peak_bytes", "process peak"), ("mlx_peak_bytes", "MLX peak"),
               ("kv_bytes", "KV cache"), ("kv_ram_bytes", "KV in RAM"),
               ("kv_ssd_bytes", "KV on SSD"))


def series_of(run: dict[str, Any], name: str) -> Series:
    s = Series(name)
    for d in run.get("depths") or []:
        s.prompt_tps[int(d["depth"])] = float(d["prompt_tps"]["median"])
        s.decode_tps[int(d["depth"])] = float(d["decode_tps"]["median"])
    ttft = run.get("ttft") or {}
    if ttft.get("uncached"):
        s.ttft_s = float(ttft["uncached"]["ttft_s"]["median"])
    if ttft.get("cached"):
        s.ttft_cached_s = float(ttft["cached"]["ttft_s"]["median"])
    mem = run.get("memory") or {}
    for key, label in MEMORY_BARS:
        if mem.get(key) is not None:
            s.memory[label] = float(mem[key])
    return s


class BenchChart(QWidget):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Benchmark charts")
        self.setMinimumHeight(260)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.series: list[Series] = []

    def sizeHint(self) -> QSize:
        return QSize(700, 320)

    def set_series(self, series: list[Series]) -> None:
        self.series = series[: len(SERIES_COLOURS)]
        self.update()

    # -- painting ----------------------------------------------------------------------
    def paintEvent(self, _event: Any) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = self.palette()
        text, muted = (pal.color(QPalette.ColorRole.WindowText),
                       pal.color(QPalette.ColorRole.PlaceholderText))
        rect = QRectF(self.rect()).adjusted(6, 4, -6, -4)
        if not self.series:
            p.setPen(muted)
            p.drawText(rect, Qt.AlignmentFlag.AlignCenter,
                       "Run a benchmark: its speeds, first-token latency and memory\n"
                       "are charted here, with earlier runs side by side.")
            return
        fm = p.fontMetrics()
        line = fm.height()
        x = rect.left()
        for i, s in enumerate(self.series):  # legend
            p.fillRect(QRectF(x, rect.top() + 3, 10, 10), SERIES_COLOURS[i])
            p.setPen(text)
            p.drawText(QPointF(x + 14, rect.top() + line - 2), s.name)
            x += 14 + fm.horizontalAdvance(s.name) + 16
        body = rect.adjusted(0, line + 8, 0, 0)
        w, h = body.width() / 2, body.height() / 2
        cells = [QRectF(body.left() + (i % 2) * w, body.top() + (i // 2) * h, w, h)
                 for i in range(4)]
        depths = sorted({d for s in self.series for d in (*s.prompt_tps, *s.decode_tps)})
        self._lines(p, cells[0], "prompt tok/s against context depth", depths,
                    [s.prompt_tps for s in self.series], text, muted)
        self._lines(p, cells[1], "generated tok/s against context depth", depths,
                    [s.decode_tps for s in self.series], text, muted)
        self._bars(p, cells[2], "first token (s): no cached prefix, cached prefix",
                   ["not cached", "cached"],
                   [[s.ttft_s, s.ttft_cached_s] for s in self.series], text, muted, "s")
        labels = [label for _, label in MEMORY_BARS if any(label in s.memory for s in self.series)]
        self._bars(p, cells[3], "memory (MB)", labels,
                   [[(s.memory[k] / 1e6 if k in s.memory else None) for k in labels]
                    for s in self.series], text, muted, "")

    @staticmethod
    def _frame(p: QPainter, cell: QRectF, title: str, muted: QColor) -> QRectF:
        fm = p.fontMetrics()
        p.setPen(muted)
        p.drawText(QRectF(cell.left() + 4, cell.top(), cell.width(), fm.height()),
                   Qt.AlignmentFlag.AlignLeft, title)
        area = cell.adjusted(44, fm.height() + 6, -12, -fm.height() - 8)
        pen = QPen(muted)
        pen.setWidthF(0.5)
        p.setPen(pen)
        p.drawLine(area.bottomLeft(), area.bottomRight())
        p.drawLine(area.bottomLeft(), area.topLeft())
        return area

    @staticmethod
    def _axis_label(p: QPainter, area: QRectF, peak: float, muted: QColor) -> None:
        p.setPen(muted)
        label = f"{peak:.2f}" if peak < 10 else f"{peak:.0f}"
        p.drawText(QRectF(area.left() - 44, area.top() - 8, 40, 16),
                   int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter), label)
        p.drawText(QRectF(area.left() - 44, area.bottom() - 8, 40, 16),
                   int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter), "0")

    def _lines(self, p: QPainter, cell: QRectF, title: str, depths: list[int],
               values: list[dict[int, float]], text: QColor, muted: QColor) -> None:
        area = self._frame(p, cell, title, muted)
        peak = max([v for vs in values for v in vs.values()] + [1e-3]) * 1.15
        self._axis_label(p, area, peak, muted)
        if not depths:
            return
        step = area.width() / max(len(depths) - 1, 1)
        xs = {d: area.left() + (i * step if len(depths) > 1 else area.width() / 2)
              for i, d in enumerate(depths)}
        p.setPen(muted)
        for d, x in xs.items():
            p.drawText(QRectF(x - 30, area.bottom() + 2, 60, p.fontMetrics().height()),
                       Qt.AlignmentFlag.AlignCenter, f"{d // 1024}k" if d >= 1024 else str(d))
        for i, vs in enumerate(values):
            pen = QPen(SERIES_COLOURS[i])
            pen.setWidthF(2.0)
            p.setPen(pen)
            pts = [QPointF(xs[d], area.bottom() - area.height() * vs[d] / peak)
                   for d in depths if d in vs]
            for a, b in zip(pts, pts[1:], strict=False):
                p.drawLine(a, b)
            p.setBrush(SERIES_COLOURS[i])
            for pt in pts:
                p.drawEllipse(pt, 3, 3)
            p.setBrush(Qt.BrushStyle.NoBrush)

    def _bars(self, p: QPainter, cell: QRectF, title: str, groups: list[str],
              values: list[list[float | None]], text: QColor, muted: QColor,
              unit: str) -> None:
        area = self._frame(p, cell, title, muted)
        flat = [v for vs in values for v in vs if v is not None]
        peak = max(flat + [1e-3]) * 1.2
        self._axis_label(p, area, peak, muted)
        if not groups:
            return
        fm = p.fontMetrics()
        slot = area.width() / len(groups)
        bar_w = min(slot * 0.8 / max(len(values), 1), 40.0)
        for g, name in enumerate(groups):
            x0 = area.left() + g * slot + (slot - bar_w * len(values)) / 2
            p.setPen(muted)
            p.drawText(QRectF(area.left() + g * slot, area.bottom() + 2, slot, fm.height()),
                       Qt.AlignmentFlag.AlignCenter, name)
            for i, vs in enumerate(values):
                v = vs[g] if g < len(vs) else None
                if v is None:
                    continue
                bh = area.height() * v / peak
                r = QRectF(x0 + i * bar_w, area.bottom() - bh, bar_w * 0.9, bh)
                p.fillRect(r, SERIES_COLOURS[i])
                if bar_w >= fm.horizontalAdvance("00.0"):
                    p.setPen(text)
                    p.drawText(QRectF(r.left() - 8, r.top() - fm.height(), r.width() + 16,
                                      fm.height()), Qt.AlignmentFlag.AlignCenter,
                               f"{v:.2f}" if v < 10 else f"{v:.0f}")

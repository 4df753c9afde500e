"""Painted charts: first-token latency per reply split into engine phases, tokens/s (the
share of each reply's tokens that came from accepted drafts shaded), and a bar of where the
system's memory is.

Contract: widgets that draw what they are given (`set_replies`, `set_parts`) with QPainter
in the palette's colours; nothing here reads the engine.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

from app.format import human_bytes

PHASE_COLOURS = {
    "load": QColor("#8e6bd1"),
    "cache lookup": QColor("#2fa3a8"),
    "prefill": QColor("#e08a2e"),
    "first decode": QColor("#4a86d8"),
    "other": QColor("#9a9a9a"),
}
TPS_COLOUR = QColor("#4fa84f")
DRAFT_COLOUR = QColor("#a5d89f")  # the tokens speculative decoding's drafts gave
PHASE_ORDER = ("load", "cache lookup", "prefill", "first decode")


def split_phases(stats: dict[str, Any]) -> list[tuple[str, float]]:
    """(phase, seconds) in display order; what the engine did not name becomes 'other'."""
    phases = dict(stats.get("phases") or {})
    parts = [(p, float(phases.pop(p))) for p in PHASE_ORDER if p in phases]
    rest = sum(float(v) for v in phases.values())
    if rest > 0:
        parts.append(("other", rest))
    if not parts and "ttft_s" in stats:
        parts.append(("other", float(stats["ttft_s"])))
    return parts


def draft_share(stats: dict[str, Any]) -> float:
    """The fraction of a reply's tokens that were accepted drafts (0 without drafting)."""
    n = int(stats.get("generated_tokens") or 0)
    return min(int(stats.get("accepted_tokens") or 0) / n, 1.0) if n > 0 else 0.0


def speed_title(replies: list[dict[str, Any]]) -> str:
    """The speed plot's title; with drafting, the accepted and drafted tokens of the
    replies shown: 'tokens per second while generating · drafts: 120/200 kept'."""
    title = "tokens per second while generating"
    drafted = sum(int(r.get("drafted_tokens") or 0) for r in replies)
    if drafted:
        accepted = sum(int(r.get("accepted_tokens") or 0) for r in replies)
        title += f" · drafts: {accepted}/{drafted} kept (light: tokens from drafts)"
    return title


class LatencyChart(QWidget):
    """Top: stacked bars of first-token latency per reply. Bottom: tokens/s per reply."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Latency chart")
        self.setMinimumHeight(220)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.replies: list[dict[str, Any]] = []

    def sizeHint(self) -> QSize:
        return QSize(600, 300)

    def set_replies(self, replies: list[dict[str, Any]]) -> None:
        self.replies = [r for r in replies if "ttft_s" in r][-40:]
        self.update()

    def paintEvent(self, _event: Any) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        pal = self.palette()
        text = pal.color(QPalette.ColorRole.WindowText)
        muted = pal.color(QPalette.ColorRole.PlaceholderText)
        fm = p.fontMetrics()
        rect = QRectF(self.rect()).adjusted(8, 4, -8, -4)
        if not self.replies:
            p.setPen(muted)
            p.drawText(rect, Qt.AlignmentFlag.AlignCenter,
                       "Send a message: each reply's time to first token and\n"
                       "tokens per second will be charted here.")
            return
        line = fm.height()
        legend_h = line + 6
        # legend
        x = rect.left()
        used = [ph for ph in (*PHASE_ORDER, "other")
                if any(ph == n for r in self.replies for n, _ in split_phases(r))]
        for name in used:
            p.fillRect(QRectF(x, rect.top() + 3, 10, 10), PHASE_COLOURS[name])
            p.setPen(text)
            p.drawText(QPointF(x + 14, rect.top() + line - 2), name)
            x += 14 + fm.horizontalAdvance(name) + 16
        p.fillRect(QRectF(x, rect.top() + 3, 10, 10), TPS_COLOUR)
        p.drawText(QPointF(x + 14, rect.top() + line - 2), "tokens/s")

        body = rect.adjusted(0, legend_h, 0, 0)
        axis_w = fm.horizontalAdvance("00.00 s") + 6
        # two plots, each with a title line above and a value line inside its headroom
        half = (body.height() - 3 * line) / 2
        top = QRectF(body.left() + axis_w, body.top() + line * 1.5, body.width() - axis_w,
                     half)
        bottom = QRectF(top.left(), top.bottom() + line * 2.5, top.width(), half - line)
        n = len(self.replies)
        slot = min(top.width() / max(n, 1), 56.0)  # bars fill from the left
        bar_w = max(slot * 0.6, 2.0)
        show_values = slot >= fm.horizontalAdvance("0.00") + 6

        # first-token latency, stacked by phase
        totals = [sum(s for _, s in split_phases(r)) for r in self.replies]
        peak = max(max(totals), 1e-3) * 1.2  # headroom for the value labels
        p.setPen(muted)
        p.drawText(QRectF(top.left() + 4, top.top() - line - 2, top.width(), line),
                   Qt.AlignmentFlag.AlignLeft, "time to first token (s), per reply")
        self._axis(p, top, peak, "s", axis_w, muted)
        for i, reply in enumerate(self.replies):
            x0 = top.left() + i * slot + (slot - bar_w) / 2
            y = top.bottom()
            for name, secs in split_phases(reply):
                h = top.height() * secs / peak
                p.fillRect(QRectF(x0, y - h, bar_w, h), PHASE_COLOURS[name])
                y -= h
            if show_values:
                p.setPen(text)
                p.drawText(QRectF(x0 - 10, y - line - 1, bar_w + 20, line),
                           Qt.AlignmentFlag.AlignCenter, f"{totals[i]:.2f}")

        # tokens per second
        tps = [float(r.get("decode_tps") or 0.0) for r in self.replies]
        peak_tps = max(max(tps), 1e-3) * 1.2
        p.setPen(muted)
        p.drawText(QRectF(bottom.left() + 4, bottom.top() - line - 2, bottom.width(), line),
                   Qt.AlignmentFlag.AlignLeft, speed_title(self.replies))
        self._axis(p, bottom, peak_tps, "", axis_w, muted)
        for i, v in enumerate(tps):
            x0 = top.left() + i * slot + (slot - bar_w) / 2
            h = bottom.height() * v / peak_tps
            p.fillRect(QRectF(x0, bottom.bottom() - h, bar_w, h), TPS_COLOUR)
            share = draft_share(self.replies[i])
            if share > 0:  # the top of the bar: the tokens accepted drafts gave
                p.fillRect(QRectF(x0, bottom.bottom() - h, bar_w, h * share), DRAFT_COLOUR)
            if show_values:
                p.setPen(text)
                p.drawText(QRectF(x0 - 10, bottom.bottom() - h - line - 1, bar_w + 20, line),
                           Qt.AlignmentFlag.AlignCenter, f"{v:.1f}")

    @staticmethod
    def _axis(p: QPainter, area: QRectF, peak: float, unit: str, axis_w: float,
              colour: QColor) -> None:
        pen = QPen(colour)
        pen.setWidthF(0.5)
        p.setPen(pen)
        p.drawLine(area.bottomLeft(), area.bottomRight())
        p.drawLine(area.topLeft(), area.topRight())
        label = f"{peak:.2f}{(' ' + unit) if unit else ''}" if peak < 10 else f"{peak:.0f}"
        p.drawText(QRectF(area.left() - axis_w, area.top() - 8, axis_w - 4, 16),
                   int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter), label)
        p.drawText(QRectF(area.left() - axis_w, area.bottom() - 8, axis_w - 4, 16),
                   int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter), "0")


class MemoryBar(QWidget):
    """One horizontal bar of the system's memory: named parts, then the rest used, then free."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Memory bar")
        self.setMinimumHeight(46)
        self.total = 0
        self.parts: list[tuple[str, int, QColor]] = []

    def set_parts(self, total: int, parts: list[tuple[str, int, QColor]]) -> None:
        self.total, self.parts = total, parts
        self.update()

    def paintEvent(self, _event: Any) -> None:
        if self.total <= 0:
            return
        p = QPainter(self)
        pal = self.palette()
        fm = p.fontMetrics()
        bar = QRectF(0, 0, self.width() - 1, 18)
        p.fillRect(bar, pal.color(QPalette.ColorRole.Base))
        x = 0.0
        legend_x = 0.0
        for name, size, colour in self.parts:
            w = bar.width() * max(size, 0) / self.total
            p.fillRect(QRectF(x, 0, w, 18), colour)
            x += w
            p.fillRect(QRectF(legend_x, 26, 10, 10), colour)
            label = f"{name} {human_bytes(size)}"
            p.setPen(pal.color(QPalette.ColorRole.WindowText))
            p.drawText(QPointF(legend_x + 14, 26 + fm.ascent() - 1), label)
            legend_x += 14 + fm.horizontalAdvance(label) + 16
        p.setPen(pal.color(QPalette.ColorRole.Mid))
        p.drawRect(bar)

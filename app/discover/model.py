"""Discover's table models: search results (engine.importers.hub.HubModel) and variants.

Contract: read-only Qt table models. `ResultsModel.set_models(models)` replaces the rows;
`VariantsModel.set_variants(variants, fits)` the variants of one repository with each one's
fit (engine.runtime.fit.Fit or None) for the "On this Mac" column: "fits at N tokens" (the
largest context that fits, up to the model's trained one), or "too large for this Mac".
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt

from app.format import UNAVAILABLE, human_bytes
from engine.importers.hub import HubModel, Variant
from engine.runtime.fit import Fit

Index = QModelIndex | QPersistentModelIndex
RESULT_COLUMNS = ("Repository", "Architecture", "Parameters", "Formats", "Downloads")
VARIANT_COLUMNS = ("Variant", "Size on disk", "Bits/weight", "On this Mac")
RIGHT = int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)


def human_params(n: int) -> str:
    if n <= 0:
        return UNAVAILABLE
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}" if n < 10 * div else f"{n / div:.0f}{unit}"
    return str(n)


def fit_verdict(fit: Fit | None) -> str:
    """'fits at 8,192 tokens', 'fits at 2,048 tokens (of 32,768)' or 'too large for this Mac'."""
    if fit is None:
        return UNAVAILABLE
    most = fit.max_context
    if most <= 0:
        return "too large for this Mac"
    if most >= fit.trained_context:
        return f"fits at {most:,} tokens"
    return f"fits at {most:,} tokens (of {fit.trained_context:,})"


class _Table(QAbstractTableModel):
    columns: tuple[str, ...] = ()

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._rows: list[Any] = []

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.columns)

    def headerData(self, section: int, orientation: Qt.Orientation,
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if (orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole
                and 0 <= section < len(self.columns)):
            return self.columns[section]
        return None

    def row(self, index: int) -> Any:
        return self._rows[index] if 0 <= index < len(self._rows) else None


class ResultsModel(_Table):
    columns = RESULT_COLUMNS

    def set_models(self, models: list[HubModel]) -> None:
        self.beginResetModel()
        self._rows = list(models)
        self.endResetModel()

    def repo_ids(self) -> list[str]:
        return [m.repo_id for m in self._rows]

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        m: HubModel | None = self.row(index.row()) if index.isValid() else None
        if m is None:
            return None
        col = index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            return (m.repo_id, m.architecture or UNAVAILABLE, human_params(m.params),
                    " + ".join(f.upper() for f in m.formats), f"{m.downloads:,}")[col]
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (2, 4):
            return RIGHT
        if role == Qt.ItemDataRole.ToolTipRole and col == 0:
            return f"{m.repo_id}\n{m.likes:,} likes"
        return None


class VariantsModel(_Table):
    columns = VARIANT_COLUMNS

    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._fits: list[Fit | None] = []

    def set_variants(self, variants: list[Variant], fits: list[Fit | None]) -> None:
        self.beginResetModel()
        self._rows = list(variants)
        self._fits = list(fits)
        self.endResetModel()

    def set_fits(self, fits: list[Fit | None]) -> None:
        self._fits = list(fits)
        if self._rows:
            self.dataChanged.emit(self.index(0, 3), self.index(len(self._rows) - 1, 3))

    def variants(self) -> list[Variant]:
        return list(self._rows)

    def fit(self, row: int) -> Fit | None:
        return self._fits[row] if 0 <= row < len(self._fits) else None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        v: Variant | None = self.row(index.row()) if index.isValid() else None
        if v is None:
            return None
        col = index.column()
        fit = self.fit(index.row())
        if role == Qt.ItemDataRole.DisplayRole:
            if col == 0:
                parts = f" ({len(v.files)} parts)" if v.kind == "gguf" and len(v.files) > 1 else ""
                return f"{v.label}{parts}"
            if col == 1:
                return human_bytes(v.bytes)
            if col == 2:
                bpw = v.bits_per_weight
                return UNAVAILABLE if bpw is None else f"{bpw:.2f}"
            return fit_verdict(fit)
        if role == Qt.ItemDataRole.TextAlignmentRole and col in (1, 2):
            return RIGHT
        if role == Qt.ItemDataRole.ToolTipRole:
            if col == 3 and fit is not None:
                how = "" if v.exact else ("\n(estimated from another file's header, scaled by "
                                          "size)")
                return fit.summary() + how
            if col == 0:
                return "\n".join(f.path for f in v.files)
        return None

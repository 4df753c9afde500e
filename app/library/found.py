"""Found on this Mac: the models other apps keep (engine.library.found) as a table, and the
thread that links an MLX folder into the library.

Contract: `FoundModel.set_found(found, manifests)` lists each `Found` with how it would join
the library ("links its files: no second copy" for an MLX folder; "converts it: a second
copy" for a GGUF or a float folder, which the library cannot run as they are) or, once added,
the library model it became. `FoundLinker` runs engine.library.found.install_linked off the GUI
thread (it hashes the weights for the fingerprint: seconds for gigabytes; no MLX), answering
`linked(job, manifest)` or `failed(job, message)`.
"""

from __future__ import annotations

import logging
import threading
import traceback
from pathlib import Path
from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QObject, Qt, Signal

from app.format import human_bytes
from engine.errors import StrataError
from engine.library import Library
from engine.library.found import Found, added, install_linked

log = logging.getLogger(__name__)
FOUND_COLUMNS = ("Model", "Found in", "Kind", "Size", "Adds as")
KIND_TEXT = {"gguf": "GGUF file", "mlx": "MLX folder", "hf": "Hugging Face folder"}
Index = QModelIndex | Any


def adds_as(f: Found) -> str:
    if f.kind == "mlx":
        return "links its files: no second copy"
    if f.kind == "gguf":
        return "converts it to MLX: a second copy"
    return "quantizes it: a second copy"


class FoundModel(QAbstractTableModel):
    def __init__(self, parent: Any = None) -> None:
        super().__init__(parent)
        self._rows: list[Found] = []
        self._added: list[str | None] = []

    def set_found(self, found: list[Found], manifests: list[dict[str, Any]]) -> None:
        self.beginResetModel()
        self._rows = list(found)
        self._added = [added(f, manifests) for f in found]
        self.endResetModel()

    def found(self, row: int) -> Found | None:
        return self._rows[row] if 0 <= row < len(self._rows) else None

    def added_as(self, row: int) -> str | None:
        return self._added[row] if 0 <= row < len(self._added) else None

    def labels(self) -> list[str]:
        return [f.label for f in self._rows]

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._rows)

    def columnCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(FOUND_COLUMNS)

    def headerData(self, section: int, orientation: Qt.Orientation,
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if (orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole
                and 0 <= section < len(FOUND_COLUMNS)):
            return FOUND_COLUMNS[section]
        return None

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        f = self.found(index.row()) if index.isValid() else None
        if f is None:
            return None
        col = index.column()
        if role == Qt.ItemDataRole.DisplayRole:
            if col == 4:
                name = self.added_as(index.row())
                return f"in the library as {name}" if name else adds_as(f)
            return (f.label, f.app, KIND_TEXT.get(f.kind, f.kind), human_bytes(f.bytes))[col]
        if role == Qt.ItemDataRole.ToolTipRole:
            return str(f.path)
        if role == Qt.ItemDataRole.TextAlignmentRole and col == 3:
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None


class FoundLinker(QObject):
    """install_linked on a short-lived thread per model; `link(job, found, name)` starts one
    and `linked(job, manifest)` or `failed(job, message)` answers on the GUI thread (queued:
    this object lives there). A link cut short by the app quitting leaves only a temporary
    folder, which the library sweeps at its next start."""

    linked = Signal(int, dict)
    failed = Signal(int, str)

    def __init__(self, home: Path, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.home = home

    def link(self, job: int, found: Found, name: str) -> None:
        threading.Thread(target=self._run, args=(job, found, name), daemon=True,
                         name="strata-found").start()

    def _run(self, job: int, found: Found, name: str) -> None:
        try:
            manifest = install_linked(Library(self.home), found.path, name,
                                      source=str(found.path.resolve()), found_in=found.app)
            self.linked.emit(job, manifest)
        except StrataError as exc:
            self.failed.emit(job, str(exc))
        except OSError as exc:
            self.failed.emit(job, f"{found.path}: {exc.strerror or exc}")
        except Exception as exc:  # a bug: say so rather than leave the row waiting
            log.error("linking %s failed:\n%s", found.path, traceback.format_exc())
            self.failed.emit(job, f"internal error: {exc!r}")

"""The Macs a model can run across: found by mDNS or typed, each with its memory and MLX.

Contract: `ClusterView(model, library)` lists Macs waiting to join (`strata join` on them):
"Find on network" (`find_macs`) browses mDNS (engine.runtime.cluster_find.browse), "Add"
asks one typed "host:port" (probe); each row shows the Mac, its address, memory (available
of total), its MLX and Strata versions and a check box for "run across". The preflight line
under the list says whether the model fits this Mac alone and, if not, whether it fits
across the checked Macs, with each Mac's numbers (cluster_find.preflight); "Run across N
Macs" is enabled only when it does, and emits `run_across_requested(model, addresses)`.
Network waits run on a thread and arrive as `peers_changed` (the list was updated) or
`failed(line)` (one line, shown in the status label). Every control has an accessible name;
colours come from the palette.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import (
    QDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.errors import StrataError
from engine.library import Library

COLUMNS = ("Run", "Mac", "Address", "Memory", "MLX", "Strata")


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


class ClusterView(QWidget):
    """The Macs list, the find and add controls, the preflight line and the run button."""

    peers_changed = Signal()
    failed = Signal(str)
    run_across_requested = Signal(str, list)  # model, waiter addresses
    _found = Signal(object, str)  # peers found on the worker thread, or an error line

    def __init__(self, model: str, library: Library | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.library = library
        self.peers: dict[str, Any] = {}  # address -> engine.runtime.cluster_find.Peer
        self.setAccessibleName("Macs to run across")
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setAccessibleName("Macs")
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.table.verticalHeader().setVisible(False)
        self.find_button = QPushButton("&Find on network")
        self.find_button.setAccessibleName("Find Macs on the local network")
        self.address = QLineEdit()
        self.address.setAccessibleName("Mac address")
        self.address.setPlaceholderText("host:port of a Mac running strata join")
        self.add_button = QPushButton("&Add")
        self.add_button.setAccessibleName("Add the Mac at this address")
        self.fit_label = QLabel()
        self.fit_label.setAccessibleName("Preflight")
        self.fit_label.setWordWrap(True)
        self.status = QLabel("Run `strata join` on each other Mac, then find or add it.")
        self.status.setAccessibleName("Macs status")
        self.status.setWordWrap(True)
        self.run_button = QPushButton("&Run across 1 Mac")
        self.run_button.setAccessibleName("Run across the checked Macs")
        self.run_button.setEnabled(False)
        row = QHBoxLayout()
        row.addWidget(self.find_button)
        row.addWidget(self.address, 1)
        row.addWidget(self.add_button)
        layout = QVBoxLayout(self)
        layout.addLayout(row)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.fit_label)
        layout.addWidget(self.status)
        layout.addWidget(self.run_button, 0, Qt.AlignmentFlag.AlignRight)
        self.find_button.clicked.connect(self._on_find_clicked)
        self.add_button.clicked.connect(self._on_add_clicked)
        self.address.returnPressed.connect(self._on_add_clicked)
        self.run_button.clicked.connect(self._on_run_clicked)
        self.table.itemChanged.connect(self._on_item_changed)
        self._found.connect(self._on_found)
        self._busy = 0

    # -- public ---------------------------------------------------------------------------
    def find_macs(self, seconds: float = 2.0) -> None:
        """Browse mDNS for `seconds` on a thread; `peers_changed` or `failed` follows."""
        from engine.runtime.cluster_find import browse  # start-up: MLX loads when asked

        self.status.setText("Looking for Macs on the local network…")
        self._spawn(lambda: browse(seconds))

    def add(self, address: str) -> None:
        """Ask the Mac typed at `address` ("host:port"); `peers_changed` or `failed`."""
        from engine.runtime.cluster_find import probe  # start-up: as above

        address = address.strip()
        self.status.setText(f"Asking {address}…")
        self._spawn(lambda: [probe(address)])

    def chosen(self) -> list[str]:
        """The addresses of the checked Macs, in list order."""
        out = []
        for r in range(self.table.rowCount()):
            item = self.table.item(r, 0)
            if item is not None and item.checkState() == Qt.CheckState.Checked:
                out.append(str(item.data(Qt.ItemDataRole.UserRole)))
        return out

    # -- work off the GUI thread ------------------------------------------------------------
    def _spawn(self, work: Callable[[], list[Any]]) -> None:
        self._busy += 1

        def run() -> None:
            try:
                self._found.emit(work(), "")
            except StrataError as exc:
                self._found.emit([], str(exc))

        threading.Thread(target=run, daemon=True).start()

    @Slot(object, str)
    def _on_found(self, peers: list[Any], error: str) -> None:
        self._busy -= 1
        if error:
            self.status.setText(error)
            self.failed.emit(error)
            return
        for p in peers:
            self.peers[p.address] = p
        self.status.setText(f"{len(self.peers)} Mac{'s' if len(self.peers) != 1 else ''} "
                            "ready to join." if self.peers else "No Macs found.")
        self._fill()
        self.peers_changed.emit()

    # -- the table and the preflight ----------------------------------------------------------
    def _fill(self) -> None:
        checked = set(self.chosen())
        self.table.blockSignals(True)
        self.table.setRowCount(len(self.peers))
        for r, p in enumerate(self.peers.values()):
            run = QTableWidgetItem()
            run.setFlags(Qt.ItemFlag.ItemIsUserCheckable | Qt.ItemFlag.ItemIsEnabled)
            on = p.address in checked or not p.busy
            run.setCheckState(Qt.CheckState.Checked if on else Qt.CheckState.Unchecked)
            run.setData(Qt.ItemDataRole.UserRole, p.address)
            self.table.setItem(r, 0, run)
            cells = (p.host, p.address, f"{_gb(p.available_bytes)} free of {_gb(p.total_bytes)}",
                     p.mlx, p.strata + (" (busy)" if p.busy else ""))
            for c, text in enumerate(cells, start=1):
                item = QTableWidgetItem(text)
                item.setFlags(Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable)
                self.table.setItem(r, c, item)
        self.table.blockSignals(False)
        self._preflight()

    @Slot(QTableWidgetItem)
    def _on_item_changed(self, item: QTableWidgetItem) -> None:
        if item.column() == 0:
            self._preflight()

    def _preflight(self) -> None:
        from engine.runtime.cluster_find import preflight  # start-up: as above

        chosen = [self.peers[a] for a in self.chosen()]
        n = len(chosen) + 1
        self.run_button.setText(f"&Run across {n} Mac{'s' if n > 1 else ''}")
        try:
            one, across = preflight(self.model, chosen, self.library)
        except StrataError as exc:
            self.fit_label.setText(str(exc))
            self.run_button.setEnabled(False)
            return
        alone = ("fits this Mac alone" if one.fits
                 else f"does not fit this Mac alone ({one.numbers()})")
        text = f"{self.model} {alone}"
        if across is not None:
            text += f"; {across.summary()}"
        self.fit_label.setText(text)
        self.run_button.setEnabled(across is not None and across.fits)

    @Slot()
    def _on_find_clicked(self) -> None:
        self.find_macs()

    @Slot()
    def _on_add_clicked(self) -> None:
        if self.address.text().strip():
            self.add(self.address.text())

    @Slot()
    def _on_run_clicked(self) -> None:
        self.run_across_requested.emit(self.model, self.chosen())


class ClusterDialog(QDialog):
    """The Engine menu's "Run across several Macs…": a ClusterView in a dialog."""

    def __init__(self, model: str, library: Library | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Run across several Macs")
        self.setAccessibleName("Run across several Macs")
        self.view = ClusterView(model, library, self)
        layout = QVBoxLayout(self)
        layout.addWidget(self.view)
        self.resize(720, 420)

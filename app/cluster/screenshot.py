"""`python -m app.cluster.screenshot OUT.png`: the "Run across several Macs" dialog, rendered.

Contract: starts two real waiting `strata join` processes on this machine (loopback, not
advertised), types their addresses into the real dialog for the library's `starter`, waits
for both rows and the preflight line, and saves the dialog (offscreen) to OUT. This Mac's
memory is capped (STRATA_MAX_MEMORY_MB, default 400 here) so the starter does not fit it
alone, as a model too large for one Mac would not. The waiters stop before it exits.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("STRATA_MAX_MEMORY_MB", "400")
os.environ.setdefault("STRATA_CONTEXT", "2048")

from PySide6.QtCore import QEventLoop, QTimer  # noqa: E402 - after the platform is chosen
from PySide6.QtWidgets import QApplication  # noqa: E402

from app.cluster.view import ClusterDialog  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(address: str, seconds: float = 30.0) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def main(out: Path) -> int:
    waiters = []
    addresses = []
    try:
        for _ in range(2):
            port = _port()
            waiters.append(subprocess.Popen(
                [sys.executable, "-m", "app", "join", "--listen", str(port), "--no-advertise"],
                stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            addresses.append(f"127.0.0.1:{port}")
        for a in addresses:
            _wait(a)
        app = QApplication.instance() or QApplication(sys.argv[:1])
        dialog = ClusterDialog("starter")
        dialog.show()
        for a in addresses:
            loop = QEventLoop()
            dialog.view.peers_changed.connect(loop.quit)
            dialog.view.failed.connect(loop.quit)
            QTimer.singleShot(30_000, loop.quit)
            dialog.view.add(a)
            loop.exec()
        if dialog.view.table.rowCount() != len(addresses):
            print(f"error: {dialog.view.status.text()}", file=sys.stderr)
            return 1
        app.processEvents()
        dialog.view.address.setText("mac-studio.local:5170")
        app.processEvents()
        out.parent.mkdir(parents=True, exist_ok=True)
        if not dialog.grab().save(str(out)):
            print(f"error: cannot write {out}", file=sys.stderr)
            return 1
        print(out)
        return 0
    finally:
        for w in waiters:
            w.terminate()
            w.wait(10)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "cluster.png")))

"""Child process for the crash test: open the window, start a long reply, report, keep going.

Run as `python -m tests.app.crash_child DB` with STRATA_HOME set. Prints `STREAMING <id>`
once the reply's row holds some text, then waits to be killed.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QTimer  # noqa: E402

import app.compat  # noqa: E402,F401
from app.chat.store import Sampling  # noqa: E402
from app.main import MainWindow, StrataApplication  # noqa: E402


def main() -> int:
    qapp = StrataApplication(sys.argv[:1])
    window = MainWindow(db_path=sys.argv[1])
    window.show()
    reported = [False]

    def on_ready() -> None:
        chat = window.chat.new_chat()
        window.store.update_chat(chat.id, sampling=Sampling(temperature=0.7, max_tokens=2000))
        window.chat.select(chat.id)
        window.chat.send("Write a very long story about a lighthouse keeper and the sea.")

    def poll() -> None:
        s = window.chat.streaming
        if reported[0] or s is None:
            return
        row = window.store.message(s.message_id)
        if row is not None and row.status == "streaming" and len(row.content) > 20:
            reported[0] = True
            print(f"STREAMING {row.id}", flush=True)

    window.ready.connect(on_ready)
    timer = QTimer()
    timer.timeout.connect(poll)
    timer.start(20)
    return qapp.exec()


if __name__ == "__main__":
    sys.exit(main())

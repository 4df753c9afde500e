"""App fixtures: the QApplication subclass, and main windows over a real library and database.

Windows are offscreen (QT_QPA_PLATFORM=offscreen is set here unless the caller chose).
Each window owns an engine thread; the factory shuts every one down at teardown.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import app.compat  # noqa: E402,F401  (before pytest-qt's first Qt call; see app/compat.py)
from app.main import MainWindow, StrataApplication  # noqa: E402

WindowFactory = Callable[..., MainWindow]
LOAD_TIMEOUT_MS = 120_000
REPLY_TIMEOUT_MS = 120_000


@pytest.fixture(scope="session")
def qapp_cls() -> type[StrataApplication]:
    return StrataApplication


def _open(windows: list[MainWindow], home: Path, db: Path | str, **kwargs: Any) -> MainWindow:
    window = MainWindow(home, db_path=db, **kwargs)
    window.show()
    windows.append(window)
    return window


@pytest.fixture
def make_window(qapp: Any, starter: dict[str, Any], strata_home: Path,
                tmp_path: Path) -> Iterator[WindowFactory]:
    """Open windows over the session library (starter inside) and a per-test database."""
    windows: list[MainWindow] = []

    def factory(home: Path | None = None, db: Path | str | None = None,
                **kwargs: Any) -> MainWindow:
        return _open(windows, home or strata_home, db or tmp_path / "chats.sqlite3", **kwargs)

    yield factory
    for window in windows:
        window.close()
        window.shutdown()


@pytest.fixture(scope="module")
def module_windows(qapp: Any) -> Iterator[list[MainWindow]]:
    """Windows that live for a whole test module (one model load shared by its tests)."""
    windows: list[MainWindow] = []
    yield windows
    for window in windows:
        window.close()
        window.shutdown()


@pytest.fixture(scope="module")
def loaded_window(module_windows: list[MainWindow], starter: dict[str, Any],
                  strata_home: Path, tmp_path_factory: pytest.TempPathFactory) -> MainWindow:
    """A window with the starter model loaded, over a fresh database, shared by a module."""
    from PySide6.QtCore import QEventLoop, QTimer

    db = tmp_path_factory.mktemp("chats") / "chats.sqlite3"
    window = _open(module_windows, strata_home, db)
    if not window.is_ready:
        loop = QEventLoop()
        window.ready.connect(loop.quit)
        QTimer.singleShot(LOAD_TIMEOUT_MS, loop.quit)
        loop.exec()
    assert window.is_ready, "the window did not finish starting"
    assert window.memory.model_name, "the starter model did not load"
    return window

"""Qt's half of `strata --smoke`, and where the app finds its icon in a checkout or a bundle.

Contract: `qt_probe()` makes (or reuses) the QApplication, renders a widget and the app icon
offscreen-capable, and returns the Qt facts for the smoke report; it raises RuntimeError with
one line when a piece a packaged app needs (platform plugin, PNG support, icon) is missing.
`resource_path(name)` is resources/NAME in a checkout and inside a PyInstaller bundle.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import app.compat  # noqa: F401  (PySide6 work-around, see there)


def resource_path(name: str) -> Path:
    """resources/NAME: next to the frozen app's modules, else at the checkout's root."""
    bundle = getattr(sys, "_MEIPASS", None)
    root = Path(bundle) if bundle else Path(__file__).resolve().parents[1]
    return root / "resources" / name


def app_icon() -> Any:
    """Strata's icon as a QIcon (null if resources/strata.png is missing)."""
    from PySide6.QtGui import QIcon

    return QIcon(str(resource_path("strata.png")))


def qt_probe() -> dict[str, Any]:
    """Start Qt as the window would and report versions and the platform plugin."""
    if (sys.platform.startswith("linux") and not os.environ.get("QT_QPA_PLATFORM")
            and not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY")):
        os.environ["QT_QPA_PLATFORM"] = "offscreen"  # a headless Linux box has no screen
    import PySide6
    from PySide6.QtCore import qVersion
    from PySide6.QtGui import QImageWriter
    from PySide6.QtWidgets import QApplication, QLabel

    existing = QApplication.instance()
    qapp = existing if isinstance(existing, QApplication) else QApplication(sys.argv[:1])
    label = QLabel("Strata")
    label.adjustSize()
    if label.grab().isNull():
        raise RuntimeError("Qt cannot render a widget")
    if b"png" not in [bytes(f.data()) for f in QImageWriter.supportedImageFormats()]:
        raise RuntimeError("Qt's PNG support is missing")
    icon = app_icon()
    if icon.isNull():
        raise RuntimeError(f"the app icon is missing ({resource_path('strata.png')})")
    label.deleteLater()
    return {"pyside6": PySide6.__version__, "qt": qVersion(), "qt_platform": qapp.platformName()}

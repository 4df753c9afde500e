"""The model library screen: table model, widgets, import dialog and controller."""

import app.compat  # noqa: F401  (PySide6 work-around before any Qt call, see there)

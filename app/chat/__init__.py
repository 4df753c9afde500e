"""The chat screen: SQLite store, item model, controller and widgets."""

import app.compat  # noqa: F401  (PySide6 work-around before any Qt call, see there)

"""The chat screen: SQLite store, item model, controller and widgets.

Floor 5: imports Qt, the rest of the window and the engine's leaves; it reaches the engine's
runtime only through app.worker's `Engine` signals, never directly.
"""

import app.compat  # noqa: F401  (PySide6 work-around before any Qt call, see there)

"""The model library screen: table model, widgets, import dialog and controller.

Floor 5: imports Qt, the rest of the window and the engine's leaves; imports, removals and
loads go through app.worker's `Engine` (the engine thread), never straight to the engine.
"""

import app.compat  # noqa: F401  (PySide6 work-around before any Qt call, see there)

"""The memory panel: where memory goes, and the first-token latency chart."""

import app.compat  # noqa: F401  (PySide6 work-around before any Qt call, see there)

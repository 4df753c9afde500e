"""The memory panel: where memory goes, and the first-token latency chart.

Floor 5: draws the engine's MemorySnapshot (engine.platform) that app.worker samples from the
model pool; it computes no figure of its own.
"""

import app.compat  # noqa: F401  (PySide6 work-around before any Qt call, see there)

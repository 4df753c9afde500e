"""Strata's window: PySide6 widgets over the engine, reached through one worker thread.

Nothing here holds model logic; `app.worker` is the only module that calls the engine's
runtime, and it does so on its own thread.
"""

import app.compat  # noqa: F401  (PySide6 reference-count work-around, see there)

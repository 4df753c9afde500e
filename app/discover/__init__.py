"""The Discover screen: search the Hugging Face Hub, pick a variant, download and import it.

Floor 5: Qt and the engine. Network work (search, variants, downloads: engine.importers.hub)
runs on the screen's own thread, so a slow Hub never holds up a reply; imports go through
app.worker's `Engine` (the engine thread), like every other import.
"""

import app.compat  # noqa: F401  (PySide6 work-around before any Qt call, see there)

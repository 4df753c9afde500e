"""The benchmark tab: runs `strata bench` in a child process and compares results.

Floor 5: reads the bench's result schema through engine.bench.stats; the measuring itself
happens in the child (`python -m app bench ...`), never in the window's process.
"""

import app.compat  # noqa: F401  (PySide6 work-around before any Qt call, see there)

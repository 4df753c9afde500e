"""The benchmark tab: runs `strata bench` in a child process and compares results."""

import app.compat  # noqa: F401  (PySide6 work-around before any Qt call, see there)

"""Strata's window and the `strata` command (floors 5 and 6 of docs/architecture.md).

Floor 5, the window: PySide6 views, item models and controllers over the engine, reached only
through one worker thread (`app.worker`); no engine policy lives here. Floor 6, the command:
`app.cli` (and `python -m app`) is the composition root that may import any floor; it imports
PySide6 only when the window opens, so `strata generate` and `strata serve` start without Qt.
This package face imports nothing, so `import app.cli` stays Qt-free.
"""

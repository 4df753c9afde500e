"""Strata's engine: models in, tokens out, no Qt. Floors, from the ground up (imports run down):

0 errors, telemetry, platform (the leaves) · 1 kv, library · 2 runtime · 3 importers, quant,
server · 4 bench. A module imports its own package and the floors below it, never sideways,
never up, and nothing here names the window's package (tests/test_floors.py holds this;
docs/architecture.md draws it).

Importing `engine` loads the platform BLAS shim first (see engine.platform), so that any
`import mlx.core` that follows uses the fast BLAS on Linux CPU. Nothing here imports
PySide6 or transformers.
"""

from engine import platform as _platform

_platform.preload_blas()

__version__ = "0.1.0"

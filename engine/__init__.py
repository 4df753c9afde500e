"""Strata's engine: models in, tokens out, no Qt.

Importing `engine` loads the platform BLAS shim first (see engine.platform), so that any
`import mlx.core` that follows uses the fast BLAS on Linux CPU. Nothing here imports
PySide6 or transformers.
"""

from engine import platform as _platform

_platform.preload_blas()

__version__ = "0.1.0"

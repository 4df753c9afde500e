"""The model library: one folder per model under STRATA_HOME/models, each with a manifest.

engine.library.store holds the folder and its atomic installs; engine.library.manifest the
fields every import and quantization writes. Floor 1: imports only the leaves (engine.errors,
engine.telemetry, engine.platform); importers and quantization (floor 3) write into it.
"""

from engine.library.store import Library, Manifest

__all__ = ["Library", "Manifest"]

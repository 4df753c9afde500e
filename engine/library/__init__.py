"""The model library: one folder per model under STRATA_HOME/models, each with a manifest.

See engine.library.store for the contract; engine.importers.starter fetches the default model.
"""

from engine.library.store import Library, Manifest

__all__ = ["Library", "Manifest"]

"""Errors a user can cause. Each carries a one-line message that names the thing and the reason.

The CLI prints `str(error)` and exits non-zero; the app shows it. Anything else is a bug.
"""

from __future__ import annotations


class StrataError(Exception):
    """Base of every user-facing engine error."""


class ImportFailed(StrataError):
    """A file or folder could not be imported into the library."""


class ModelNotFound(StrataError):
    """A model name or alias is not in the library."""


class LoadFailed(StrataError):
    """A library model could not be loaded."""


class FetchFailed(StrataError):
    """A download (starter model, hub repository) failed."""


class Cancelled(StrataError):
    """Long work stopped because its cancel flag was set."""

    def __init__(self, what: str = "operation") -> None:
        super().__init__(f"{what} cancelled")

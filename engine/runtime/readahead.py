"""Read a model's weight files into the OS page cache in the background (vmtouch's step).

Contract: `read_ahead(paths)` returns at once; a daemon thread asks the OS to read the files
into its page cache (posix_fadvise WILLNEED where the OS has it, else plain reads into one
reused buffer), so that the load that follows finds them in memory instead of waiting on the
disk. It is only a hint: errors are ignored, nothing is kept in this process's memory, and
STRATA_READAHEAD=0 turns it off.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path

_CHUNK = 8 << 20


def enabled() -> bool:
    return os.environ.get("STRATA_READAHEAD", "1") not in ("0", "false", "no", "off")


def read_ahead(paths: Sequence[Path]) -> threading.Thread | None:
    """Start reading `paths` into the page cache in a daemon thread; None when turned off."""
    if not enabled() or not paths:
        return None
    t = threading.Thread(target=_warm, args=(list(paths),), name="strata-read-ahead",
                         daemon=True)
    t.start()
    return t


def _warm(paths: list[Path]) -> None:
    advise = getattr(os, "posix_fadvise", None)
    buf: bytearray | None = None
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                if advise is not None:
                    # The kernel queues the whole file at once and returns: deep I/O queues.
                    advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                    continue
                # No fadvise (macOS): read it through once; the unified buffer cache keeps it.
                buf = buf if buf is not None else bytearray(_CHUNK)
                view = memoryview(buf)
                while os.readv(fd, [view]) > 0:
                    pass
            finally:
                os.close(fd)

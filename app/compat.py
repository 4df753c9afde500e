"""Work-arounds for the Qt bindings, applied when this module is first imported.

Contract: importing this module calls `pin_singletons()`, which makes None, True and False
immortal on CPython < 3.12 when the installed PySide6 is found to drop references to them,
and does nothing otherwise. Every module of `app` that calls Qt imports it.

Why: PySide6 6.12's abi3 wheels return None from every void method (`setText`, `show`,
`processEvents`, ...) and the bool result of `Signal.emit` without taking a reference. That
is harmless on Python 3.12+, where these objects are immortal, but on 3.11 each call drops a
reference, and after a few thousand calls (a streamed reply) the interpreter aborts with
"none_dealloc" / "bool_dealloc". Python 3.12 gives these objects a huge fixed refcount; we do
the same, which is exactly the behaviour the bindings were built for.
"""

from __future__ import annotations

import ctypes
import platform
import sys

_PIN = 1 << 40  # far more references than a process can drop
_pinned = False


def _drops_references() -> bool:
    from PySide6.QtCore import QObject

    probe = QObject()
    before = sys.getrefcount(None)
    for _ in range(8):
        probe.setObjectName("probe")  # a void method: returns None
    return sys.getrefcount(None) < before


def pin_singletons() -> bool:
    """Pin None/True/False if this Python and PySide6 need it; whether they are pinned."""
    global _pinned
    if _pinned:
        return True
    if platform.python_implementation() != "CPython" or sys.version_info >= (3, 12):
        return False
    if not _drops_references():
        return False
    for obj in (None, True, False):
        ctypes.c_ssize_t.from_address(id(obj)).value += _PIN  # ob_refcnt is the first field
    _pinned = True
    return True


pin_singletons()  # at import: every module of `app` that touches Qt imports this one first

"""C sources of ours compiled once per machine into the user's cache, for Linux CPU.

Contract: `built(source, cache, flags)` returns the shared library compiled from `source`
(a .c file of this package) for this source text and machine, in `cache/native/` as
`lib<name>-<key>.so`, compiling it first with `cc` (or $CC) when it is not there. The file
is written under a temporary name and renamed, so processes starting at once each compile
and each rename is whole. Raises OSError (no compiler) or subprocess.SubprocessError (a
failed or timed-out compile, its stderr on the exception); callers fall back to what they
did without it. Nothing here loads the library or imports mlx.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

COMPILE_TIMEOUT_S = 60


def built(source: Path, cache: Path, flags: tuple[str, ...] = ("-O2",),
          name: str | None = None) -> Path:
    """The library for `source` and this machine (see the module docstring); `name` names it
    (`strata-<source's stem>` by default)."""
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join(flags).encode() + platform.machine().encode()
                         ).hexdigest()[:16]
    out = cache / "native" / f"lib{name or 'strata-' + source.stem}-{key}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", str(tmp), str(source)],
                       check=True, capture_output=True, timeout=COMPILE_TIMEOUT_S)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out

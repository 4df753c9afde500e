"""CRC-32 for page records, prefix runs and tails: zlib's polynomial and values, computed
by zlib-ng's SIMD code where it is installed.

Contract: `crc32(data, value=0)` equals `zlib.crc32(data, value)` for any bytes-like `data`.
zlib's own CRC-32 ran at ~3 GB/s on this project's Linux machines, zlib-ng's at ~13 GB/s, and
a step that reads its pages off the SSD tier spent three quarters of its read time in the
check (docs/benchmarks.md, the 128k question). The file formats do not change: either
implementation writes and checks the same records.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

crc32: Callable[..., int]
try:
    from zlib_ng.zlib_ng import crc32 as _fast
except ImportError:  # (a pure-zlib environment: same values, slower)
    crc32 = zlib.crc32
    FAST = False
else:
    crc32 = _fast
    FAST = True


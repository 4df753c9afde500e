"""engine.kv.crc: page records' CRC-32 is zlib's, value for value (the formats do not
change), and the fast implementation is the one in use where the dependency is installed."""

from __future__ import annotations

import zlib

import numpy as np

from engine.kv import crc


def test_crc32_is_zlibs_and_fast() -> None:
    rng = np.random.default_rng(5)
    data = rng.standard_normal(3 * 128 * 64 * 2).astype(np.float32).tobytes()  # keys, values
    whole = crc.crc32(data)
    assert whole == zlib.crc32(data)
    # Chained over a record's parts, as the page reader checks one in place.
    head, rest = data[:100], data[100:]
    assert crc.crc32(rest, crc.crc32(head)) == whole
    assert crc.crc32(b"") == 0 and crc.crc32(b"strata") == zlib.crc32(b"strata")
    assert crc.FAST  # zlib-ng is a dependency (pyproject): its SIMD CRC is what runs

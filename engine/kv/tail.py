"""The prompt's last, partial page on the SSD: its KV and the next-token logits, so a stored
prompt restores whole.

Contract: full pages are shared by content (engine.kv.prefix); what follows the last full
page, 1 to page_tokens tokens, is kept as one tail record per parent page: `<name>.kvt` in
the prefix folder, named by (model key, parent chain hash), the latest prompt's tail
replacing the one before. A record holds the tail's token ids, every full-attention layer's
keys and values for them as computed (compute dtype; bfloat16 as raw 16-bit words, never
quantized: the paged cache keeps its partial page that way too), and the logits after the
last of them (float32), in sparse mode the question's votes per layer (float32, kv heads x
blocks, and the token they were taken at), with a header (layout, depth, parent hash) under
a CRC-32 and an xxh3-64 digest over everything after it. A later prompt with the same full
pages uses the longest common prefix of its own tail and the stored one; when the whole
prompt matches it also gets the logits and the votes, so its first token needs no forward
pass at all. A record that does not verify, or of an older version, is removed and never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from engine.kv.crc import crc32

TAIL_MAGIC = b"STRATATL"
TAIL_VERSION = 2
# magic, version, page tokens, depth (full pages before), tokens, vocab (0: no logits),
# layers, kv heads, head dim, dtype code, parent chain hash, vote blocks (0: none), the token
# the votes were taken at, xxh3-64 of the payload; CRC-32.
_TL = struct.Struct("<8sHIIIIIIII32sIIQ")
_CRC = struct.Struct("<I")
SUFFIX = ".kvt"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass
class Tail:
    """A tail as stored: tokens (t,) uint32; per layer k, v (kv_heads, t, head_dim) numpy
    arrays in the compute dtype (uint16 words for bfloat16); logits (vocab,) float32 after
    the last token, or None; votes, per layer (kv_heads, blocks) float32, the sparse
    question's votes as the prefill recorded them at token `votes_at` (engine.kv.attention),
    or None."""

    depth: int
    tokens: np.ndarray
    k: list[np.ndarray]
    v: list[np.ndarray]
    logits: np.ndarray | None
    votes: list[np.ndarray] | None = None
    votes_at: int = 0


@dataclass(frozen=True)
class TailLayout:
    """What a tail record of one model looks like: must match to be read."""

    page_tokens: int
    n_layers: int
    kv_heads: int
    head_dim: int
    dtype_code: int
    np_dtype: np.dtype


def tail_name(key: bytes, parent: bytes) -> str:
    """The file name of the tail after the page with chain hash `parent` (zeros: none)."""
    return hashlib.sha256(b"tail" + key + parent).hexdigest() + SUFFIX


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two id arrays share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def write_tail(folder: Path, name: str, tail: Tail, parent: bytes, layout: TailLayout) -> int:
    """Write a tail record (temp file, then rename over the old one); returns its bytes."""
    segs: list[bytes | memoryview] = [np.ascontiguousarray(tail.tokens, "<u4").data.cast("B")]
    for k, v in zip(tail.k, tail.v, strict=True):
        segs.append(np.ascontiguousarray(k).data.cast("B"))
        segs.append(np.ascontiguousarray(v).data.cast("B"))
    vocab = 0
    if tail.logits is not None:
        segs.append(np.ascontiguousarray(tail.logits, np.float32).data.cast("B"))
        vocab = len(tail.logits)
    blocks = 0
    if tail.votes is not None:
        blocks = tail.votes[0].shape[1]
        segs.extend(np.ascontiguousarray(v, "<f4").data.cast("B") for v in tail.votes)
    x = xxhash.xxh3_64()
    for s in segs:
        x.update(s)
    body = _TL.pack(TAIL_MAGIC, TAIL_VERSION, layout.page_tokens, tail.depth, len(tail.tokens),
                    vocab, layout.n_layers, layout.kv_heads, layout.head_dim,
                    layout.dtype_code, parent, blocks, tail.votes_at, x.intdigest())
    tmp = folder / f".tmp-{os.getpid()}-{name[:16]}t"
    try:
        with open(tmp, "wb") as f:
            f.write(body + _CRC.pack(crc32(body)))
            for s in segs:
                f.write(s)
        os.replace(tmp, folder / name)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()  # a full disk leaves nothing half-written behind
        raise
    return _TL.size + _CRC.size + sum(len(s) for s in segs)


def read_tail(path: Path, parent: bytes, depth: int, layout: TailLayout) -> Tail | None:
    """The tail record at `path` if it is one of this layout after `parent` at `depth` and
    every byte verifies; None otherwise (a record that fails is removed)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    tail = _parse(data, parent, depth, layout)
    if tail is None:
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    with contextlib.suppress(OSError):
        t = time.time_ns()
        os.utime(path, ns=(t, t))
    return tail


def _parse(data: bytes, parent: bytes, depth: int, layout: TailLayout) -> Tail | None:
    head = _TL.size + _CRC.size
    if len(data) < head:
        return None
    body = data[:_TL.size]
    if crc32(body) != _CRC.unpack_from(data, _TL.size)[0]:
        return None
    (magic, version, ptok, d, t, vocab, layers, heads, hd, code, par, blocks, votes_at,
     digest) = _TL.unpack(body)
    if ((magic, version, ptok, d, layers, heads, hd, code, par)
            != (TAIL_MAGIC, TAIL_VERSION, layout.page_tokens, depth, layout.n_layers,
                layout.kv_heads, layout.head_dim, layout.dtype_code, parent)
            or not 0 < t <= ptok):
        return None
    item = layout.np_dtype.itemsize
    per = heads * t * hd * item
    if len(data) != head + 4 * t + 2 * layers * per + 4 * vocab + 4 * layers * heads * blocks:
        return None
    payload = memoryview(data)[head:]
    if xxhash.xxh3_64_intdigest(payload) != digest:
        return None
    tokens = np.frombuffer(payload, "<u4", count=t)
    pos = 4 * t
    ks: list[np.ndarray] = []
    vs: list[np.ndarray] = []
    for _ in range(layers):
        for out in (ks, vs):
            out.append(np.frombuffer(payload, layout.np_dtype, count=heads * t * hd,
                                     offset=pos).reshape(heads, t, hd))
            pos += per
    logits = (np.frombuffer(payload, np.float32, count=vocab, offset=pos) if vocab else None)
    pos += 4 * vocab
    votes = None
    if blocks:
        votes = [np.frombuffer(payload, "<f4", count=heads * blocks,
                               offset=pos + 4 * heads * blocks * i).reshape(heads, blocks)
                 for i in range(layers)]
    return Tail(d, tokens, ks, vs, logits, votes, votes_at)

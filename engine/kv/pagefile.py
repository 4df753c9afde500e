"""The SSD tier's on-disk format and its I/O threads: page records, a writer, a read-ahead queue.

Contract: one record file per layer (`layer-NN.kvp`), fixed-size records at `index * size`;
each record is a header, the keys and values of one page, and a CRC-32 over both. A record
that fails its checksum raises `PageCorrupt` and is never returned. Writes go through a
bounded background queue; reads of many pages keep up to `depth` reads in flight.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import StrataError

MAGIC = b"STRATAKV"
FORMAT_VERSION = 1
# magic, version, layer, page index, first position, tokens, dtype code, kv bits,
# kv heads, head dim, page tokens, payload bytes
_HEADER = struct.Struct("<8sHHIQIBBHHIQ")
_CRC = struct.Struct("<I")
DTYPES = {1: np.dtype(np.float32), 2: np.dtype(np.float16)}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}


class KVStoreError(StrataError):
    """The SSD tier of the KV cache cannot be used (folder, disk, format)."""


class PageCorrupt(KVStoreError):
    """A page record failed its checksum or its header does not match."""


@dataclass(frozen=True)
class PageHeader:
    layer: int
    index: int
    first_pos: int
    tokens: int
    dtype_code: int
    kv_bits: int
    kv_heads: int
    head_dim: int
    page_tokens: int
    payload: int

    def pack(self) -> bytes:
        return _HEADER.pack(MAGIC, FORMAT_VERSION, self.layer, self.index, self.first_pos,
                            self.tokens, self.dtype_code, self.kv_bits, self.kv_heads,
                            self.head_dim, self.page_tokens, self.payload)


def record_size(kv_heads: int, head_dim: int, page_tokens: int, itemsize: int) -> int:
    return _HEADER.size + 2 * kv_heads * page_tokens * head_dim * itemsize + _CRC.size


class RecordFile:
    """Fixed-size page records of one layer in one file; pread/pwrite, so threads can share it."""

    def __init__(self, path: Path, layer: int, kv_heads: int, head_dim: int, page_tokens: int,
                 dtype: np.dtype) -> None:
        self.path, self.layer = path, layer
        self.kv_heads, self.head_dim, self.page_tokens, self.dtype = (
            kv_heads, head_dim, page_tokens, np.dtype(dtype))
        self.half = kv_heads * page_tokens * head_dim * self.dtype.itemsize
        self.size = record_size(kv_heads, head_dim, page_tokens, self.dtype.itemsize)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise KVStoreError(f"{path}: cannot open KV page file ({exc.strerror})") from exc

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def write(self, index: int, first_pos: int, k: np.ndarray, v: np.ndarray) -> int:
        """Write page `index` (k, v: (kv_heads, tokens, head_dim)); returns bytes written."""
        tokens = k.shape[1]
        kb = np.zeros((self.kv_heads, self.page_tokens, self.head_dim), self.dtype)
        vb = np.zeros_like(kb)
        kb[:, :tokens] = k
        vb[:, :tokens] = v
        payload = kb.tobytes() + vb.tobytes()
        head = PageHeader(self.layer, index, first_pos, tokens, DTYPE_CODES[self.dtype], 16,
                          self.kv_heads, self.head_dim, self.page_tokens, len(payload)).pack()
        body = head + payload
        data = body + _CRC.pack(zlib.crc32(body))
        n = os.pwrite(self.fd, data, index * self.size)
        if n != len(data):
            raise OSError(28, "No space left on device (short write)")
        return n

    def read(self, index: int) -> tuple[PageHeader, np.ndarray, np.ndarray]:
        """Read and verify page `index`; raises PageCorrupt if anything does not check out."""
        data = os.pread(self.fd, self.size, index * self.size)
        where = f"{self.path.name} page {index}"
        if len(data) != self.size:
            raise PageCorrupt(f"KV page {where}: truncated record ({len(data)} bytes)")
        body, (crc,) = data[:-_CRC.size], _CRC.unpack(data[-_CRC.size:])
        if zlib.crc32(body) != crc:
            raise PageCorrupt(f"KV page {where}: checksum mismatch, page not used")
        fields = _HEADER.unpack(body[:_HEADER.size])
        if fields[0] != MAGIC or fields[1] != FORMAT_VERSION:
            raise PageCorrupt(f"KV page {where}: not a Strata KV page of format "
                              f"{FORMAT_VERSION}")
        head = PageHeader(*fields[2:])
        if (head.layer, head.index) != (self.layer, index):
            raise PageCorrupt(f"KV page {where}: header names layer {head.layer} "
                              f"page {head.index}")
        shape = (self.kv_heads, self.page_tokens, self.head_dim)
        off = _HEADER.size
        k = np.frombuffer(body, self.dtype, count=shape[0] * shape[1] * shape[2], offset=off)
        v = np.frombuffer(body, self.dtype, count=k.size, offset=off + self.half)
        t = head.tokens
        return head, k.reshape(shape)[:, :t], v.reshape(shape)[:, :t]


# -- background writer --------------------------------------------------------------------
@dataclass
class _Job:
    layer: int
    index: int
    first_pos: int
    k: np.ndarray
    v: np.ndarray
    serial: int = 0


class PageWriter:
    """A thread that writes queued pages; `put` blocks only when `max_queued` pages wait.

    A page stays readable from `pending` until it is on disk. A write that fails (disk full,
    I/O error) or would pass the size budget marks the tier full: later pages are not queued.
    """

    def __init__(self, files: Callable[[int], RecordFile], budget_bytes: int,
                 max_queued: int = 64,
                 on_written: Callable[[int, int, int], None] | None = None) -> None:
        self._files = files
        self.budget_bytes = budget_bytes
        self.bytes_written = 0
        self.full_reason: str | None = None
        self.pending: dict[tuple[int, int], _Job] = {}
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._q: queue.Queue[_Job | None] = queue.Queue(max_queued)
        self._serial = 0
        self._on_written = on_written
        self._thread = threading.Thread(target=self._run, name="strata-kv-writer", daemon=True)
        self._thread.start()

    def put(self, layer: int, index: int, first_pos: int, k: np.ndarray, v: np.ndarray
            ) -> int:
        """Queue a page; returns its serial, 0 if the tier is full (page stays RAM only)."""
        if self.full_reason is not None:
            return 0
        with self._lock:
            self._serial += 1
            job = _Job(layer, index, first_pos, k, v, self._serial)
            self.pending[(layer, index)] = job
        self._q.put(job)
        return job.serial

    def pending_page(self, layer: int, index: int) -> tuple[np.ndarray, np.ndarray] | None:
        with self._lock:
            job = self.pending.get((layer, index))
        return None if job is None else (job.k, job.v)

    def wait(self, layer: int, index: int) -> None:
        """Block until page (layer, index) has left the queue (written or dropped)."""
        with self._done:
            while (layer, index) in self.pending:
                self._done.wait(0.5)

    def flush(self) -> None:
        self._q.join()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                self._q.task_done()
                return
            try:
                if self.full_reason is None:
                    f = self._files(job.layer)
                    if self.bytes_written + f.size > self.budget_bytes:
                        self.full_reason = f"size budget of {self.budget_bytes >> 20} MB reached"
                    else:
                        self.bytes_written += f.write(job.index, job.first_pos, job.k, job.v)
                        if self._on_written is not None:
                            self._on_written(job.layer, job.index, job.serial)
            except OSError as exc:
                self.full_reason = f"write failed ({exc.strerror or exc})"
            finally:
                with self._done:
                    # A later write of the same page (after a trim) keeps its own entry.
                    if self.pending.get((job.layer, job.index)) is job:
                        del self.pending[(job.layer, job.index)]
                    self._done.notify_all()
                self._q.task_done()


# -- read-ahead ---------------------------------------------------------------------------
class Prefetcher:
    """Reads pages in order with up to `depth` reads in flight, so reads overlap compute."""

    def __init__(self, read: Callable[[int, int], tuple[np.ndarray, np.ndarray]],
                 depth: int = 4) -> None:
        self.depth = max(1, depth)
        self._read = read
        self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="strata-kv-read")

    def read_many(self, layer: int, indices: Sequence[int]
                  ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """Yield (index, k, v) in the order given; errors surface when their page is reached."""
        inflight: list[tuple[int, Future[tuple[np.ndarray, np.ndarray]]]] = []
        it = iter(indices)
        for idx in it:
            inflight.append((idx, self._pool.submit(self._read, layer, idx)))
            if len(inflight) >= self.depth:
                break
        while inflight:
            idx, fut = inflight.pop(0)
            nxt = next(it, None)
            if nxt is not None:
                inflight.append((nxt, self._pool.submit(self._read, layer, nxt)))
            k, v = fut.result()
            yield idx, k, v

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def check_writable(folder: Path) -> None:
    """Raise a one-line KVStoreError if the cache folder cannot hold page files."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-probe"
        with open(probe, "wb") as f:
            f.write(b"x")
        probe.unlink()
    except OSError as exc:
        raise KVStoreError(f"KV cache folder {folder} is not writable "
                           f"({exc.strerror or exc})") from exc

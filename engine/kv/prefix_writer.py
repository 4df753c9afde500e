"""Writing the page store: one background thread per cache writes runs, tails and windows.

Contract: `store` (engine.kv.prefix) snapshots new pages on the generating thread and queues
a `_Job`; `PrefixWriter._run` writes it as one run file (temp file + rename, so a run appears
whole or not at all; no fsync: a torn page after a crash fails its checksum and is cut),
indexes it in the page table, writes the tail and window files, and evicts down to the
budget (engine.kv.prefix_table: leaf pages least recently used first, never a held one; live
sessions' tiers count against the budget). A full disk or a read-only folder records a line
in `stats.write_errors` and goes on: storing is optional, a reply never fails for it.
Temp files of dead writers are swept at start; kill -9 during a write loses only the run in
flight (its temp file is never renamed into place).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sqlite3
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from engine.kv.codec import Parts
from engine.kv.crc import crc32
from engine.kv.pagefile import _CRC, PageHeader
from engine.kv.prefix_format import (
    _IOV_MAX,
    _PX,
    _RUN,
    PREFIX_MAGIC,
    PREFIX_VERSION,
    RUN_MAGIC,
    PrefixLayout,
    Window,
    _as_float32,
)
from engine.kv.prefix_table import TABLE_NAME, PageTable, _scan, files_locked, sessions_bytes
from engine.kv.tail import Tail, write_tail
from engine.platform import pid_alive


@dataclass
class _Job:
    pages: list[tuple[int, bytes, bytes, np.ndarray]]  # depth, parent, hash, tokens
    k: list[np.ndarray]  # per layer (kv_heads, n*P, head_dim), page-contiguous per head
    v: list[np.ndarray]
    first: int  # depth of the first page in k/v
    mtime_ns: int = 0  # 0: now; else older than its parent runs' (LRU drops children first)
    window: Window | None = None  # the sliding layers' window at the prompt's depth
    hash: bytes | None = None  # the chain hash of that depth's last page
    # From the paged store instead of k/v: per page, per layer (k parts, v parts, key min,
    # key max), numpy arrays as the store encodes them (summaries as float32).
    paged: list[list[tuple[Parts, Parts, Any, Any]]] | None = None
    tail: tuple[str, Tail, bytes] | None = None  # file name, record, parent hash
    # Page-table work that need not hold up the generating thread: a chain used now (its
    # pages' hashes), a stored prompt's tip, (pages asked for, pages found) by a lookup.
    touch: tuple[list[bytes], int] | None = None
    tip: bytes | None = None
    counts: tuple[int, int] | None = None
    evict: bool = False  # a job with nothing else: evict down to the (new) budget
    hold: tuple[str, str, int, int] | None = None  # store token, run name, inode, pages
    release: str | None = None  # a store token whose holds end


class PrefixWriter(PrefixLayout):
    """The writing half of PrefixCache (engine.kv.prefix)."""

    _q: queue.Queue[_Job | None]
    _thread: threading.Thread
    _pool: ThreadPoolExecutor
    table: PageTable

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued pages are on disk; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._q.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush(self.settings.flush_s)
        self._q.put(None)
        self._thread.join(timeout=1.0)
        self._pool.shutdown(wait=False)
        if not self._thread.is_alive():
            self.table.close()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                if job.pages:
                    try:
                        self._write_run(job)
                    except OSError as exc:
                        # A full disk or a read-only folder: the cache is optional, go on.
                        self.stats.write_errors.append(f"{self.path(job.pages[0][2]).name}: "
                                                       f"{exc.strerror or exc}")
                if job.tail is not None:
                    name, rec, parent = job.tail
                    try:
                        self.stats.bytes_written += write_tail(self.folder, name, rec, parent,
                                                               self.tail_layout)
                    except OSError as exc:
                        self.stats.write_errors.append(f"{name}: {exc.strerror or exc}")
                if job.window is not None and job.hash is not None:
                    try:
                        self._write_window(job.hash, job.window, job.mtime_ns)
                    except OSError as exc:
                        self.stats.write_errors.append(f"{job.hash.hex()}.kvw: "
                                                       f"{exc.strerror or exc}")
                self._table_work(job)
                if job.pages or job.tail is not None or job.window is not None or job.evict:
                    self._evict()
            finally:
                self._q.task_done()

    def _page_record(self, job: _Job, depth: int, parent: bytes, h: bytes, toks: np.ndarray
                     ) -> list[Any]:
        """One page's record as buffers: page header, then one SSD-tier record per layer."""
        P = self.P
        # The page header, once the digests are known; then the summaries.
        bufs: list[Any] = [b"", b""]
        x = xxhash.xxh3_64()
        pos = (depth - job.first) * P
        q = self.codec.quantized
        sums = np.empty((self.n_layers, 2, self.kv_heads, self.blocks, self.head_dim),
                        self.sum_dtype)
        for layer in range(self.n_layers):
            head = PageHeader(layer, depth, depth * P, P, self.dtype_code, self.codec.bits,
                              self.kv_heads, self.head_dim, P, self.payload,
                              self.codec.group if q else 0).pack()
            segs: list[Any] = [head]
            if job.paged is not None:
                # Part by part, each (kv_heads, P, n): the SSD tier's record layout.
                kp, vp, lo, hi = job.paged[depth - job.first][layer]
                sums[layer, 0], sums[layer, 1] = lo, hi
                for parts in (kp, vp):
                    segs.extend(np.ascontiguousarray(a).data.cast("B") for a in parts)
            else:
                keys = _as_float32(job.k[layer][:, pos:pos + P]).reshape(
                    self.kv_heads, self.blocks, self.block, self.head_dim)
                sums[layer, 0], sums[layer, 1] = keys.min(axis=2), keys.max(axis=2)
                for arr in (job.k[layer], job.v[layer]):
                    segs.extend(np.ascontiguousarray(arr[hh, pos:pos + P]).data.cast("B")
                                for hh in range(self.kv_heads))
            crc = 0
            for s in segs:
                crc = crc32(s, crc)
            segs.append(_CRC.pack(crc))
            for s in segs:
                x.update(s)
            bufs.extend(segs)
        bufs[1] = sums.data.cast("B")
        body = _PX.pack(PREFIX_MAGIC, PREFIX_VERSION, P, depth, self.n_layers, parent, h,
                        x.intdigest(), xxhash.xxh3_64_intdigest(bufs[1])) + toks.tobytes()
        bufs[0] = body + _CRC.pack(crc32(body))
        return bufs

    def _write_run(self, job: _Job) -> None:
        """Write the job's pages as one run file: temp file, then rename into place."""
        first, parent, h0, _ = job.pages[0]
        body = _RUN.pack(RUN_MAGIC, PREFIX_VERSION, self.P, self.n_layers, first,
                         len(job.pages), self.page_bytes, parent, self.key)
        body += b"".join(h for _, _, h, _ in job.pages)
        final = self.path(h0)
        tmp = self.folder / f".tmp-{os.getpid()}-{h0.hex()[:16]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, body + _CRC.pack(crc32(body)))
            for depth, par, h, toks in job.pages:
                bufs = self._page_record(job, depth, par, h, toks)
                for i in range(0, len(bufs), _IOV_MAX):
                    chunk = bufs[i:i + _IOV_MAX]
                    want = sum(len(b) for b in chunk)
                    if os.writev(fd, chunk) != want:
                        raise OSError(28, "No space left on device (short write)")
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(fd)
        # No fsync: a torn page after a crash fails its checksum and is rebuilt.
        t = job.mtime_ns or time.time_ns()
        with files_locked(self.folder):  # the file and its rows change together
            os.replace(tmp, final)
            os.utime(final, ns=(t, t))
            with contextlib.suppress(sqlite3.Error):
                self.table.sync([final.name], used_ns=t)  # else the next full `sync` does
        self.stats.runs_written += 1
        self.stats.pages_written += len(job.pages)
        self.stats.bytes_written += self.run_head_bytes(len(job.pages)) + len(
            job.pages) * self.page_bytes

    def _write_window(self, h: bytes, window: Window, mtime_ns: int = 0) -> None:
        """Write a window file (temp file, then rename into place, as runs)."""
        x = xxhash.xxh3_64()
        segs: list[Any] = []
        for k, v in zip(window.k, window.v, strict=True):
            for a in (k, v):
                seg = np.ascontiguousarray(a).data.cast("B")
                x.update(seg)
                segs.append(seg)
        head = self._window_head(h, window.tokens // self.P, [k.shape[1] for k in window.k],
                                 x.intdigest())
        final = self.window_path(h)
        tmp = self.folder / f".tmp-{os.getpid()}-{h.hex()[:16]}w"
        with open(tmp, "wb") as f:
            f.write(head)
            for seg in segs:
                f.write(seg)
        os.replace(tmp, final)
        t = mtime_ns or time.time_ns()
        os.utime(final, ns=(t, t))

    def _table_work(self, job: _Job) -> None:
        """The job's page-table updates; a table that cannot be written costs only its
        figures (the files stay the truth and are indexed again by the next `sync`)."""
        try:
            if job.touch:
                self.table.touch(*job.touch)
            if job.tip is not None:
                self.table.note_prompt(self.key, job.tip)
            if job.counts is not None:
                self.table.count(*job.counts)
            if job.hold is not None:
                self.table.hold(*job.hold)
            if job.release is not None:
                self.table.release(job.release)
        except sqlite3.Error as exc:
            self.stats.table_errors.append(f"{self.folder / TABLE_NAME}: {exc}")

    def _evict(self) -> None:
        """Over budget: the page table removes files no format uses, then the least
        recently used leaf pages, tails and windows (a page a live session holds stays).
        One budget for the store: live sessions' tiers in it count, stored pages make room."""
        budget = int(self.settings.budget_mb * (1 << 20)) - sessions_bytes(self.folder)[1]
        try:
            pages, runs = self.table.evict(budget)
        except sqlite3.Error as exc:
            # No table (a full disk is when it matters most): whole files, oldest first, by
            # unlinking only (a live session reads on through its open descriptor).
            self.stats.table_errors.append(f"{self.folder / TABLE_NAME}: {exc}")
            pages = runs = 0
            entries = sorted(_scan(self.folder))
            total = sum(size for _, size, _ in entries)
            for _mtime, size, path in entries:
                if total <= budget:
                    break
                with contextlib.suppress(OSError):
                    path.unlink()
                    total -= size
                    runs += path.suffix == ".kvp"
        self.stats.evicted_pages += pages
        self.stats.evicted_runs += runs

    def _sweep_temp(self) -> None:
        """Remove temp files of writers that died (their pid is gone) or are a day old."""
        for tmp in self.folder.glob(".tmp-*"):
            try:
                pid = int(tmp.name.split("-")[1])
                alive = pid == os.getpid() or pid_alive(pid)
                old = time.time() - tmp.stat().st_mtime > 86400
            except (ValueError, IndexError, OSError):
                alive, old = False, True
            if not alive or old:
                with contextlib.suppress(OSError):
                    tmp.unlink()



def _close_at_exit(ref: weakref.ref[Any]) -> None:
    cache = ref()
    if cache is not None:
        cache.close()

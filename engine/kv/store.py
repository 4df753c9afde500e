"""Page storage for every layer: a RAM tier of page slots and an SSD tier of page records.

Contract: `commit(layer, k, v)` stores one full page (keys after RoPE) in a RAM slot and queues
it for the disk (write-through, so eviction never waits on a write it could have done
earlier); when the layer's slots are all taken the least recently used unpinned page that is
on disk leaves RAM. `pages(layer, ids)` returns keys and values of any pages, reading the
cold ones through the read-ahead queue; every read is verified. The RAM tier is page-major:
(slots, kv_heads, page_tokens, n) per part per layer, so a page gathers with one index.
With KV bits 8 or 4 (`settings.bits`) pages are quantized as they are committed, in both
tiers alike (engine.kv.codec), and decoded when attention reads them; the key summaries are
taken from the keys before quantization. Byte counts (`page_bytes`, `stats()`) are the
encoded sizes.
Pages of a stored prefix are mapped, not copied (`map_pages`): the table lists them as cold
pages whose records live in the prefix cache's run files (engine.kv.prefix), read in place
and verified as this tier's own when attention needs them; a cold page read while the RAM
tier has a free slot stays in RAM (nothing is evicted for it).
Admission in sparse mode (`reuse_admission`): a cold page gets a RAM slot only when a second
step asks for it. A step's pages that no later step returns to (most of a rescoring
shortlist: four times the blocks attended, a different set each token) are read for that
step and let go, so the RAM tier holds what attention keeps using (sinks, window, voted and
recurring blocks), not every page a question ever looked at; exact mode streams every page
every step and keeps them from the first read, as before.
A layer whose cache keeps its positions in one contiguous buffer (engine.kv.cache,
`buffer_layer`) has its RAM-tier pages in that buffer: page i is positions [i*P, (i+1)*P)
of it and the tier holds no second copy (`commit_buffered` registers and summarises a page;
reads copy out of the buffer). Nor is it written to the SSD tier while buffered: nothing
evicts it there, and the prefix cache writes a stored prompt's pages into its own run, so a
page of a chat that stays under the buffer's limit is written once, not twice.
`unbuffer_layer` copies the pages into the tier's slots when the buffer goes; an operation
that needs slots (a commit from outside, `ensure_resident`, a mapped restore) makes the owner
let go of it first. Their write-through is queued behind (`write_behind`): each call (once a
layer per step, from the layer's cache) queues at most WRITE_BEHIND_PAGES of them where the
writer has room, so crossing the buffer's limit costs no step the writes of every page at
once; an eviction (of that layer), a manifest, `flush` and a store closed with its files kept
write the rest first. Until written such a page is in RAM only, as a page on its way to the
disk is (kill -9 loses it, as it loses pages in flight).
"""

from __future__ import annotations

import contextlib
import heapq
import json
import os
import shutil
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from engine.kv.codec import Parts, codec_for
from engine.kv.pagefile import (
    KVStoreError,
    PageCorrupt,
    PageWriter,
    Prefetcher,
    RecordFile,
    check_writable,
    codec_record_size,
    unwritten_arrays,
)
from engine.kv.settings import KVSettings, sweep_dead_sessions
from engine.kv.table import LayerTable

# Sparse mode's admission rule (the module's contract); False keeps every page a step reads
# while a slot is free, as exact mode does (tests compare the two).
REUSE_ADMISSION = True
# Pages of an unbuffered layer queued for the SSD tier per `write_behind` call (per layer
# per step): ~3 MB of copies a layer at the starter's shape; 3,840 pages at 16k drain in
# about 8 steps instead of one step waiting for all of them (docs/benchmarks.md).
WRITE_BEHIND_PAGES = 16
# A layer's RAM tier grows by this share of its slots when full (16 at least), up to its
# budget. Doubling left up to half the pool as zeroed slots: a 100k-token prefill in RAM
# held 1,024 slots a layer for 782 pages (7.5 GB RSS for 4.6 GB of float32 KV). Growing by a
# quarter costs about 5x the final pool in copies over a long prefill instead of 2x: at
# 100k ~0.1 s a layer, against minutes of prefill (docs/benchmarks.md, issue 19's 100k).
GROW_SHARE = 0.25


class KVRamFull(KVStoreError):
    """The RAM tier is full and no page can move to the SSD tier."""


class MappedPageCorrupt(PageCorrupt):
    """A mapped page (a stored prefix's record) failed its check when first read: it and
    the pages after it must be computed again (the caller truncates and recomputes)."""

    def __init__(self, message: str, layer: int, page: int, name: str) -> None:
        super().__init__(message)
        self.layer, self.page, self.name = layer, page, name


class BufferOwner(Protocol):
    """A layer cache whose contiguous buffer holds the layer's pages (engine.kv.cache)."""

    buf_k: Any  # (1, kv_heads, capacity, head_dim): positions [0, n_pages * P) are pages
    buf_v: Any

    def release_buffer(self) -> None:
        """Let go of the buffer (the store's `unbuffer_layer` first), keeping the tail."""


def _weak(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` through a weak reference to its object: once the store is collected, a call
    raises OSError (the writer then stops storing: a dropped session's tier is deleted)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        m = ref()
        if m is None:
            raise OSError("KV store closed")
        return m(*args)

    return call


class KVStore:
    """All layers' pages and the two tiers; counters for telemetry in `stats()`."""

    def __init__(self, settings: KVSettings, n_layers: int, kv_heads: int, head_dim: int,
                 dtype: str = "float32", session: str | None = None) -> None:
        self.settings = settings
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.P = settings.page_tokens
        self.dtype = getattr(mx, dtype)
        self.np_dtype = np.dtype(dtype)
        self.codec = codec_for(settings.bits, settings.group(), dtype, head_dim)
        # Bytes of one page (keys and values of one layer) as the tiers hold it: encoded.
        self.page_bytes = 2 * kv_heads * self.P * self.codec.vector_bytes(head_dim)
        self.record_bytes = codec_record_size(self.codec, kv_heads, head_dim, self.P)
        sink_pages = -(-settings.sink_tokens // self.P)
        window_pages = -(-settings.window_tokens // self.P)
        self.max_slots = max(sink_pages + window_pages + 2,
                             settings.ram_bytes() // (max(1, n_layers) * self.page_bytes))
        self.tables = [LayerTable(self.P, sink_pages, window_pages) for _ in range(n_layers)]
        # Per layer: one MLX array per codec part, (slots, kv_heads, P, n); None until used.
        self.pool_k: list[Parts | None] = [None] * n_layers
        self.pool_v: list[Parts | None] = [None] * n_layers
        self._free: list[list[int]] = [[] for _ in range(n_layers)]
        self._serials: list[dict[int, int]] = [{} for _ in range(n_layers)]
        # Sparse mode admits a cold page on its second read (see the module's contract):
        # per layer, the pages read off the SSD tier and let go since.
        self.reuse_admission = REUSE_ADMISSION and settings.mode == "sparse"
        self._seen: list[set[int]] = [set() for _ in range(n_layers)]
        self.counters = dict(evictions=0, ram_hits=0, ssd_reads=0, bytes_read=0, read_s=0.0,
                             pages_written=0, pages_admitted=0)
        self.folder: Path | None = None
        self.writer: PageWriter | None = None
        self._files: dict[int, RecordFile] = {}
        # Mapped pages (a restored prefix): per layer, page -> (fd, record offset, file name).
        self._mapped: list[dict[int, tuple[int, int, str]]] = [{} for _ in range(n_layers)]
        self._held_fds: list[int] = []
        self._on_close: list[Callable[[], None]] = []
        self._ram_reported = -1e9
        self._layouts: dict[int, RecordFile] = {}
        # Per layer: the cache whose buffer holds its resident pages (no slots), or None.
        self._buffers: list[BufferOwner | None] = [None] * n_layers
        # Per layer: resident pages still to be queued for the SSD tier (`write_behind`),
        # in page order (the oldest first: eviction takes those).
        self._behind: list[list[int]] = [[] for _ in range(n_layers)]
        self.prefetcher: Prefetcher | None = Prefetcher(self._read_np, settings.prefetch_depth)
        if settings.ssd:
            root = settings.folder()
            check_writable(root)
            sweep_dead_sessions(root)
            self.folder = root / (session or f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
            check_writable(self.folder)
            # Weakly bound: a thread holding the store's methods would keep a dropped store
            # (and its KV buffers) alive forever; unreferenced, `__del__` closes it.
            self.writer = PageWriter(_weak(self._file), settings.ssd_mb << 20,
                                     settings.writer_queue, on_written=_weak(self._on_written))

    # -- SSD tier -------------------------------------------------------------------------
    def _file(self, layer: int) -> RecordFile:
        f = self._files.get(layer)
        if f is None:
            assert self.folder is not None
            f = RecordFile(self.folder / f"layer-{layer:02d}.kvp", layer, self.kv_heads,
                           self.head_dim, self.P, self.np_dtype, self.codec.bits,
                           self.codec.group)
            self._files[layer] = f
        return f

    def _on_written(self, layer: int, index: int, serial: int) -> None:
        # Runs on the writer thread; a page trimmed and rewritten since keeps its flag off.
        if self._serials[layer].get(index) == serial:
            self.tables[layer].on_disk[index] = True
            self.counters["pages_written"] += 1

    def _layout(self, layer: int) -> RecordFile:
        f = self._layouts.get(layer)
        if f is None:
            f = RecordFile(Path("mapped"), layer, self.kv_heads, self.head_dim, self.P,
                           self.np_dtype, self.codec.bits, self.codec.group, create=False)
            self._layouts[layer] = f
        return f

    def _read_np(self, layer: int, index: int) -> tuple[Parts, Parts]:
        mapped = self._mapped[layer].get(index)
        if mapped is not None:
            fd, off, name = mapped
            t = time.perf_counter()
            f = self._layout(layer)
            try:
                _, k, v = f.read_at(fd, off, index, f"{name} layer {layer} page {index}")
            except PageCorrupt as exc:
                raise MappedPageCorrupt(str(exc), layer, index, name) from exc
            self.counters["read_s"] += time.perf_counter() - t
            self.counters["ssd_reads"] += 1
            self.counters["bytes_read"] += f.size
            return k, v
        if self.writer is not None:
            hit = self.writer.pending_page(layer, index)
            if hit is not None:
                return hit
        t = time.perf_counter()
        _, k, v = self._file(layer).read_parts(index)
        self.counters["read_s"] += time.perf_counter() - t
        self.counters["ssd_reads"] += 1
        self.counters["bytes_read"] += self._file(layer).size
        return k, v

    def _read_batch(self, layer: int, pages: np.ndarray) -> tuple[Parts, Parts]:
        """Cold pages' encoded keys and values, verified, as MLX arrays per part (len(pages),
        kv_heads, P, n) in the order given. Each record is read (`preadv`, on the read
        threads) straight into its rows of fresh MLX buffers and checked there: no bytes
        object, stack or copy into MLX per page (at 128k a step reads ~4,000 records, and
        those copies and the fresh memory behind them cost more than the reads).
        Raises what `_read_np` raises for the first page (in order) that fails."""
        n = len(pages)
        dims = self.codec.part_dims(self.head_dim)
        arrs = [unwritten_arrays(2, (n, self.kv_heads, self.P, d), getattr(mx, dt.name), dt)
                for d, dt in dims]
        mx.eval(arrs)
        ks = tuple(np.asarray(memoryview(a[0])) for a in arrs)
        vs = tuple(np.asarray(memoryview(a[1])) for a in arrs)
        mapped, f = self._mapped[layer], self._layout(layer)
        own = (self._file(layer) if self.folder is not None
               and any(int(p) not in mapped for p in pages) else None)
        read = [0] * n  # per row: 1 if it came off the disk (a page still queued did not)
        self._will_need(layer, pages)
        t = time.perf_counter()

        def rows(lo: int, hi: int) -> None:
            scratch = bytearray(128)  # a header and a CRC
            for i in range(lo, hi):
                page = int(pages[i])
                k, v = tuple(a[i] for a in ks), tuple(a[i] for a in vs)
                hit = mapped.get(page)
                if hit is not None:
                    fd, off, name = hit
                    try:
                        f.read_into(fd, off, page, f"{name} layer {layer} page {page}", k, v,
                                    scratch)
                    except PageCorrupt as exc:
                        raise MappedPageCorrupt(str(exc), layer, page, name) from exc
                    read[i] = 1
                    continue
                pending = None if self.writer is None else self.writer.pending_page(layer, page)
                if pending is not None:
                    for dst, src in zip((*k, *v), (*pending[0], *pending[1]), strict=True):
                        dst[...] = src
                    continue
                if own is None:
                    raise KVStoreError(f"KV cache: layer {layer} page {page} is on no tier")
                own.read_into(own.fd, page * own.size, page,
                              f"{own.path.name} page {page}", k, v, scratch)
                read[i] = 1

        assert self.prefetcher is not None
        self.prefetcher.split(rows, n)
        self.counters["read_s"] += time.perf_counter() - t
        self.counters["ssd_reads"] += sum(read)
        self.counters["bytes_read"] += sum(read) * f.size
        return tuple(a[0] for a in arrs), tuple(a[1] for a in arrs)

    @property
    def ssd_full_reason(self) -> str | None:
        return None if self.writer is None else self.writer.full_reason

    # -- RAM tier -------------------------------------------------------------------------
    def _slot(self, layer: int) -> int:
        """A free slot in the layer's pool: a freed one, a new one, or an evicted page's."""
        free = self._free[layer]
        if free:
            return heapq.heappop(free)
        table = self.tables[layer]
        used = len(table.page_of_slot)
        self._grow(layer, 1)
        pk = self.pool_k[layer]
        if used < (0 if pk is None else pk[0].shape[0]):
            return used
        if self._behind[layer]:
            self._write_behind_all(layer)  # an eviction needs its pages on the disk
        victim = table.evict_candidate()
        if victim is None and table.lru and self.writer is not None:
            # The oldest page is still on its way to disk: wait for it rather than fail.
            oldest = next(iter(table.lru))
            self.writer.wait(layer, oldest)
            victim = table.evict_candidate()
        if victim is None:
            why = self.ssd_full_reason or ("SSD tier off" if self.writer is None
                                           else "no page can leave RAM")
            raise KVRamFull(f"KV cache: RAM budget of {self.ram_budget_mb} MB is full at "
                            f"{self.tokens_in(layer)} tokens and pages cannot spill ({why})")
        self.counters["evictions"] += 1
        return table.release(victim)

    @property
    def ram_budget_mb(self) -> int:
        return self.max_slots * self.n_layers * self.page_bytes >> 20

    def tokens_in(self, layer: int) -> int:
        return self.tables[layer].n_pages * self.P

    def map_pages(self, layer: int, records: list[tuple[int, int]], kmin: Any, kmax: Any,
                  name: str) -> None:
        """Append cold pages whose records (this tier's format, index = page number) live in
        another file: (fd, offset) per page, key summaries (n, kv_heads, head_dim). They are
        read in place when needed and never written to this store's files; the fds must
        stay open while the store lives (`hold` them)."""
        self._leave_buffer(layer)
        table = self.tables[layer]
        start, n = table.n_pages, len(records)
        if not n:
            return
        table._grow(start + n)
        table.slot_of[start:start + n] = -1
        table.on_disk[start:start + n] = True
        table.n_pages = start + n
        table.identity = False
        table.add_summary(kmin, kmax)
        m = self._mapped[layer]
        for i, (fd, off) in enumerate(records):
            m[start + i] = (fd, off, name)

    def hold(self, fd: int) -> None:
        """Keep `fd` (a mapped run file) open until the store closes: a file removed from
        its folder meanwhile (eviction, another process) stays readable through it."""
        self._held_fds.append(fd)

    def on_close(self, release: Callable[[], None]) -> None:
        """Call `release` when the store closes (the page table drops its holds then)."""
        self._on_close.append(release)

    @property
    def mapped_pages(self) -> int:
        """Pages (all layers) whose records are a stored prefix's, shared with the SSD."""
        return sum(len(m) for m in self._mapped)

    def commit(self, layer: int, k: Any, v: Any) -> int:
        """Store a full page (k, v: (kv_heads, P, head_dim) MLX arrays); returns its index."""
        self._leave_buffer(layer)  # a page from outside goes to a slot
        # Summaries from the keys as computed: quantization error stays out of the bounds.
        kp = self.codec.encode(k)
        page = self.commit_parts(layer, kp, self.codec.encode(v), k.min(axis=1), k.max(axis=1))
        self._add_blocks(layer, page, kp, k)
        return page

    def _add_blocks(self, layer: int, page: int, kp: Parts, k: Any, now: bool = False) -> None:
        table = self.tables[layer]
        if table.block_pages == page:
            # Sparse selection's block summaries, from the keys as stored (so a process that
            # restores this page selects alike), for every way a page arrives (a prefill, a
            # benchmark's fill): none has to be read back later to catch up.
            kept = self.codec.decode(kp) if self.codec.quantized else k.astype(self.dtype)
            h, p, d = kept.shape
            kb = kept.reshape(h, p // table.block_tokens, table.block_tokens, d)
            lo, hi = kb.min(axis=2)[None], kb.max(axis=2)[None]
            if now:
                mx.eval(lo, hi)
            table.add_blocks(lo, hi)

    def commit_buffered(self, layer: int, k: Any, v: Any) -> int:
        """Register the next full page of a buffered layer (k, v: that page's positions in
        the buffer, (kv_heads, P, head_dim), evaluated): summaries taken and evaluated now,
        so nothing holds the slice afterwards; the RAM tier keeps no copy (the buffer is the
        page) and the SSD tier gets it only if the buffer goes (`unbuffer_layer`). Returns
        its index."""
        assert self._buffers[layer] is not None
        table = self.tables[layer]
        kmin, kmax = k.min(axis=1), k.max(axis=1)
        mx.eval(kmin, kmax)
        page = table.add_page(table.n_pages)  # its slot is its place in the buffer
        table.add_summary(kmin[None], kmax[None])
        self._add_blocks(layer, page, (k,), k, now=True)
        return page

    def commit_parts(self, layer: int, kp: Parts, vp: Parts, kmin: Any, kmax: Any) -> int:
        """Store a full page already encoded by this store's codec (each part (kv_heads, P,
        n), MLX arrays) with its key summaries ((kv_heads, head_dim) element-wise min and max
        of the keys as computed); returns its index. A restored page enters as a computed one
        does: a RAM slot (evicting as usual), written through to the SSD tier."""
        self._leave_buffer(layer)
        table = self.tables[layer]
        slot = self._slot(layer)
        self._put(layer, slot, kp, vp)
        page = table.add_page(slot)
        table.add_summary(kmin[None], kmax[None])
        self._write(layer, page, kp, vp)
        return page

    def _write(self, layer: int, page: int, kp: Parts, vp: Parts) -> None:
        if self.writer is not None and self.writer.full_reason is None:
            mx.eval(*kp, *vp)
            serial = self.writer.put(layer, page, page * self.P,
                                     tuple(np.array(a) for a in kp),
                                     tuple(np.array(a) for a in vp))
            if serial:
                self._serials[layer][page] = serial

    # -- buffered layers ------------------------------------------------------------------
    def buffered(self, layer: int) -> bool:
        """Whether the layer's resident pages live in its cache's buffer (no slots)."""
        return self._buffers[layer] is not None

    def buffer_layer(self, layer: int, owner: BufferOwner) -> None:
        """From now on `owner`'s buffer holds pages [0, n_pages) of the layer (all of them
        resident before, and copied into it by the owner): the slots and their pool go."""
        table = self.tables[layer]
        n = table.n_pages
        assert table.all_resident(n), "a buffered layer's pages must all be in RAM"
        self.pool_k[layer] = self.pool_v[layer] = None
        self._free[layer] = []
        self._behind[layer] = []  # in the buffer again: unqueued, as buffered pages are
        table.slot_of[:n] = np.arange(n, dtype=np.int32)
        table.page_of_slot = list(range(n))
        table.identity = True
        self._buffers[layer] = owner

    def unbuffer_layer(self, layer: int) -> None:
        """Copy the buffered pages into slots of the layer's pool (page i in slot i), before
        the owner drops its buffer; the layer is an ordinary one again."""
        owner = self._buffers[layer]
        if owner is None:
            return
        self._buffers[layer] = None
        table = self.tables[layer]
        n = table.n_pages
        table.page_of_slot = list(range(n))
        if n:
            kp, vp = self._from_buffer(owner, n, None)
            self.pool_k[layer], self.pool_v[layer] = kp, vp
            # Written through behind the steps (`write_behind`), not all in this one.
            if self.writer is not None and self.writer.full_reason is None:
                self._behind[layer] = self._unwritten(layer)

    def write_behind(self, layer: int, limit: int | None = None) -> int:
        """Queue up to `limit` (WRITE_BEHIND_PAGES) of the layer's pages still to be written
        (oldest first) where the writer's queue has room, without waiting; returns how many
        were queued. The layer's cache calls this once a step."""
        todo = self._behind[layer]
        if not todo:
            return 0
        w = self.writer
        if w is None or w.full_reason is not None:
            todo.clear()  # the tier takes no more pages: they stay RAM only, as any would
            return 0
        n = min(WRITE_BEHIND_PAGES if limit is None else limit, len(todo), w.room())
        for p in todo[:n]:
            self._write_slot(layer, p)
        del todo[:n]
        return n

    def _write_behind_all(self, layer: int) -> None:
        """Queue every page of the layer still to be written (waiting for room)."""
        todo, self._behind[layer] = self._behind[layer], []
        for p in todo:
            self._write_slot(layer, p)

    def _write_slot(self, layer: int, page: int) -> None:
        slot = int(self.tables[layer].slot_of[page])
        pk, pv = self.pool_k[layer], self.pool_v[layer]
        assert slot >= 0 and pk is not None and pv is not None, "a page behind is resident"
        self._write(layer, page, tuple(a[slot] for a in pk), tuple(a[slot] for a in pv))

    def _unwritten(self, layer: int) -> list[int]:
        """Pages never queued for the SSD tier (not on it, not on their way, not mapped, not
        waiting in `write_behind`'s list)."""
        table, ser, mapped = self.tables[layer], self._serials[layer], self._mapped[layer]
        behind = set(self._behind[layer])
        return [int(p) for p in np.flatnonzero(~table.on_disk[:table.n_pages])
                if int(p) not in ser and int(p) not in mapped and int(p) not in behind]

    def _write_buffered(self, layer: int) -> None:
        """Write a buffered layer's pages not on the SSD yet (a manifest is to list them)."""
        owner = self._buffers[layer]
        table = self.tables[layer]
        todo = self._unwritten(layer)
        if owner is None or not todo:
            return
        kp, vp = self._from_buffer(owner, table.n_pages, np.array(todo))
        for i, p in enumerate(todo):
            self._write(layer, p, (kp[0][i],), (vp[0][i],))

    def _leave_buffer(self, layer: int) -> None:
        owner = self._buffers[layer]
        if owner is not None:
            owner.release_buffer()
            assert self._buffers[layer] is None

    def _from_buffer(self, owner: BufferOwner, n_pages: int, pages: np.ndarray | None
                     ) -> tuple[Parts, Parts]:
        """Copies of `pages` (None: all n_pages in order) out of a buffer holding n_pages
        pages, page-major (len(pages), kv_heads, P, n) as the pool holds them, evaluated:
        nothing keeps the buffer."""
        out = []
        for buf in (owner.buf_k, owner.buf_v):
            _, h, _, d = buf.shape
            a = buf[0, :, :n_pages * self.P].reshape(h, n_pages, self.P, d)
            if pages is not None:
                # A gather costs ~6x the plain transposed copy (16k: 0.34 s against 0.06).
                a = mx.take(a, mx.array(np.asarray(pages, np.int32)), axis=1)
            out.append(mx.contiguous(a.transpose(1, 0, 2, 3)))
        mx.eval(out)
        return (out[0],), (out[1],)

    def _grow(self, layer: int, pages: int) -> None:
        """Make the layer's pool hold `pages` more pages than it does (its free slots count), up
        to `max_slots`, in one growth of at least GROW_SHARE: each growth copies the pool, and
        a batch admitted a slot at a time grew it a quarter at a time (after a 128k restore
        the second and third decode steps grew the 30 layers' pools 64 and 146 times)."""
        pk, pv = self.pool_k[layer], self.pool_v[layer]
        cap = 0 if pk is None else pk[0].shape[0]
        want = min(self.max_slots,
                   len(self.tables[layer].page_of_slot) + pages - len(self._free[layer]))
        if want <= cap:
            return
        grow = min(self.max_slots, max(want, cap + max(16, int(cap * GROW_SHARE)))) - cap
        dims = self.codec.part_dims(self.head_dim)

        def zeros() -> Parts:  # fresh arrays for k and v: slot writes update in place
            return tuple(mx.zeros((grow, self.kv_heads, self.P, n), getattr(mx, dt.name))
                         for n, dt in dims)

        if pk is None or pv is None:
            self.pool_k[layer], self.pool_v[layer] = zeros(), zeros()
        else:
            self.pool_k[layer] = tuple(mx.concatenate([a, z])
                                       for a, z in zip(pk, zeros(), strict=True))
            self.pool_v[layer] = tuple(mx.concatenate([a, z])
                                       for a, z in zip(pv, zeros(), strict=True))

    def _put(self, layer: int, slot: int, kp: Parts, vp: Parts) -> None:
        """Write one page's encoded parts (MLX arrays) into `slot` of the layer's pools."""
        pk, pv = self.pool_k[layer], self.pool_v[layer]
        assert pk is not None and pv is not None
        for pool, parts in ((pk, kp), (pv, vp)):
            for a, part in zip(pool, parts, strict=True):
                a[slot] = part

    def truncate(self, layer: int, n_pages: int) -> None:
        freed = self.tables[layer].truncate(n_pages)
        if self._buffers[layer] is not None:
            self.tables[layer].page_of_slot = list(range(n_pages))  # places, not slots
            freed = []
        for s in freed:
            heapq.heappush(self._free[layer], s)
        ser = self._serials[layer]
        for p in [p for p in ser if p >= n_pages]:
            del ser[p]
        m = self._mapped[layer]
        for p in [p for p in m if p >= n_pages]:
            del m[p]
        self._seen[layer] = {p for p in self._seen[layer] if p < n_pages}
        self._behind[layer] = [p for p in self._behind[layer] if p < n_pages]

    def page_np(self, layer: int, page: int) -> tuple[Any, Any]:
        """One page's (k, v) as MLX arrays (kv_heads, P, head_dim), from either tier."""
        slot = int(self.tables[layer].slot_of[page])
        owner = self._buffers[layer]
        if slot >= 0 and owner is not None:
            kb, vb = self._from_buffer(owner, self.tables[layer].n_pages, np.array([page]))
            return kb[0][0], vb[0][0]
        pk, pv = self.pool_k[layer], self.pool_v[layer]
        if slot >= 0 and pk is not None and pv is not None:
            return (self.codec.decode(tuple(a[slot] for a in pk)),
                    self.codec.decode(tuple(a[slot] for a in pv)))
        k, v = self._read_np(layer, page)
        return (self.codec.decode(tuple(mx.array(a) for a in k)),
                self.codec.decode(tuple(mx.array(a) for a in v)))

    def page_parts(self, layer: int, page: int) -> tuple[Parts, Parts]:
        """One page's encoded (k, v) parts as numpy arrays (kv_heads, P, n), from either tier
        (a cold page is read and verified, not brought into RAM)."""
        slot = int(self.tables[layer].slot_of[page])
        owner = self._buffers[layer]
        if slot >= 0 and owner is not None:
            kb, vb = self._from_buffer(owner, self.tables[layer].n_pages, np.array([page]))
            return (np.array(kb[0][0]),), (np.array(vb[0][0]),)
        pk, pv = self.pool_k[layer], self.pool_v[layer]
        if slot >= 0 and pk is not None and pv is not None:
            return (tuple(np.array(a[slot]) for a in pk), tuple(np.array(a[slot]) for a in pv))
        return self._read_np(layer, page)

    def summary(self, layer: int, page: int) -> tuple[Any, Any]:
        """One page's key summaries: (kv_heads, head_dim) min and max, MLX arrays."""
        table = self.tables[layer]
        return table.kmin[page], table.kmax[page]

    def resident_parts(self, layer: int, n_pages: int) -> tuple[Parts, Parts] | None:
        """Encoded keys and values of pages [0, n_pages) if all are in RAM, else None (no
        copy if slots are in page order; a buffered layer's are copied out of its buffer).
        Decode with `self.codec.decode`."""
        table = self.tables[layer]
        owner = self._buffers[layer]
        if owner is not None and 0 < n_pages <= table.n_pages:
            return self._from_buffer(owner, n_pages, None)
        pk, pv = self.pool_k[layer], self.pool_v[layer]
        if n_pages == 0 or pk is None or pv is None or not table.all_resident(n_pages):
            return None
        if table.identity:
            return tuple(a[:n_pages] for a in pk), tuple(a[:n_pages] for a in pv)
        idx = mx.array(table.slot_of[:n_pages])
        return (tuple(mx.take(a, idx, axis=0) for a in pk),
                tuple(mx.take(a, idx, axis=0) for a in pv))

    def resident_view(self, layer: int, n_pages: int) -> tuple[Any, Any] | None:
        """Keys and values of pages [0, n_pages), decoded, if all are in RAM, else None."""
        parts = self.resident_parts(layer, n_pages)
        if parts is None:
            return None
        return self.codec.decode(parts[0]), self.codec.decode(parts[1])

    def gather(self, layer: int, slots: Any, heads: Any) -> tuple[Any, Any]:
        """Decoded keys and values of resident slots, per head: pool[slots, heads] (MLX
        index arrays that broadcast together); the slots must be resident."""
        self._leave_buffer(layer)
        pk, pv = self.pool_k[layer], self.pool_v[layer]
        assert pk is not None and pv is not None
        return (self.codec.decode(tuple(a[slots, heads] for a in pk)),
                self.codec.decode(tuple(a[slots, heads] for a in pv)))

    def stream(self, layer: int, pages: np.ndarray, group: int) -> Any:
        """Yield decoded (k, v) groups of at most `group` pages, in page order between groups;
        within a group the resident pages come first, then the cold ones, which are read
        ahead through the prefetch queue and not kept in RAM (a full pass would thrash it)."""
        table = self.tables[layer]
        res = table.resident(pages)
        dec = self.codec.decode
        for i in range(0, len(pages), group):
            part, r = pages[i:i + group], res[i:i + group]
            ks: list[Any] = []
            vs: list[Any] = []
            hot = part[r]
            pk, pv = self.pool_k[layer], self.pool_v[layer]
            owner = self._buffers[layer]
            if len(hot) and owner is not None:
                kb, vb = self._from_buffer(owner, table.n_pages, hot)
                ks.append(kb[0])
                vs.append(vb[0])
                self.counters["ram_hits"] += len(hot)
            elif len(hot) and pk is not None and pv is not None:
                idx = mx.array(table.slot_of[hot])
                ks.append(dec(tuple(mx.take(a, idx, axis=0) for a in pk)))
                vs.append(dec(tuple(mx.take(a, idx, axis=0) for a in pv)))
                self.counters["ram_hits"] += len(hot)
            cold = part[~r]
            if len(cold):
                kc, vc = self._read_batch(layer, cold)
                spare = len(self._free[layer]) + self.max_slots - len(table.page_of_slot)
                seen = self._seen[layer]
                admit = sum(1 for c in cold if not self.reuse_admission or int(c) in seen)
                self._grow(layer, min(spare, admit))
                for i, c in enumerate(cold):
                    page = int(c)
                    if self.reuse_admission and page not in seen:
                        seen.add(page)  # read once: a second read admits it
                    elif spare > 0:  # a free slot: keep the page (nothing is evicted for it)
                        seen.discard(page)
                        spare -= 1
                        slot = self._slot(layer)
                        self._put(layer, slot, tuple(a[i] for a in kc), tuple(a[i] for a in vc))
                        table.place(page, slot)
                        self.counters["pages_admitted"] += 1
                ks.append(dec(kc))
                vs.append(dec(vc))
            yield (ks[0], vs[0]) if len(ks) == 1 else (mx.concatenate(ks), mx.concatenate(vs))

    def ensure_resident(self, layer: int, pages: np.ndarray) -> np.ndarray | None:
        """Bring `pages` (distinct) into RAM, evicting LRU pages outside them; returns their
        slots, or None (nothing read) if RAM cannot hold them all at once (loading one would
        then evict another that the caller is about to read) or, with `reuse_admission`, if
        one of them is read for the first time (the caller reads them for its step alone)."""
        self._leave_buffer(layer)  # the caller indexes the pool's slots
        table = self.tables[layer]
        table.touch(pages)  # requested pages go to the young end: evicted last
        cold = pages[~table.resident(pages)]
        if len(cold) > self._room(layer, pages):
            return None
        seen = self._seen[layer]
        if self.reuse_admission and any(int(c) not in seen for c in cold):
            return None  # a first read: the caller reads for this step (`stream` notes it)
        self.counters["ram_hits"] += len(pages) - len(cold)
        if len(cold):
            kc, vc = self._read_batch(layer, cold)
            self._grow(layer, len(cold))
            for i, c in enumerate(cold):
                idx = int(c)
                slot = self._slot(layer)
                self._put(layer, slot, tuple(a[i] for a in kc), tuple(a[i] for a in vc))
                table.place(idx, slot)
                seen.discard(idx)
                self.counters["pages_admitted"] += 1
        return table.slot_of[pages]

    def _will_need(self, layer: int, pages: np.ndarray) -> None:
        """Ask the OS to start reading the mapped records of `pages` at once: after a
        restart they may be on the disk, and a few reads in flight at a time leave most of
        its queue idle. (Pages in the page cache: a no-op.)"""
        advise = getattr(os, "posix_fadvise", None)
        m = self._mapped[layer]
        if advise is None or not m:
            return
        size = self._layout(layer).size
        for p in pages:
            hit = m.get(int(p))
            if hit is not None:
                with contextlib.suppress(OSError):
                    advise(hit[0], hit[1], size, os.POSIX_FADV_WILLNEED)

    def _room(self, layer: int, keep: np.ndarray) -> int:
        """Slots that can be had without evicting a page of `keep`: free, not yet allocated,
        or held by an unpinned page outside `keep` (on disk, or on its way there)."""
        table = self.tables[layer]
        spare = len(self._free[layer]) + self.max_slots - len(table.page_of_slot)
        keep_set = set(int(p) for p in keep)
        # Pages not on disk can leave RAM only while the writer takes them.
        writing = self.writer is not None and self.writer.full_reason is None
        return spare + sum(1 for p in table.lru
                           if p not in keep_set and (writing or table.on_disk[p]))

    # -- life cycle and telemetry ---------------------------------------------------------
    def flush(self) -> None:
        """Every page queued for the SSD tier, those behind included, on the disk."""
        if self.writer is not None:
            for layer in range(self.n_layers):
                self._write_behind_all(layer)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None and self.settings.keep_files:
            self.flush()  # files kept for a later store: what is behind goes to them first
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        for f in self._files.values():
            f.close()
        self._files.clear()
        for m in self._mapped:
            m.clear()
        self._buffers = [None] * self.n_layers  # the caches' buffers are theirs to drop
        for fd in self._held_fds:
            os.close(fd)
        self._held_fds.clear()
        releases, self._on_close = self._on_close, []
        for release in releases:
            with contextlib.suppress(Exception):  # a hold left behind dies with the pid
                release()
        if self.folder is not None and not self.settings.keep_files:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown: nothing left to report to)
            pass

    def save_manifest(self, n_tokens: int, extra: dict[str, Any] | None = None) -> None:
        """Record what the page files hold, so a later store can open them (after flush)."""
        assert self.folder is not None
        for layer in range(self.n_layers):
            self._write_buffered(layer)
        self.flush()
        doc = {"format": 1, "layers": self.n_layers, "kv_heads": self.kv_heads,
               "head_dim": self.head_dim, "page_tokens": self.P, "dtype": self.np_dtype.name,
               "kv_bits": self.codec.bits, "group": self.codec.group,
               "tokens": n_tokens, "pages": [t.n_pages for t in self.tables],
               "on_disk": [t.n_on_disk for t in self.tables], **(extra or {})}
        (self.folder / "manifest.json").write_text(json.dumps(doc))

    def adopt(self, layer: int, n_pages: int) -> None:
        """Register pages [0, n_pages) found on disk (after a restart) as cold pages; their
        summaries are rebuilt from the verified records (decoded keys, if quantized)."""
        self._leave_buffer(layer)
        table = self.tables[layer]
        for p in range(n_pages):
            k, _ = self._read_np(layer, p)
            table._grow(p + 1)
            table.n_pages = p + 1
            table.slot_of[p] = -1
            table.on_disk[p] = True
            table.identity = False
            kk = self.codec.decode(tuple(mx.array(a) for a in k))
            table.add_summary(kk.min(axis=1)[None], kk.max(axis=1)[None])

    def _report_ram(self, ram_pages: int) -> None:
        """What this session holds in RAM, for `strata cache` in another process (`ram.json`
        in its tier folder, at most every 2 s; engine.kv.prefix_table.session_ram)."""
        now = time.monotonic()
        if self.folder is None or now - self._ram_reported < 2.0:
            return
        self._ram_reported = now
        with contextlib.suppress(OSError):
            tmp = self.folder / ".ram.json"
            tmp.write_text(json.dumps({"pages_ram": ram_pages,
                                       "bytes_ram": ram_pages * self.page_bytes}))
            os.replace(tmp, self.folder / "ram.json")

    def stats(self) -> dict[str, Any]:
        """Pages and bytes per tier (encoded sizes: quantized pages count as stored)."""
        ram_pages = sum(t.n_resident for t in self.tables)
        ssd_pages = sum(t.n_on_disk for t in self.tables)
        mapped = self.mapped_pages
        self._report_ram(ram_pages)
        return {"pages_ram": ram_pages, "pages_ssd": ssd_pages,
                "bytes_ram": ram_pages * self.page_bytes,
                # This session's own pages on the SSD; mapped ones are the prefix cache's.
                "bytes_ssd": (ssd_pages - mapped) * self.record_bytes,
                "bytes_shared": mapped * self.record_bytes,
                "ram_budget_bytes": self.max_slots * self.n_layers * self.page_bytes,
                "kv_bits": self.codec.bits, "ssd_full": self.ssd_full_reason,
                "pages_mapped": self.mapped_pages,
                **self.counters}

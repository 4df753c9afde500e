"""The prefix cache on the SSD: the KV of prompt prefixes, in full pages that survive restarts.

Contract: `PrefixCache(key, geometry...)` is one model's view of the page store folder (shared
by every model and process). `lookup(prompt)` chains the hashes of the prompt's full pages
(parent hash, model key, token ids: engine.kv.prefix_format) and finds the longest stored
run of them; `restore(caches, prompt, plan, cached)` fills mlx-lm's caches or maps the pages
into the paged KV cache's store (engine.kv.prefix_restore), then the stored tail and logits
(engine.kv.tail) when every full page is there; `store(caches, prompt, plan, window, tail)`
queues the pages not stored yet (copied out on the calling thread) for the writer thread
(engine.kv.prefix_writer). This module keeps that public API and re-exports the names the
runtime, the benchmarks and the tests use; the work is done in:

- engine.kv.prefix_format: keys, chain hashes, run files and page records (format 4), window
  files; checks and builds records;
- engine.kv.prefix_table: the page table (SQLite, metadata only): every stored full page by
  its chain hash, with the run and index that hold it, last use (LRU), live sessions' holds
  (reference counts), the stored prompts' tips (what `shared` counts), the store's hit-rate
  counters; eviction by leaf pages least recently used first, never a held page; the folder
  views for `strata cache`;
- engine.kv.prefix_restore, engine.kv.prefix_writer: the two halves of this class.

Pages are content-addressed and shared: a prompt whose prefix is stored writes only its new
pages (a run file that names the stored chain as its parent) and a lookup walks run to run,
page by page, so prompts, chats and sessions with the same prefix use the same pages. Every
KV mode and bit width: records hold pages as the paged store encodes them (16 bits: compute
dtype, one layout for mlx-lm's cache, exact and sparse; 8 and 4 bits: the quantized bytes,
with bits and group in the key), each with its key summaries per block. Crash safety: runs
are written to a temp file and renamed; every page is checksummed; a page that fails its
check is never used and cuts its run before it (the pages after it are stored again by the
next `store`); the table is rebuilt from the files whenever they disagree.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np

from engine.errors import StrataError
from engine.kv.cache import WindowLayerCache
from engine.kv.codec import Parts
from engine.kv.prefix_format import (  # re-exported: the prefix cache's public names
    _PX,
    PAGE_TOKENS,
    PREFIX_VERSION,
    Plan,
    PrefixCacheError,
    PrefixSettings,
    PrefixStats,
    TailSnapshot,
    Window,
    _is_kvcache,
    _is_rotating,
    _paged,
    _temporal,
    chain_hashes,
    model_key,
    settings_from_env,
)
from engine.kv.prefix_restore import _CHECKERS, _STEP, PrefixRestorer, _unfilled
from engine.kv.prefix_table import (
    LABELS,
    PageTable,
    _scan,
    clear_folder,
    folder_runs,
    folder_summary,
    sessions_bytes,
)
from engine.kv.prefix_writer import PrefixWriter, _close_at_exit, _Job
from engine.kv.settings import KVGeometry
from engine.kv.table import SUMMARY_DTYPE
from engine.kv.tail import Tail

__all__ = ["PAGE_TOKENS", "PREFIX_VERSION", "_CHECKERS", "_PX", "_STEP", "LABELS", "PageTable",
           "Plan", "PrefixCache", "PrefixCacheError", "PrefixSettings", "PrefixStats",
           "TailSnapshot", "Window", "_Job", "_unfilled", "chain_hashes", "clear_folder",
           "folder_runs", "folder_summary", "model_key", "prefix_folder_bytes",
           "sessions_bytes", "settings_from_env"]


class PrefixCache(PrefixRestorer, PrefixWriter):
    """One model's view of the prefix folder (the folder itself is shared by all models)."""

    def __init__(self, key: bytes, n_layers: int, kv_heads: int, head_dim: int, dtype: str,
                 settings: PrefixSettings | None = None, windows: Sequence[int] = (),
                 window_shapes: Sequence[tuple[int, int, int]] = (), bits: int = 16,
                 group: int = 64) -> None:
        """The arguments are PrefixLayout's (engine.kv.prefix_format); this adds the page
        table, the writer thread and the checkers' pool."""
        super().__init__(key, n_layers, kv_heads, head_dim, dtype, settings, windows,
                         window_shapes, bits, group)
        # A table that cannot be opened (a full disk) is opened when it can: no figures or
        # page-level eviction till then, but lookups, restores and stores go on (files).
        self.table = PageTable(self.folder, lazy=True)
        self._holders: set[str] = set()
        self._sweep_temp()
        self._q: queue.Queue[_Job | None] = queue.Queue()
        # First job: index runs the table does not know (format-4 runs from before it, those
        # of a process killed between a write and its rows) and evict down to the budget.
        self._q.put(_Job([], [], [], 0, evict=True))
        self._pool = ThreadPoolExecutor(_CHECKERS, thread_name_prefix="strata-prefix-check")
        self._thread = threading.Thread(target=self._run, name="strata-prefix-writer",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        # A process that exits flushes its queued pages (bounded by flush_s) or abandons them;
        # an abandoned temp file is never renamed into place, so it is never read.
        atexit.register(_close_at_exit, weakref.ref(self))

    def label(self, name: str) -> None:
        """Name this cache's key in the folder's labels file (what `folder_summary` shows
        per model); a failure to write it costs only the name."""
        path = self.folder / LABELS
        with contextlib.suppress(OSError, ValueError):
            labels = json.loads(path.read_text()) if path.is_file() else {}
            if labels.get(self.key.hex()) == name:
                return
            labels[self.key.hex()] = name
            tmp = self.folder / f".tmp-{os.getpid()}-labels"
            try:
                tmp.write_text(json.dumps(labels, indent=1, sort_keys=True))
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)  # gone after the rename; a failed write's too

    @classmethod
    def for_geometry(cls, geometry: KVGeometry, key: bytes,
                     settings: PrefixSettings | None = None, bits: int = 16, group: int = 64
                     ) -> PrefixCache:
        """The prefix cache of a model with this KV geometry and key (`model_key`), its pages
        encoded as the paged store's at `bits` and `group`; refused (PrefixCacheError, the
        geometry's one line) for a model it cannot hold."""
        if geometry.no_prefix is not None:
            raise PrefixCacheError(geometry.no_prefix)
        sliding = geometry.window_layers
        return cls(key, len(geometry.paged_layers), geometry.kv_heads, geometry.head_dim,
                   geometry.dtype, settings, geometry.windows,
                   [geometry.shape(i) for i in sliding], bits, group)

    @property
    def has_windows(self) -> bool:
        """Whether the model has sliding-window layers (so stores need a `snapshot`)."""
        return bool(self.sliding)

    def lookup(self, prompt: Sequence[int]) -> Plan:
        """Chain hashes of the prompt's full pages (at least one token left to prefill) and
        the longest run of them on disk."""
        n = max(0, (len(prompt) - 1) // self.P)
        self.stats.lookups += 1
        hashes = chain_hashes(prompt, self.P, self.key, n)
        hit, runs = self._walk(hashes, 0)
        stored = hit
        if self.sliding:
            # A restore needs the sliding layers' window at its depth: the deepest one stored.
            while hit > 0 and not self.window_path(hashes[hit - 1]).is_file():
                hit -= 1
        self.stats.asked_pages += n
        self.stats.found_pages += hit
        if n and not self._closed:  # the store's hit rate, counted on the writer thread
            self._q.put(_Job([], [], [], 0, counts=(n, hit)))
        return Plan(hashes, hit, self.P, runs, stored)

    def tail_snapshot(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
                      logits: Any) -> TailSnapshot | None:
        """Take the prompt's tail at the end of its prefill (the caches hold exactly the
        prompt; `logits`, (1, vocab), the next token's): references only, `store` copies.
        None if there is nothing new to keep (the whole prompt came from the store)."""
        if not self.tails or plan.logits is not None or self._closed:
            return None
        a, b = len(plan.hashes) * self.P, len(prompt)
        full = [caches[i] for i in self.full]
        ks = vs = None
        if _paged(caches, self.full):
            if b - a == self.P and all(c.offset == b and c.tail_k is None for c in full):
                # A prompt ending on a page boundary: its tail filled the page, committed
                # during the prefill; kept as the session holds it (decoded if quantized).
                try:
                    kv = [c.store.page_np(c.layer, a // self.P) for c in full]
                except StrataError:
                    return None  # its page does not verify on the SSD tier: never stored
                ks, vs = [k[None] for k, _ in kv], [v[None] for _, v in kv]
            elif any(c.offset != b or c.tail_k is None or c.tail_k.shape[2] != b - a
                     for c in full):
                return None  # a tail past a page the prefill committed: skip
            else:
                ks, vs = [c.tail_k for c in full], [c.tail_v for c in full]
        elif not all(_is_kvcache(c) and c.keys is not None and c.offset == b for c in full):
            return None
        votes = None
        if _paged(caches, self.full):
            # Sparse mode's question votes, as the prompt's last chunk (ending before its last
            # token) recorded them: a whole restore gets them back without a forward pass.
            tables = [c.store.tables[c.layer] for c in full]
            if all(t.votes is not None and t.votes_at == b - 1 for t in tables):
                votes = [t.votes for t in tables]
        return TailSnapshot(a, np.asarray(prompt[a:b], "<u4"), ks, vs, logits, votes, b - 1)

    def _tail_job(self, caches: list[Any], plan: Plan, snap: TailSnapshot
                  ) -> tuple[str, Tail, bytes] | None:
        """The snapshot as numpy (mlx-lm's caches: sliced now; their first positions past
        the prompt may be written since, never these)."""
        a, b = snap.start, snap.start + len(snap.tokens)
        full = [caches[i] for i in self.full]
        if snap.k is not None and snap.v is not None:
            ks, vs = snap.k, snap.v
        else:
            if not all(_is_kvcache(c) and c.keys is not None and c.offset >= b for c in full):
                return None
            ks = [c.keys[..., a:b, :] for c in full]
            vs = [c.values[..., a:b, :] for c in full]
        if self.dtype_name == "bfloat16":
            ks, vs = [k.view(mx.uint16) for k in ks], [v.view(mx.uint16) for v in vs]
        kn = [np.array(k[0], copy=True) for k in ks]
        vn = [np.array(v[0], copy=True) for v in vs]
        if any(k.dtype != self.np_dtype or k.shape != (self.kv_heads, b - a, self.head_dim)
               for k in kn):
            return None
        logits = np.array(snap.logits.astype(mx.float32)).reshape(-1)
        votes = None if snap.votes is None else [np.array(v, np.float32) for v in snap.votes]
        path, parent = self._tail_path(plan)
        return path.name, Tail(len(plan.hashes), snap.tokens, kn, vn, logits, votes,
                               snap.votes_at), parent

    def snapshot(self, caches: list[Any]) -> Window | None:
        """The sliding layers' window as the caches hold it now (call when their offset is
        the depth to store, a page boundary); None for a model without sliding layers or
        caches that are not mlx-lm's rotating ones. Copies the arrays out."""
        if not self.sliding:
            return None
        ks, vs, tokens = [], [], None
        for (i, w), (heads, dk, dv) in zip(self.sliding, self.window_shapes, strict=True):
            c = caches[i]
            if isinstance(c, WindowLayerCache):
                # The paged mode's window cache: positions [start, offset) from index 0.
                if c.keys is None or (tokens is not None and c.offset != tokens):
                    return None
                tokens = int(c.offset)
                n, held = min(w, tokens), c.offset - c.start
                if held < n:
                    return None
                k, v = c.keys[0, :, held - n:held], c.values[0, :, held - n:held]
            else:
                if not _is_rotating(c) or c.keys is None:
                    return None
                keys, values, offset, keep, _max, idx = c.state
                if keep or (tokens is not None and offset != tokens):
                    return None
                tokens = int(offset)
                n = min(w, tokens)
                k, v = _temporal(keys, idx, tokens), _temporal(values, idx, tokens)
                k, v = k[0, :, k.shape[2] - n:], v[0, :, v.shape[2] - n:]
            if self.dtype_name == "bfloat16":
                k, v = k.view(mx.uint16), v.view(mx.uint16)
            kn, vn = np.array(k, copy=True), np.array(v, copy=True)
            if (kn.shape != (heads, n, dk) or vn.shape != (heads, n, dv)
                    or kn.dtype != self.np_dtype):
                return None
            ks.append(kn)
            vs.append(vn)
        if tokens is None or tokens % self.P:
            return None
        return Window(tokens, ks, vs)

    def store(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
              window: Window | None = None, tail: TailSnapshot | None = None) -> int:
        """Queue the prompt's full pages that are not on disk, as one run (and, for a model
        with sliding layers, `window`: their `snapshot` at the last full page, if it is
        that depth; else `tail`, the prompt's `tail_snapshot`); returns pages queued. Runs
        on the generating thread (MLX arrays belong to it): copies them out."""
        queued = self._store_pages(caches, prompt, plan, window)
        if tail is not None and not self._closed:
            # After the pages: on a disk with room for one of them, the pages matter more.
            job = self._tail_job(caches, plan, tail)
            if job is not None:
                self._q.put(_Job([], [], [], 0, tail=job))
        if plan.hashes and not self._closed:  # the prompt's chain end: what shares count
            self._q.put(_Job([], [], [], 0, tip=plan.hashes[-1]))
        return queued

    def _store_pages(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
                     window: Window | None) -> int:
        full = [caches[i] for i in self.full]
        paged = _paged(caches, self.full)
        if paged:
            if not self._fits(full[0].store):
                return 0  # a store of another layout: never store it under this key
        elif self.codec.quantized or not all(_is_kvcache(c) and c.keys is not None
                                             for c in full):
            return 0
        if self._closed:
            return 0
        n = len(plan.hashes)
        if window is not None and (not n or window.tokens != n * self.P
                                   or self.window_path(plan.hashes[n - 1]).is_file()):
            window = None  # not this depth, or stored already
        # Pages stored since lookup (another process, an earlier queued run) are kept.
        held = plan.hit_pages if plan.stored_pages is None else plan.stored_pages
        start, more = self._walk(plan.hashes, held)
        runs = [r for r in plan.runs if r.first < held] + more
        if start >= n:
            oldest = self._touch(runs, n)
            if window is not None:
                self._q.put(_Job([], [], [], n, mtime_ns=oldest, window=window,
                                 hash=plan.hashes[n - 1]))
            return 0
        # The new run ends where a stored run begins (it is referenced, not copied), and is
        # never larger than the whole budget.
        stop = next((d for d in range(start + 1, n) if self.path(plan.hashes[d]).is_file()), n)
        fits = int(self.settings.budget_mb * (1 << 20)) - self.run_head_bytes(stop - start)
        stop = min(stop, start + max(0, fits // self.page_bytes))
        if stop <= start or any(c.offset < stop * self.P for c in full):
            return 0
        if stop < n:
            window = None  # its page is not stored: it could never be used
        pages = []
        for d in range(start, stop):
            parent = plan.hashes[d - 1] if d else bytes(32)
            toks = np.asarray(prompt[d * self.P:(d + 1) * self.P], "<u4")
            pages.append((d, parent, plan.hashes[d], toks))
        if paged:
            copied = self._copy_paged(full[0].store, start, stop)
            if copied is None:
                return 0
            oldest = self._touch(runs, start)
            self._q.put(_Job(pages, [], [], start, mtime_ns=oldest, window=window,
                             hash=plan.hashes[n - 1], paged=copied))
            return len(pages)
        a, b = start * self.P, stop * self.P
        ks, vs = [], []
        for c in full:
            k, v = c.keys[..., a:b, :], c.values[..., a:b, :]
            if self.dtype_name == "bfloat16":
                k, v = k.view(mx.uint16), v.view(mx.uint16)
            kn, vn = np.array(k[0], copy=True), np.array(v[0], copy=True)
            if kn.dtype != self.np_dtype or kn.shape[0] != self.kv_heads:
                return 0  # a cache that is not what the key says: never store it
            ks.append(kn)
            vs.append(vn)
        oldest = self._touch(runs, start)
        self._q.put(_Job(pages, ks, vs, start, mtime_ns=oldest, window=window,
                         hash=plan.hashes[n - 1]))
        return len(pages)

    def store_pages(self, prompt: Sequence[int], plan: Plan, start: int, ks: list[np.ndarray],
                    vs: list[np.ndarray]) -> int:
        """Queue pages start.. of `prompt` given as numpy keys and values per full layer
        ((kv_heads, n*P, head_dim), compute dtype), as one run continuing the stored chain
        before `start`: a stored context made without a forward pass (the benchmarks'
        synthetic fill). Returns pages queued."""
        n = ks[0].shape[1] // self.P if ks else 0
        if n == 0 or start + n > len(plan.hashes) or self._closed:
            return 0
        pages = []
        for d in range(start, start + n):
            parent = plan.hashes[d - 1] if d else bytes(32)
            pages.append((d, parent, plan.hashes[d],
                          np.asarray(prompt[d * self.P:(d + 1) * self.P], "<u4")))
        self._q.put(_Job(pages, ks, vs, start, hash=plan.hashes[start + n - 1]))
        return n

    def _copy_paged(self, store: Any, start: int, stop: int
                    ) -> list[list[tuple[Parts, Parts, Any, Any]]] | None:
        """Pages start..stop of every layer of a paged store, copied out as the store
        encodes them (cold pages read back from its SSD tier), with their key summaries
        when quantized; None if a page cannot be read or is not of this layout."""
        out: list[list[tuple[Parts, Parts, Any, Any]]] = []
        dims = self.codec.part_dims(self.head_dim)
        want = [(self.kv_heads, self.P, n) for n, _ in dims]
        try:
            for d in range(start, stop):
                row: list[tuple[Parts, Parts, Any, Any]] = []
                for layer in range(self.n_layers):
                    kp, vp = store.page_parts(layer, d)
                    if ([tuple(a.shape) for a in kp] != want
                            or [tuple(a.shape) for a in vp] != want
                            or [a.dtype for a in kp] != [dt for _, dt in dims]):
                        return None
                    kmin, kmax = self._block_summary(store, layer, d)
                    row.append((kp, vp, kmin, kmax))
                out.append(row)
        except StrataError:
            return None  # a page of the SSD tier that does not verify: never stored
        return out

    def _block_summary(self, store: Any, layer: int, page: int) -> tuple[Any, Any]:
        """A stored page's key min and max per block (kv_heads, blocks, head_dim) in the
        records' dtype: the store's own (taken from the keys as computed) when it has them,
        else from the page as it holds it (as sparse selection would catch them up)."""
        table = store.tables[layer]
        if table.block_tokens == self.block and table.block_pages > page:
            bmin, bmax = table.block_summaries  # (kv_heads, pages * blocks, head_dim)
            at = slice(page * self.blocks, (page + 1) * self.blocks)
            lo, hi = bmin[:, at], bmax[:, at]
        else:
            k, _ = store.page_np(layer, page)  # (kv_heads, P, head_dim), decoded
            kb = k.reshape(self.kv_heads, self.blocks, self.block, self.head_dim)
            lo, hi = kb.min(axis=2), kb.max(axis=2)
        return (np.array(lo.astype(SUMMARY_DTYPE)), np.array(hi.astype(SUMMARY_DTYPE)))

    def disk_bytes(self) -> int:
        return sum(size for _, size, _ in _scan(self.folder))

    def set_budget(self, budget_mb: float) -> None:
        """A new disk budget, in force from now: the writer evicts down to it next."""
        if budget_mb < 0:
            raise PrefixCacheError(f"prefix cache budget {budget_mb} MB is negative")
        self.settings = replace(self.settings, budget_mb=float(budget_mb))
        if not self._closed:
            self._q.put(_Job([], [], [], 0, evict=True))  # no pages: the writer only evicts

    def clear(self) -> tuple[int, int]:
        """Remove every stored run (queued runs are written first, then go too); returns the
        files and bytes removed. Call from the thread that stores."""
        self.flush()
        return clear_folder(self.folder)



def prefix_folder_bytes(settings: PrefixSettings | None = None) -> int:
    """Bytes the prefix folder holds (for the memory panel), 0 if it does not exist."""
    s = settings or settings_from_env()
    return sum(size for _, size, _ in _scan(s.root()))

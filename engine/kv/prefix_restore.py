"""Restoring stored pages: into mlx-lm's caches (read) or the paged KV cache (mapped).

Contract: `PrefixRestorer.restore(caches, prompt, plan, cached)` fills caches with the
plan's verified stored pages and, when every full page is there, the stored tail; returns
the tokens the caches hold. Only what verifies is used: the first page that fails ends the
match and its run is cut before it. mlx-lm's caches: pages are read straight into unwritten
MLX buffers by one reader in file order while two threads check each page (every byte
against its xxh3-64 digest). Paged caches: each page's header and key summaries are read and
verified; its layer records join the store's table as cold pages (`KVStore.map_pages`), read
in place when attention needs them; the run files stay open in the store and the mapped
pages are held in the page table (engine.kv.prefix_table), so eviction by this process or
another never takes a page a live session holds. A mapped page found damaged later is cut by
`damaged` (the runtime recomputes it).
"""

from __future__ import annotations

import contextlib
import os
import queue
import sqlite3
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import xxhash

from engine.kv.attention import question_tokens
from engine.kv.pagefile import _CRC, _HEADER
from engine.kv.pagefile import unwritten_arrays as _unfilled
from engine.kv.prefix_format import (
    _IOV_MAX,
    _NOFOLLOW,
    Plan,
    PrefixLayout,
    _is_kvcache,
    _is_rotating,
    _paged,
    _Run,
    _set_window,
)
from engine.kv.prefix_table import PageTable
from engine.kv.prefix_writer import _Job
from engine.kv.tail import common_prefix, read_tail, tail_name


class PrefixRestorer(PrefixLayout):
    """The restoring half of PrefixCache (engine.kv.prefix)."""

    _pool: ThreadPoolExecutor
    _q: queue.Queue[_Job | None]
    _holders: set[str]
    table: PageTable

    def restore(self, caches: list[Any], prompt: Sequence[int], plan: Plan, cached: int
                ) -> int:
        """Fill `caches` (which hold `cached` tokens) with stored pages up to plan.hit_pages,
        then, when every full page is there, the stored tail's tokens that the prompt shares
        (engine.kv.tail; with the logits, `plan.logits`, when it is the whole prompt);
        returns the tokens the caches hold now. Only what verifies is used. `caches` are
        mlx-lm's (pages go into their arrays) or the paged KV cache's (pages are mapped into
        its store; `_restore_paged`)."""
        got = self._restore_pages(caches, prompt, plan, cached)
        n = len(plan.hashes)
        if not self.tails or got != n * self.P or len(prompt) <= got:
            return got
        return self._restore_tail(caches, prompt, plan, got)

    def _tail_path(self, plan: Plan) -> tuple[Path, bytes]:
        parent = plan.hashes[-1] if plan.hashes else bytes(32)
        return self.folder / tail_name(self.key, parent), parent

    def _restore_tail(self, caches: list[Any], prompt: Sequence[int], plan: Plan, got: int
                      ) -> int:
        """The stored tail after the prompt's last full page, as far as the prompt shares
        it, into the caches (which hold exactly the full pages)."""
        t0 = time.perf_counter()
        path, parent = self._tail_path(plan)
        tail = read_tail(path, parent, len(plan.hashes), self.tail_layout)
        if tail is None:
            return got
        want = np.asarray(prompt[got:], "<u4")
        m = common_prefix(tail.tokens, want)
        whole = m == len(want) == len(tail.tokens) and tail.logits is not None
        if not whole:
            m = min(m, len(want) - 1)  # a token must be left to compute the logits from
        full = [caches[i] for i in self.full]
        paged = _paged(caches, self.full)
        keep = question_tokens(full[0].store, len(prompt)) if paged else 0
        votes = tail.votes if whole and tail.votes_at == len(prompt) - 1 else None
        if keep and votes is None:
            # Sparse mode: the question's votes come from the prompt's last prefill chunk,
            # which a whole restore would skip (engine.kv.attention): without the votes the
            # tail kept, its last tokens are prefilled again, so the reply selects as a fresh
            # prefill's does.
            whole = False
            m = min(m, len(want) - keep)
        if m <= 0 or (paged and any(c.offset != got or c.tail_k is not None for c in full)):
            return got
        for layer, c in enumerate(full):
            k = mx.array(tail.k[layer][None, :, :m])
            v = mx.array(tail.v[layer][None, :, :m])
            if self.dtype_name == "bfloat16":
                k, v = k.view(mx.bfloat16), v.view(mx.bfloat16)
            if paged and m == self.P:  # a whole page (a prompt ending on its boundary)
                c.store.commit(c.layer, k[0], v[0])
                c.offset = got + m
            elif paged:
                c.tail_k, c.tail_v, c.offset = k, v, got + m
            else:
                c.update_and_fetch(k, v)
        if paged and votes is not None:  # (also where keep is 0: a fresh prefill has them)
            for c, layer_votes in zip(full, votes, strict=True):
                c.store.tables[c.layer].set_votes(mx.array(layer_votes), tail.votes_at)
        mx.eval([c.state for c in full])
        if whole:
            assert tail.logits is not None
            plan.logits = mx.array(tail.logits)[None]
        self.stats.restored_tokens += m
        self.stats.restore_s += time.perf_counter() - t0
        return got + m

    def _restore_pages(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
                       cached: int) -> int:
        first = cached // self.P
        if plan.hit_pages <= first:
            return cached
        if _paged(caches, self.full):
            return self._restore_paged(caches, prompt, plan, cached)
        if self.codec.quantized:
            return cached  # quantized pages map onto the paged store only
        t0 = time.perf_counter()
        window = None
        if self.sliding:
            window = self._read_window(plan.hashes[plan.hit_pages - 1], plan.hit_pages)
            if window is None:
                return cached
        want = plan.hit_pages
        opened = self._open(plan, first)  # the disk starts on every page now
        n = plan.hit_pages - first
        if n <= 0 or (window is not None and plan.hit_pages != want):
            for _, fd, advice in opened:
                advice.result()
                os.close(fd)
            return cached
        total = n * self.P
        cap = -(-(total + 1) // _STEP) * _STEP if first == 0 else total
        shape = (1, self.kv_heads, cap, self.head_dim)
        full = [caches[i] for i in self.full]
        # Pages are read straight into MLX's own buffers (writable through the buffer
        # protocol), which are left unwritten until then: each byte of fresh memory is
        # touched once, by the read, and no copy follows.
        raw = mx.uint16 if self.dtype_name == "bfloat16" else getattr(mx, self.dtype_name)
        both = _unfilled(2 * self.n_layers, shape, raw, self.np_dtype)
        mk, mv = both[:self.n_layers], both[self.n_layers:]
        both.clear()
        mx.eval(mk, mv)
        ks = [np.asarray(memoryview(cast(Any, a))) for a in mk]
        vs = [np.asarray(memoryview(cast(Any, a))) for a in mv]
        good = self._read(opened, plan, first, prompt, ks, vs)
        if good == 0 or (window is not None and good < n):
            ks.clear()  # (a sliding model's window belongs to the last page: all or nothing)
            vs.clear()
            return cached
        end = (first + good) * self.P
        base = first * self.P
        if cached > base:
            for c in full:  # drop the partial page held in memory; the stored one replaces it
                c.trim(cached - base)
        direct = first == 0 and all(_is_kvcache(c) and c.keys is None for c in full)
        ks.clear()  # no view may outlive the hand-over: the caches then own the buffers
        vs.clear()
        if window is not None:
            for (i, w), (k, v) in zip(self.sliding, window, strict=True):
                # mlx-lm's rotating cache as a prefill would have left it at `end`: the last
                # min(window, end) positions in order, the write index after them.
                caches[i].state = (k, v, end, 0, w, k.shape[2])
        for layer, c in enumerate(full):
            k, v = mk[layer], mv[layer]
            if self.dtype_name == "bfloat16":
                k, v = k.view(mx.bfloat16), v.view(mx.bfloat16)
            if direct:
                # Capacity past `end` lets the suffix's prefill write in place.
                c.keys, c.values, c.offset = k, v, end
            else:
                c.update_and_fetch(k[:, :, :end - base], v[:, :, :end - base])
        mk.clear()
        mv.clear()
        mx.eval([c.keys for c in caches if _is_kvcache(c) or _is_rotating(c)])
        self._touch(plan.runs, plan.hit_pages)
        if window is not None:
            with contextlib.suppress(OSError):
                os.utime(self.window_path(plan.hashes[plan.hit_pages - 1]))
        self.stats.hits += 1
        self.stats.restored_tokens += end - base
        self.stats.bytes_read += good * self.page_bytes
        self.stats.restore_s += time.perf_counter() - t0
        return end

    def _restore_paged(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
                       cached: int) -> int:
        """The paged KV cache's restore: stored pages are mapped, not copied. Each page's
        header and key summaries are read and verified (one small read per page); its layer
        records stay where they are and join the store's table as cold pages (`map_pages`),
        read in place and checked (header, CRC-32) when attention first needs them. The run
        files stay open in the store, so eviction meanwhile cannot take them away. Pages
        after one that fails are not used. A sliding layer's window cache is set to the
        stored window; such a model restores into an empty cache only."""
        P = self.P
        full = [caches[i] for i in self.full]
        store = full[0].store
        if not self._fits(store):
            return cached  # a store of another layout: its pages are not these records
        if self.sliding and cached:
            return cached
        t0 = time.perf_counter()
        window = None
        if self.sliding:
            window = self._read_window(plan.hashes[plan.hit_pages - 1], plan.hit_pages)
            if window is None:
                return cached
        first = cached // P
        want = plan.hit_pages
        opened = self._open(plan, first, advise=False)  # only headers are read now
        if plan.hit_pages <= first or (window is not None and plan.hit_pages != want):
            for _, fd, _ in opened:
                os.close(fd)
            return cached
        head = self.page_head + self.summary_bytes
        good = 0
        n_max = plan.hit_pages - first
        L, h, nb, dd = self.n_layers, self.kv_heads, self.blocks, self.head_dim
        # Every page's block summaries land in one MLX buffer, left unwritten until then,
        # head-major per layer: (layers, 2, kv_heads, pages, blocks, head_dim). The table's
        # (kv_heads, blocks of all pages, head_dim) arrays are then views of it, so neither
        # a copy into MLX nor the transposing copy on first use follows (377 MB each at 128k).
        sm = getattr(mx, self.sum_dtype.name)
        big = _unfilled(1, (L, 2, h, n_max, nb, dd), sm, self.sum_dtype)[0]
        mx.eval(big)
        sums = np.asarray(memoryview(cast(Any, big)))
        # One page's summaries as the record holds them (layer, min/max, head): read into
        # this staging buffer (cache-hot), checked in one call, then scattered into `sums`.
        stage = np.empty(self.summary_bytes, np.uint8)
        sview = stage.view(self.sum_dtype).reshape(L, 2, h, nb, dd)
        # The pages' own bounds (their blocks' extreme) are computed a chunk at a time on
        # MLX's stream while the next chunk is read.
        dt = getattr(mx, self.dtype_name)
        bounds: list[list[Any]] = [[] for _ in range(L)]
        done = 0

        def bound_chunk(upto: int) -> None:
            nonlocal done
            if upto <= done:
                return
            lo = _ordered(_ordered(big[:, 0, :, done:upto].view(mx.int16)).min(axis=3))
            hi = _ordered(_ordered(big[:, 1, :, done:upto].view(mx.int16)).max(axis=3))
            lo, hi = (x.view(sm).astype(dt) for x in (lo, hi))  # (L, h, m, D)
            mx.async_eval(lo, hi)
            for layer in range(L):
                bounds[layer].append((lo[layer], hi[layer]))
            done = upto

        fds = {run.path: fd for run, fd, _ in opened}
        # Each page's header and summaries are one range 6 MB from the next (at 128k): with
        # the runs not in the page cache (a restart after a while), one read at a time waits
        # on the disk's latency each. A pool thread asks for them all ahead of the reads.
        # (run, index in it, fd, offset) of each page, the runs walked once (`plan.where`
        # searches them, 64 at 128k, for one page).
        places = []
        for k, run in enumerate(plan.runs):
            upto = min(plan.hit_pages,
                       plan.runs[k + 1].first if k + 1 < len(plan.runs) else plan.hit_pages)
            places += [(run, i, fds[run.path], run.offset(i, self.page_bytes))
                       for i in range(max(first, run.first) - run.first, upto - run.first)]
        advice = self._pool.submit(_will_need_all, [(fd, off, head)
                                                    for _, _, fd, off in places])
        ids = np.asarray(prompt, "<u4")  # (each header's tokens are checked against a slice)
        buf = bytearray(self.page_head)
        mapped: list[tuple[int, int]] = []  # (fd, offset of layer 0's record) per good page
        for d, (run, i, fd, off) in enumerate(places, first):
            try:
                n = os.preadv(fd, [buf, stage.data], off)
                size = os.fstat(fd).st_size
            except OSError:
                n, size = 0, 0
            if n != head or size < off + self.page_bytes:
                break  # truncated since lookup: this page and those after it are unused
            digests = self._header_digest(bytes(buf[:self.page_head]), plan.hashes[d], d, ids)
            if digests is None or xxhash.xxh3_64_intdigest(stage.data) != digests[1]:
                self.stats.corrupt_pages += 1
                self._cut(run, i)
                plan.stored_pages = d
                break
            sums[:, :, :, d - first] = sview
            mapped.append((fd, off + head))
            good += 1
            if good % BOUND_CHUNK == 0:
                bound_chunk(good)
        bound_chunk(good)
        records = [[(fd, off + layer * self.layer_bytes) for fd, off in mapped]
                   for layer in range(self.n_layers)]
        del sums  # no numpy view may outlive the hand-over to MLX
        advice.result()  # (before any descriptor may be closed below)
        used = {fd for fd, _ in mapped}
        for run, fd, _ in opened:
            if fd in used:
                store.hold(fd)
                # The page table's reference: no eviction takes these pages while it lives.
                nxt = [x.first for x in plan.runs if x.first > run.first]
                pages = min([first + good, run.first + run.present, *nxt]) - run.first
                self._hold(store, run, pages)
            else:
                os.close(fd)
        plan.hit_pages = first + good
        if good == 0 or (window is not None and plan.hit_pages != want):
            return cached  # nothing mapped: the caches are as they were
        if cached > first * P:
            for c in full:  # the partial page held in memory: the stored one replaces it
                c.trim(cached - first * P)
        name = plan.runs[0].path.name
        for layer in range(self.n_layers):
            table = store.tables[layer]
            if table.block_tokens == self.block and table.block_pages == table.n_pages:
                # (n, heads, blocks, dim) views of the head-major buffer: the table's
                # head-major concatenation of them is the buffer itself, no copy.
                table.add_blocks(big[layer, 0, :, :good].transpose(1, 0, 2, 3),
                                 big[layer, 1, :, :good].transpose(1, 0, 2, 3))
            parts = bounds[layer]
            kmin = parts[0][0] if len(parts) == 1 else mx.concatenate([a for a, _ in parts], 1)
            kmax = parts[0][1] if len(parts) == 1 else mx.concatenate([b for _, b in parts], 1)
            store.map_pages(layer, records[layer], kmin.transpose(1, 0, 2),
                            kmax.transpose(1, 0, 2), name)
        end = (first + good) * P
        for c in full:
            c.offset = end
            c.tail_k = c.tail_v = None
        if window is not None:
            for (i, _w), (k, v) in zip(self.sliding, window, strict=True):
                _set_window(caches[i], k, v, end)
        self._touch(plan.runs, plan.hit_pages)
        if window is not None:
            with contextlib.suppress(OSError):
                os.utime(self.window_path(plan.hashes[plan.hit_pages - 1]))
        self.stats.hits += 1
        self.stats.restored_tokens += end - first * P
        self.stats.bytes_read += good * head
        self.stats.restore_s += time.perf_counter() - t0
        return end

    def damaged(self, plan: Plan, page: int) -> None:
        """A mapped page of `plan` failed its check when read (engine.kv.store's
        MappedPageCorrupt): its run is cut before it, so it and the pages after it are
        stored again by the next `store`."""
        if page >= len(plan.hashes):
            return
        with contextlib.suppress(IndexError):
            run, i = plan.where(page)
            self._cut(run, i)
        self.stats.corrupt_pages += 1
        plan.hit_pages = min(plan.hit_pages, page)
        plan.stored_pages = min(plan.stored_pages if plan.stored_pages is not None
                                else page, page)

    def read_pages(self, plan: Plan, prompt: Sequence[int], ks: list[np.ndarray],
                   vs: list[np.ndarray], first: int = 0) -> int:
        """Read pages first..plan.hit_pages into per-layer arrays shaped (1, kv_heads, >= n*P,
        head_dim), page `first` at position 0; returns how many verified in a row (the restore
        without MLX, for tests and tools)."""
        return self._read(self._open(plan, first), plan, first, prompt, ks, vs)

    def _open(self, plan: Plan, first: int, advise: bool = True
              ) -> list[tuple[_Run, int, Future[None]]]:
        """Open the runs holding pages first..hit_pages and (advise) ask the OS to read those
        ranges ahead. A run replaced since `lookup` (another process) ends the match before
        it."""
        out: list[tuple[_Run, int, Future[None]]] = []
        for k, run in enumerate(plan.runs):
            end = plan.runs[k + 1].first if k + 1 < len(plan.runs) else plan.hit_pages
            if end <= first:
                continue
            try:
                fd = os.open(run.path, os.O_RDONLY | _NOFOLLOW)
            except OSError:
                plan.hit_pages = max(first, run.first)
                break
            if os.fstat(fd).st_ino != run.ino:
                os.close(fd)
                plan.hit_pages = max(first, run.first)
                break
            a = max(first, run.first) - run.first
            if not advise:
                done: Future[None] = Future()
                done.set_result(None)
                out.append((run, fd, done))
                continue
            out.append((run, fd, self._pool.submit(_will_need, fd, run.offset(a, self.page_bytes),
                                                   (end - run.first - a) * self.page_bytes)))
        return out

    def _read(self, opened: list[tuple[_Run, int, Future[None]]], plan: Plan, first: int,
              prompt: Sequence[int], ks: list[np.ndarray], vs: list[np.ndarray]) -> int:
        """Read and verify pages first..plan.hit_pages from the opened runs; closes them.
        Cuts the run of the first page that fails, and sets plan.hit_pages before it.

        One thread (this one) reads the pages in file order, as one sequential stream the
        kernel's readahead keeps ahead of; the checks of each page run on the pool meanwhile.
        Several readers at once were 20-40% slower here (docs/benchmarks.md, fifth pass)."""
        checks: list[Future[bool]] = []
        seen = 0  # checks known to have passed
        try:
            fds = {run.path: fd for run, fd, _ in opened}
            for d in range(first, plan.hit_pages):
                run, i = plan.where(d)
                bufs = self._fill_page(fds[run.path], run.offset(i, self.page_bytes), ks, vs,
                                       (d - first) * self.P)
                if bufs is None:
                    break  # truncated since lookup: this page and those after it are not used
                checks.append(self._pool.submit(self._check_page, bufs, plan.hashes[d], d,
                                                prompt))
                while seen < len(checks) and checks[seen].done() and checks[seen].result():
                    seen += 1
                if seen < len(checks) and checks[seen].done():
                    break  # a page failed: reading on would be wasted
            ok = [c.result() for c in checks]  # all of them: no check may outlive the buffers
        finally:
            for _, fd, advice in opened:
                advice.result()  # the fd is closed only once nothing uses it
                os.close(fd)
        good = ok.index(False) if False in ok else len(ok)
        if first + good < plan.hit_pages:
            self.stats.corrupt_pages += 1
            run, i = plan.where(first + good)
            self._cut(run, i)
        if first + good < plan.hit_pages:
            plan.stored_pages = first + good
        plan.hit_pages = first + good  # pages past a bad one are rewritten by the next store
        return good

    def _fill_page(self, fd: int, off: int, ks: list[np.ndarray], vs: list[np.ndarray],
                   pos: int) -> list[Any] | None:
        """Read one page record at `off` straight into the layers' arrays at `pos`; returns
        the buffers it filled (page header first), or None if the file ends before it."""
        P = self.P
        bufs: list[Any] = [bytearray(self.page_head), bytearray(self.summary_bytes)]
        for layer in range(self.n_layers):
            bufs.append(bytearray(_HEADER.size))
            for arr in (ks[layer], vs[layer]):
                bufs.extend(arr[0, hh, pos:pos + P].data.cast("B")
                            for hh in range(self.kv_heads))
            bufs.append(bytearray(_CRC.size))
        try:
            for i in range(0, len(bufs), _IOV_MAX):
                chunk = bufs[i:i + _IOV_MAX]
                want = sum(len(b) for b in chunk)
                if os.preadv(fd, chunk, off) != want:
                    return None
                off += want
        except OSError:
            return None
        return bufs

    def _read_window(self, h: bytes, depth: int) -> list[tuple[Any, Any]] | None:
        """The sliding layers' (keys, values) at `depth` as MLX arrays (1, heads, n, dim),
        every byte verified; None if the file is missing or does not verify (then it goes)."""
        path = self.window_path(h)
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except OSError:
            return None
        try:
            data = b""
            size = os.fstat(fd).st_size
            while len(data) < size:
                chunk = os.pread(fd, size - len(data), len(data))
                if not chunk:
                    break
                data += chunk
        except OSError:
            return None
        finally:
            os.close(fd)
        out = self._parse_window(data, h, depth)
        if out is None:
            with contextlib.suppress(OSError):
                path.unlink()
            self.stats.corrupt_pages += 1
        return out

    def _cut(self, run: _Run, i: int) -> None:
        """Drop page i of a run and all after it: truncate the file before it, or remove the
        file if nothing is left. Only the file `lookup` saw (same inode) is touched."""
        with contextlib.suppress(OSError):
            fd = os.open(run.path, os.O_WRONLY | _NOFOLLOW)
            try:
                if os.fstat(fd).st_ino != run.ino:
                    return
                if i == 0:
                    run.path.unlink()
                else:
                    os.ftruncate(fd, run.offset(i, self.page_bytes))
            finally:
                os.close(fd)
        with contextlib.suppress(sqlite3.Error):
            self.table.sync([run.path.name])  # the table lists only what the file holds

    def _hold(self, store: Any, run: _Run, pages: int) -> None:
        """Hold `pages` pages of `run` for `store` in the page table until the store closes.
        Written by the writer thread, in order with the release (a first SQLite write can
        take 5-15 ms here: not on the way to the first token). Meanwhile the open descriptor
        keeps an unlinked run readable, and a page another process truncated fails its check
        when read and is recomputed (`damaged`): never a wrong page."""
        token = f"{id(store):x}"
        if self._closed:
            return
        self._q.put(_Job([], [], [], 0, hold=(token, run.path.name, run.ino, pages)))
        if token in self._holders:
            return
        self._holders.add(token)
        ref = weakref.ref(self)
        table = self.table

        def release() -> None:
            cache = ref()
            if cache is not None and not cache._closed:
                cache._holders.discard(token)
                cache._q.put(_Job([], [], [], 0, release=token))
            else:
                table.release(token)

        store.on_close(release)

    def _touch(self, runs: Sequence[_Run], hit_pages: int, now: int | None = None) -> int:
        """Mark the runs' pages up to `hit_pages` used now in the page table (on the writer
        thread); deeper pages look slightly older, so eviction meets leaves first. Returns
        the oldest time set (what new pages continuing the chain are given)."""
        t = time.time_ns() if now is None else now
        hashes = [h for run in runs for j, h in enumerate(run.hashes[:run.present])
                  if run.first + j < hit_pages]
        if hashes and not self._closed:
            self._q.put(_Job([], [], [], 0, touch=(hashes, t)))
        return t - 1000 * len(hashes)




_CHECKERS = 2
# A mapped restore computes its pages' own key bounds this many pages at a time, while it
# reads on.
BOUND_CHUNK = 64


_STEP = 256  # mlx-lm KVCache grows in steps of 256 positions: restore with that headroom


def _ordered(bits: Any) -> Any:
    """float16 bit patterns (int16) to integers in the floats' order, and back (it is its
    own inverse): the magnitude bits of negative values flipped. A page's bounds are the
    extremes of its blocks' summaries; over the integers MLX's CPU reduction took 0.20-0.24 s
    for the 128k restore's 188 MB, over float32 copies 0.35-0.44 s (docs/benchmarks.md).
    Summaries are finite (no NaN), where the order holds; -0 sorts just below +0."""
    return bits ^ ((bits >> 15) & 0x7FFF)


def _will_need_all(ranges: list[tuple[int, int, int]]) -> None:
    """`_will_need` for each (fd, offset, length), in order."""
    for fd, offset, length in ranges:
        _will_need(fd, offset, length)


def _will_need(fd: int, offset: int, length: int) -> None:
    """Ask the OS to start reading this range into the page cache (no wait, no error)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with contextlib.suppress(OSError):
            advise(fd, offset, length, os.POSIX_FADV_WILLNEED)

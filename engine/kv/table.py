"""The page table of one layer: metadata only (tier, slot, LRU order, key summaries per page
and per block of BLOCK_TOKENS, the question's votes per block).

Contract: pages are numbered from 0 in token order; page i holds positions [i*P, (i+1)*P).
A page is resident when it has a RAM slot, on disk once the writer has stored it. Pinned pages
(the sinks and the recent window) are never chosen for eviction. Tensors live in the store.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np

# Sparse selection's unit (engine.kv.attention): the key summaries are also kept per run of
# this many tokens of a page. A 128-token page's min/max bound hardly tells pages apart on
# natural text; 8 tokens found a fact that 16 missed at a fifth of the context
# (docs/benchmarks.md, needles in natural text). Kept in float16 whatever the KV dtype: 1/16
# of float32 KV's bytes (1/8 of float16 KV's); a bound only ranks blocks, so its rounding
# does not matter.
BLOCK_TOKENS = 8
SUMMARY_DTYPE = mx.float16


class LayerTable:
    """Where each page of one layer lives, and which resident page to evict next."""

    def __init__(self, page_tokens: int, sink_pages: int, window_pages: int) -> None:
        self.page_tokens = page_tokens
        self.sink_pages = sink_pages
        self.window_pages = window_pages
        self.n_pages = 0
        self.slot_of = np.full(64, -1, np.int32)    # page -> RAM slot or -1
        self.on_disk = np.zeros(64, np.bool_)
        self.page_of_slot: list[int] = []           # slot -> page or -1
        self.free_slots: list[int] = []
        self.lru: OrderedDict[int, None] = OrderedDict()  # unpinned resident pages, oldest first
        self.identity = True  # slot i holds page i for every page: attention may slice
        # Per-page key summaries (Quest): element-wise min and max over the page's tokens,
        # (n_pages, kv_heads, head_dim) MLX arrays, kept in RAM whatever the page's tier.
        # New pages wait in a list and join on the next read: one concatenation per page
        # would copy the whole array each time (quadratic over a million tokens).
        self._kmin: Any = None
        self._kmax: Any = None
        self._pending: list[tuple[Any, Any]] = []
        # The same per block of BLOCK_TOKENS (at most the page), head-major so a decode step
        # bounds every block of a head with one matmul: (kv_heads, n * blocks, head_dim) for
        # pages [0, n), n = `block_pages`; attention appends them as pages are committed, or
        # catches up from the pages (restored or filled ones).
        self.block_tokens = min(BLOCK_TOKENS, page_tokens)
        self._bmin: Any = None
        self._bmax: Any = None
        self._bpending: list[tuple[Any, Any]] = []
        self.block_pages = 0
        # Question votes (engine.kv.attention, sparse mode): the exact attention weight the
        # last prompt queries gave each block, (kv_heads, blocks) float32, computed by the
        # prompt's last chunk when it ended at token `votes_at`; a later chunk replaces them.
        self.votes: Any = None
        self.votes_at = -1
        # Past the trained length, the blocks the question's wide first pass voted for
        # (engine.kv.question): (kv_heads, k) int64, best first (-1 past a head's count),
        # held by the second pass and the reply from `votes_at` (the question's first
        # position) on; or None.
        self.fixed: Any = None
        # The last decode step's shortlist (engine.kv.attention.RESELECT_STEPS): (key, next
        # position, steps it served, (bound, candidates)), or None.
        self.chosen: Any = None
        # engine.kv.cpu_select's float32 copies of the block summaries of the pages its
        # selections looked at (row of each head and page, rows used, min, max), or None;
        # forgotten on truncation.
        self.np_rows: Any = None

    # -- bookkeeping ----------------------------------------------------------------------
    def _grow(self, n: int) -> None:
        if n > len(self.slot_of):
            size = max(n, 2 * len(self.slot_of))
            self.slot_of = np.concatenate([self.slot_of,
                                           np.full(size - len(self.slot_of), -1, np.int32)])
            self.on_disk = np.concatenate([self.on_disk,
                                           np.zeros(size - len(self.on_disk), np.bool_)])

    def pinned(self, page: int) -> bool:
        return page < self.sink_pages or page >= self.n_pages - self.window_pages

    def add_page(self, slot: int) -> int:
        """Register the next page, resident in `slot`; returns its index."""
        page = self.n_pages
        self._grow(page + 1)
        self.n_pages += 1
        self.slot_of[page] = slot
        self.on_disk[page] = False
        if slot != page:
            self.identity = False
        while len(self.page_of_slot) <= slot:
            self.page_of_slot.append(-1)
        self.page_of_slot[slot] = page
        # The page leaving the window becomes evictable; the new one is pinned.
        left = page - self.window_pages
        if left >= self.sink_pages and self.slot_of[left] >= 0:
            self.lru[left] = None
        return page

    def touch(self, pages: Any) -> None:
        for p in pages:
            p = int(p)
            if p in self.lru:
                self.lru.move_to_end(p)

    def evict_candidate(self) -> int | None:
        """The least recently used unpinned resident page that is on disk, or None."""
        for p in self.lru:
            if self.on_disk[p]:
                return p
        return None

    def release(self, page: int) -> int:
        """Drop `page` from RAM (its copy on disk remains); returns the freed slot."""
        slot = int(self.slot_of[page])
        self.slot_of[page] = -1
        self.page_of_slot[slot] = -1
        self.lru.pop(page, None)
        self.free_slots.append(slot)
        self.identity = False
        return slot

    def place(self, page: int, slot: int) -> None:
        """`page`, read back from disk, now lives in `slot`."""
        self.slot_of[page] = slot
        while len(self.page_of_slot) <= slot:
            self.page_of_slot.append(-1)
        self.page_of_slot[slot] = page
        if not self.pinned(page):
            self.lru[page] = None

    def truncate(self, n_pages: int) -> list[int]:
        """Forget pages >= n_pages; returns the slots they held."""
        freed = []
        self.chosen = None
        self.np_rows = None
        for p in range(n_pages, self.n_pages):
            s = int(self.slot_of[p])
            if s >= 0:
                self.page_of_slot[s] = -1
                freed.append(s)
            self.slot_of[p] = -1
            self.on_disk[p] = False
            self.lru.pop(p, None)
        self.n_pages = n_pages
        if self.kmin is not None:
            self._kmin = self._kmin[:n_pages] if n_pages else None
            self._kmax = self._kmax[:n_pages] if n_pages else None
        if self.block_pages > n_pages:
            bmin, bmax = self.block_summaries
            nb = self.page_tokens // self.block_tokens
            self._bmin = bmin[:, :n_pages * nb] if n_pages else None
            self._bmax = bmax[:, :n_pages * nb] if n_pages else None
            self.block_pages = n_pages
        return freed

    def resident(self, pages: np.ndarray) -> np.ndarray:
        return self.slot_of[pages] >= 0

    def all_resident(self, n_pages: int) -> bool:
        return bool(n_pages == 0 or (self.slot_of[:n_pages] >= 0).all())

    @property
    def n_resident(self) -> int:
        return int((self.slot_of[: self.n_pages] >= 0).sum())

    @property
    def n_on_disk(self) -> int:
        return int(self.on_disk[: self.n_pages].sum())

    # -- summaries ------------------------------------------------------------------------
    def add_summary(self, kmin: Any, kmax: Any) -> None:
        """Append one page's (1, kv_heads, head_dim) key min and max."""
        self._pending.append((kmin, kmax))
        if len(self._pending) % 64 == 0:
            # Materialize the small summaries so the lazy graph lets go of the page tensors.
            mx.eval(self._pending[-64:])

    def _join(self) -> None:
        head = [] if self._kmin is None else [self._kmin]
        self._kmin = mx.concatenate(head + [a for a, _ in self._pending])
        head = [] if self._kmax is None else [self._kmax]
        self._kmax = mx.concatenate(head + [b for _, b in self._pending])
        self._pending = []

    @property
    def kmin(self) -> Any:
        """(n_pages, kv_heads, head_dim) element-wise key minimum per page, or None."""
        if self._pending:
            self._join()
        return self._kmin

    @property
    def kmax(self) -> Any:
        if self._pending:
            self._join()
        return self._kmax

    def set_votes(self, votes: Any, at: int, fixed: Any = None) -> None:
        """The question's votes (kv_heads, blocks) of a chunk that ended at token `at`, or
        the blocks a wide first pass fixed (`fixed`) for the chunk starting at `at`."""
        self.votes, self.votes_at, self.fixed = votes, at, fixed

    def add_blocks(self, bmin: Any, bmax: Any) -> None:
        """Append the block summaries of pages [block_pages, block_pages + n): (n, kv_heads,
        blocks, head_dim) element-wise key min and max per block."""
        self._bpending.append((bmin.astype(SUMMARY_DTYPE), bmax.astype(SUMMARY_DTYPE)))
        self.block_pages += int(bmin.shape[0])
        if len(self._bpending) % 64 == 0:
            mx.eval(self._bpending[-64:])  # let go of the page tensors (as add_summary)

    @property
    def block_summaries(self) -> tuple[Any, Any]:
        """(kv_heads, block_pages * blocks, head_dim) key min and max per block (block j of
        page i at i * blocks + j), or Nones."""
        if self._bpending:
            def head_major(a: Any) -> Any:
                n, h, nb, d = a.shape
                return a.transpose(1, 0, 2, 3).reshape(h, n * nb, d)

            # One concatenation per read, not per page (a new page is one every P steps).
            head = [] if self._bmin is None else [self._bmin]
            self._bmin = mx.concatenate(head + [head_major(a) for a, _ in self._bpending], 1)
            head = [] if self._bmax is None else [self._bmax]
            self._bmax = mx.concatenate(head + [head_major(b) for _, b in self._bpending], 1)
            self._bpending = []
        return self._bmin, self._bmax

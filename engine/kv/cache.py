"""The per-layer cache object that mlx-lm's models take: full pages in the store, a tail here.

Contract: `LayerCache` is the vocabulary both mlx_lm.models.cache.KVCache and
`PagedLayerCache` speak (offset, update_and_fetch, state, trim, is_trimmable, nbytes): the
typed seam between the runtime and any layer cache. `update_and_fetch` commits every page the
chunk completes and returns the chunk itself; the hooked attention then reads what the cache
held before the chunk (`view`) plus the chunk, so nothing is gathered twice. While the layer
holds at most CONTIG_MAX full-precision positions that its RAM tier could hold, they are also
in one contiguous buffer written in place, and `contig` (all positions, the chunk's last) is
what attention reads instead: mlx-lm's KVCache ops. The buffer is then the store's RAM tier
for the layer (KVStore.buffer_layer): its full pages are committed (summaries; the prefix
cache reads them from it) without a second copy in RAM, and copied into the tier's slots,
and written to the SSD tier, only when the buffer goes (past CONTIG_MAX, or when the store
needs slots).
`WindowLayerCache` is a sliding-window layer's KV, bounded and in RAM (a window of W
positions never pages): it keeps the last W - 1 positions plus `slack` (so that a follow-up
prompt may trim that many), returns from `update_and_fetch` exactly the positions the chunk
attends to, and its `make_mask` is the sliding causal mask over them; mlx-lm's own attention
function runs on it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from engine.kv.store import KVStore


@runtime_checkable
class LayerCache(Protocol):
    """One layer's KV as mlx-lm's attention uses it (mlx-lm's caches satisfy it as they are)."""

    offset: int

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]: ...

    @property
    def state(self) -> Any: ...

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int: ...

    @property
    def nbytes(self) -> int: ...


# While a layer holds at most this many positions (and its pages are full precision), they
# are also kept in one contiguous buffer, grown CONTIG_STEP positions at a time as mlx-lm's
# KVCache grows: a decode step then writes its token in place and attention is one fused call
# over a slice, the ops mlx-lm's cache runs (the page-wise path built twice its graph at depth
# 0, docs/benchmarks.md). The buffer is the layer's RAM tier meanwhile (one copy of the KV);
# past the limit its pages move into the tier's slots and the buffer is dropped.
CONTIG_MAX = int(os.environ.get("STRATA_KV_CONTIG_MAX") or 16384)
CONTIG_STEP = 256


class PagedLayerCache:
    """One layer's view of a KVStore; positions [0, offset) are in pages plus the tail."""

    def __init__(self, store: KVStore, layer: int) -> None:
        self.store = store
        self.layer = layer
        self.offset = 0
        self._tail_k: Any = None  # (1, kv_heads, t, head_dim), t < page_tokens
        self._tail_v: Any = None
        self.view: tuple[int, Any, Any] = (0, None, None)
        # The tail before the last chunk plus that chunk (1, kv_heads, t, head_dim), keys and
        # values: what attention reads besides the pages (built once, here).
        self.recent: tuple[Any, Any] | None = None
        # The contiguous copy: (1, kv_heads, capacity, head_dim), positions [0, buf_len);
        # `contig` is positions [0, offset) of it after the last chunk, or None when the
        # buffer does not hold them (attention then reads the pages).
        self.buf_k: Any = None
        self.buf_v: Any = None
        self.buf_len = 0
        self.contig: tuple[Any, Any] | None = None
        self.contig_max = 0
        self.follow_settings()

    # The tail: while the buffer is used, a copy of its positions after the last page (a
    # held slice would keep the buffer alive past the next in-place write, which then
    # copies it: a second KV in RAM while, say, a reply's tail snapshot waits), else its
    # own arrays. Setting it from outside (a restored prefix) leaves the buffer behind.
    @property
    def tail_k(self) -> Any:
        return self._buffer_tail(self.buf_k, copy=True) if self._buffered() else self._tail_k

    @tail_k.setter
    def tail_k(self, a: Any) -> None:
        self._drop_buffer(keep_tail=False)
        self._tail_k = a

    @property
    def tail_v(self) -> Any:
        return self._buffer_tail(self.buf_v, copy=True) if self._buffered() else self._tail_v

    @tail_v.setter
    def tail_v(self, a: Any) -> None:
        self._drop_buffer(keep_tail=False)
        self._tail_v = a

    def _buffered(self) -> bool:
        return self.buf_k is not None and self.buf_len == self.offset

    def _buffer_tail(self, buf: Any, copy: bool = False) -> Any:
        t0 = self.store.tables[self.layer].n_pages * self.store.P
        if self.offset <= t0:
            return None
        if not copy:
            return buf[:, :, t0:self.offset]
        # A gather, not mx.contiguous: a slice that is already contiguous (one KV head)
        # would come back as the same view of the buffer.
        out = mx.take(buf, mx.arange(t0, self.offset), axis=2)
        mx.eval(out)
        return out

    def follow_settings(self) -> None:
        """Size the buffer for the store's settings as they are now. A benchmark that
        switches a store from exact to sparse mode calls this. Past a sparse budget the
        next update then lets the buffer go and attention reads the pages. Without this, a
        buffer built in exact mode kept every position, so the "sparse" runs within 16k
        attended everything."""
        s = self.store.settings
        self.contig_max = 0 if self.store.codec.quantized else (
            min(CONTIG_MAX, s.budget_tokens) if s.mode == "sparse" else CONTIG_MAX)

    def release_buffer(self) -> None:
        """Let go of the buffer, its pages copied into the store's slots and the tail kept
        (the store asks, before an operation that needs slots)."""
        self._drop_buffer()

    def _drop_buffer(self, keep_tail: bool = True) -> None:
        if self.buf_k is None:
            return
        self.store.unbuffer_layer(self.layer)  # its pages into the RAM tier's slots first
        if keep_tail and self._buffered():
            k = self._buffer_tail(self.buf_k, copy=True)
            v = self._buffer_tail(self.buf_v, copy=True)
            self._tail_k, self._tail_v = k, v
        self.buf_k = self.buf_v = None
        self.buf_len = 0
        self.contig = None

    def _fill_buffer(self, keys: Any, values: Any) -> bool:
        """Write the chunk into the buffer (building it from the pages if it does not hold
        the positions before); False when the buffer cannot be used for it."""
        prev, n = self.offset, keys.shape[2]
        # Only while the RAM tier holds every page too: past it the buffer would be RAM the
        # budget does not allow, and attention reads the pages from the SSD tier as it must.
        limit = min(self.contig_max, self.store.max_slots * self.store.P)
        if prev + n > limit or keys.dtype != self.store.dtype:
            self._drop_buffer()
            return False
        if not self._buffered():
            # Restored, trimmed past, or never built: from resident pages plus the tail.
            table = self.store.tables[self.layer]
            parts = [self._tail_k, self._tail_v]
            view: tuple[Any, Any] = (None, None)
            if table.n_pages:
                got = self.store.resident_view(self.layer, table.n_pages)
                if got is None:
                    self._drop_buffer()
                    return False
                view = got
            self._drop_buffer(keep_tail=False)
            ks, vs = [], []
            if view[0] is not None:
                pn, h, p, d = view[0].shape
                ks.append(view[0].transpose(1, 0, 2, 3).reshape(1, h, pn * p, d))
                vs.append(view[1].transpose(1, 0, 2, 3).reshape(1, h, pn * p, -1))
            if parts[0] is not None:
                ks.append(parts[0])
                vs.append(parts[1])
            if ks:
                k0 = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
                v0 = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
                assert k0.shape[2] == prev
                self._grow(prev + n, keys, values)
                self.buf_k[:, :, :prev] = k0
                self.buf_v[:, :, :prev] = v0
                mx.eval(self.buf_k, self.buf_v)  # the pages' slots go next: copy them now
            else:
                self._grow(prev + n, keys, values)
            self._tail_k = self._tail_v = None
            # The buffer is the layer's RAM tier from here: its slots are freed.
            self.store.buffer_layer(self.layer, self)
        if self.buf_k is None or prev + n > self.buf_k.shape[2]:
            self._grow(prev + n, keys, values)
        self.buf_k[:, :, prev:prev + n] = keys
        self.buf_v[:, :, prev:prev + n] = values
        self.buf_len = prev + n
        return True

    def _grow(self, need: int, keys: Any, values: Any) -> None:
        cap = min(-(-need // CONTIG_STEP) * CONTIG_STEP, max(need, self.contig_max))
        b, h, _, dk = keys.shape
        nk = mx.zeros((b, h, cap, dk), keys.dtype)
        nv = mx.zeros((b, h, cap, values.shape[3]), values.dtype)
        if self.buf_k is not None and self.buf_len:
            nk[:, :, :self.buf_len] = self.buf_k[:, :, :self.buf_len]
            nv[:, :, :self.buf_len] = self.buf_v[:, :, :self.buf_len]
        self.buf_k, self.buf_v = nk, nv

    # -- the KVCache vocabulary -----------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        table = self.store.tables[self.layer]
        n_pages, p = table.n_pages, self.store.P
        self.recent = self.contig = None  # let go of the last step's slices first
        if self._fill_buffer(keys, values):
            end = self.offset + keys.shape[2]
            t0 = n_pages * p
            bk, bv = self.buf_k, self.buf_v
            full = (end - t0) // p
            if full:
                mx.eval(bk, bv)
            for i in range(full):
                # The page is these positions of the buffer: the store takes its summaries
                # now, so no slice outlives this call (a held slice would make the next
                # in-place write copy the whole buffer).
                a, b = t0 + i * p, t0 + (i + 1) * p
                self.store.commit_buffered(self.layer, bk[0, :, a:b], bv[0, :, a:b])
            # Attention reads `contig` alone (no tail or recent slices to build each step).
            self.view = (n_pages, None, None)
            self.contig = (bk[:, :, :end], bv[:, :, :end])
            self.offset = end
            return keys, values
        self.view = (n_pages, self._tail_k, self._tail_v)
        self.store.write_behind(self.layer)  # a few pages a step of a buffer let go
        if self._tail_k is None:
            k, v = keys, values
        else:
            k = mx.concatenate([self._tail_k, keys], axis=2)
            v = mx.concatenate([self._tail_v, values], axis=2)
        self.recent = (k, v)
        full = k.shape[2] // p
        for i in range(full):
            self.store.commit(self.layer, k[0, :, i * p:(i + 1) * p], v[0, :, i * p:(i + 1) * p])
        rest = k.shape[2] - full * p
        if rest:
            self._tail_k, self._tail_v = k[:, :, full * p:], v[:, :, full * p:]
        else:
            self._tail_k = self._tail_v = None
        self.offset += keys.shape[2]
        return keys, values

    @property
    def state(self) -> list[Any]:
        s = self.store
        extra = [self.buf_k, self.buf_v] if self.buf_k is not None else [self._tail_k,
                                                                         self._tail_v]
        arrays = [*(s.pool_k[self.layer] or ()), *(s.pool_v[self.layer] or ()), *extra]
        return [a for a in arrays if a is not None]

    @state.setter
    def state(self, v: Any) -> None:
        raise NotImplementedError("a paged KV cache is restored from its store, not a state")

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.offset), str(self.store.P))

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the last n positions; a page that becomes partial moves back to the tail."""
        n = min(self.offset, n)
        if n == 0:
            return 0
        target = self.offset - n
        p = self.store.P
        keep, rest = divmod(target, p)
        table = self.store.tables[self.layer]
        self.recent = self.contig = None
        if self._buffered():
            # The buffer still holds [0, target): only the pages past it go.
            if keep < table.n_pages:
                self.store.truncate(self.layer, keep)
            self.offset = self.buf_len = target
            return n
        if keep < table.n_pages:
            tail_k = tail_v = None
            if rest:
                k, v = self.store.page_np(self.layer, keep)
                tail_k, tail_v = k[None, :, :rest], v[None, :, :rest]
            self.store.truncate(self.layer, keep)
            self._tail_k, self._tail_v = tail_k, tail_v
        elif self._tail_k is not None:
            self._tail_k = self._tail_k[:, :, :rest] if rest else None
            self._tail_v = self._tail_v[:, :, :rest] if rest else None
        if self._tail_k is not None:
            # Detach from the old page buffer so the pool can be updated in place.
            self._tail_k, self._tail_v = mx.contiguous(self._tail_k), mx.contiguous(self._tail_v)
            mx.eval(self._tail_k, self._tail_v)
        self.offset = target
        return n

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None
                  ) -> Any:
        # The paged attention builds its own causal mask; mlx-lm only needs a placeholder.
        if window_size is not None:
            raise NotImplementedError("paged KV cache: sliding-window attention")
        return None if n == 1 else "causal"

    @property
    def nbytes(self) -> int:
        """RAM held for this layer: the contiguous buffer (its pages and tail: the RAM tier
        holds no other copy of them), or resident pages (as stored: quantized pages count
        their encoded size) plus the tail (as computed)."""
        if self.buf_k is not None:
            return int(self.buf_k.nbytes) + int(self.buf_v.nbytes)
        table = self.store.tables[self.layer]
        tail = 0 if self._tail_k is None else 2 * int(self._tail_k.nbytes)
        return table.n_resident * self.store.page_bytes + tail


# A window cache's buffer grows by this many positions at a time (as mlx-lm's KVCache).
WINDOW_STEP = 256


class WindowLayerCache:
    """One sliding-window layer's KV in RAM: positions [start, offset) in a buffer."""

    def __init__(self, store: KVStore, window: int, slack: int = WINDOW_STEP) -> None:
        self.store = store  # the paged layers' store of the same model (telemetry, closing)
        self.window = window
        self.retain = window - 1 + slack
        self.keys: Any = None  # (1, kv_heads, capacity, key dim); position start at index 0
        self.values: Any = None
        self.start = 0
        self.offset = 0

    def _past(self) -> int:
        """Positions before the next chunk that it attends to."""
        return min(self.offset - self.start, self.window - 1)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        n, L = self.offset - self.start, keys.shape[2]
        if self.keys is None or n + L > self.keys.shape[2]:
            # Compact: keep what a later chunk (or a trim of `slack`) may need, then room.
            r = min(n, self.retain)
            cap = -(-(r + L + WINDOW_STEP) // WINDOW_STEP) * WINDOW_STEP
            b, h, _, dk = keys.shape
            nk = mx.zeros((b, h, cap, dk), keys.dtype)
            nv = mx.zeros((b, h, cap, values.shape[3]), values.dtype)
            if r:
                nk[..., :r, :] = self.keys[..., n - r:n, :]
                nv[..., :r, :] = self.values[..., n - r:n, :]
            self.keys, self.values = nk, nv
            self.start, n = self.offset - r, r
        past = min(n, self.window - 1)
        self.keys[..., n:n + L, :] = keys
        self.values[..., n:n + L, :] = values
        self.offset += L
        return self.keys[..., n - past:n + L, :], self.values[..., n - past:n + L, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None
                  ) -> Any:
        """The mask over what `update_and_fetch` returns for a chunk of n: query i (position
        offset + i) sees the keys at most window - 1 positions before it, and itself."""
        past = self._past()
        total = past + n
        if not return_array and (n == 1 or total <= self.window):
            return None if n == 1 else "causal"
        q = mx.arange(n)[:, None] + past
        k = mx.arange(total)[None]
        return (k <= q) & (k > q - self.window)

    @property
    def state(self) -> list[Any]:
        return [a for a in (self.keys, self.values) if a is not None]

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def can_trim(self, n: int) -> bool:
        """Whether trimming n positions leaves every position the next step needs."""
        target = self.offset - min(n, self.offset)
        return self.start == 0 or target - self.start >= self.window - 1

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        if not self.can_trim(n):
            raise ValueError(f"window cache: {n} positions cannot be trimmed (window "
                             f"{self.window}, {self.offset - self.start} held)")
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        """RAM held: the whole buffer (at most window + slack + a step of positions)."""
        if self.keys is None:
            return 0
        return int(self.keys.nbytes) + int(self.values.nbytes)


def trimmable(cache: Any, n: int) -> bool:
    """Whether `cache` (any layer cache) can forget its last n positions."""
    if isinstance(cache, WindowLayerCache):
        return cache.can_trim(n)
    return bool(cache.is_trimmable())


def close_caches(caches: Sequence[LayerCache]) -> None:
    """Stop the store's threads and remove its session files (unless kept)."""
    stores = {id(c.store): c.store for c in caches
              if isinstance(c, PagedLayerCache | WindowLayerCache)}
    for s in stores.values():
        s.close()


def shared_bytes(caches: Iterable[LayerCache]) -> int:
    """Bytes of pages these caches map from the prefix cache's files (a restored prefix:
    shared with the SSD store, not copied)."""
    stores = {id(c.store): c.store for c in caches if isinstance(c, PagedLayerCache)}
    return sum(int(s.stats()["bytes_shared"]) for s in stores.values())


def ssd_bytes(caches: Iterable[LayerCache]) -> int:
    """Bytes the SSD tier holds for these caches (each store counted once; mlx-lm's: 0)."""
    stores = {id(c.store): c.store for c in caches
              if isinstance(c, PagedLayerCache | WindowLayerCache)}
    return sum(int(s.stats()["bytes_ssd"]) for s in stores.values())

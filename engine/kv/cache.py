"""The per-layer cache object that mlx-lm's models take: full pages in the store, a tail here.

Contract: `LayerCache` is the vocabulary both mlx_lm.models.cache.KVCache and
`PagedLayerCache` speak (offset, update_and_fetch, state, trim, is_trimmable, nbytes): the
typed seam between the runtime and any layer cache. `update_and_fetch` commits every page the
chunk completes and returns the chunk itself; the hooked attention then reads what the cache
held before the chunk (`view`) plus the chunk, so nothing is gathered twice.
`WindowLayerCache` is a sliding-window layer's KV, bounded and in RAM (a window of W
positions never pages): it keeps the last W - 1 positions plus `slack` (so that a follow-up
prompt may trim that many), returns from `update_and_fetch` exactly the positions the chunk
attends to, and its `make_mask` is the sliding causal mask over them; mlx-lm's own attention
function runs on it.
"""

from __future__ import annotations

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


class PagedLayerCache:
    """One layer's view of a KVStore; positions [0, offset) are in pages plus the tail."""

    def __init__(self, store: KVStore, layer: int) -> None:
        self.store = store
        self.layer = layer
        self.offset = 0
        self.tail_k: Any = None  # (1, kv_heads, t, head_dim), t < page_tokens
        self.tail_v: Any = None
        self.view: tuple[int, Any, Any] = (0, None, None)
        # The tail before the last chunk plus that chunk (1, kv_heads, t, head_dim), keys and
        # values: what attention reads besides the pages (built once, here).
        self.recent: tuple[Any, Any] | None = None

    # -- the KVCache vocabulary -----------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        table = self.store.tables[self.layer]
        self.view = (table.n_pages, self.tail_k, self.tail_v)
        if self.tail_k is None:
            k, v = keys, values
        else:
            k = mx.concatenate([self.tail_k, keys], axis=2)
            v = mx.concatenate([self.tail_v, values], axis=2)
        self.recent = (k, v)
        p = self.store.P
        full = k.shape[2] // p
        for i in range(full):
            self.store.commit(self.layer, k[0, :, i * p:(i + 1) * p], v[0, :, i * p:(i + 1) * p])
        rest = k.shape[2] - full * p
        if rest:
            self.tail_k, self.tail_v = k[:, :, full * p:], v[:, :, full * p:]
        else:
            self.tail_k = self.tail_v = None
        self.offset += keys.shape[2]
        return keys, values

    @property
    def state(self) -> list[Any]:
        s = self.store
        arrays = [*(s.pool_k[self.layer] or ()), *(s.pool_v[self.layer] or ()), self.tail_k,
                  self.tail_v]
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
        if keep < table.n_pages:
            tail_k = tail_v = None
            if rest:
                k, v = self.store.page_np(self.layer, keep)
                tail_k, tail_v = k[None, :, :rest], v[None, :, :rest]
            self.store.truncate(self.layer, keep)
            self.tail_k, self.tail_v = tail_k, tail_v
        elif self.tail_k is not None:
            self.tail_k = self.tail_k[:, :, :rest] if rest else None
            self.tail_v = self.tail_v[:, :, :rest] if rest else None
        if self.tail_k is not None:
            # Detach from the old page buffer so the pool can be updated in place.
            self.tail_k, self.tail_v = mx.contiguous(self.tail_k), mx.contiguous(self.tail_v)
            mx.eval(self.tail_k, self.tail_v)
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
        """RAM held for this layer: resident pages (as stored: quantized pages count their
        encoded size) plus the tail (as computed)."""
        table = self.store.tables[self.layer]
        tail = 0 if self.tail_k is None else 2 * int(self.tail_k.nbytes)
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

"""KV for the KV suites: paged caches, and a synthetic fill (one real prefill, tiled to any
length) for long-context decode benchmarks.

Contract: `paged_cache(model, settings, dtype)` is engine.kv's paged cache for a model (pages
in `dtype`, None: the model's) with the one store behind it. `doc_kv(lm, n)` prefills a real
document of n tokens (whole pages) with mlx-lm's KVCache and keeps its keys (after RoPE),
values and last logits. `tiled_mlx_cache(doc, n)` returns mlx-lm KVCaches holding n tokens
that repeat the document's KV; `fill_paged(caches, doc, n)` commits the same n tokens into a
paged store through its ordinary commit path (RAM tier, write-through to the SSD tier by the
store's writer). The values are the model's own, but positions repeat every document length:
right for decode speed, memory and I/O (exact attention costs the same whatever the values),
meaningless for what the model answers. Anything reporting a figure measured this way must
say "synthetic fill".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.bench.common import prompt_ids
from engine.errors import StrataError
from engine.kv import (
    KVSettings,
    KVStore,
    PagedLayerCache,
    geometry_of,
    make_paged_cache,
)
from engine.runtime.model import cache_module
from engine.telemetry import CancelFlag, Progress


def paged_cache(model: Any, settings: KVSettings, dtype: str | None = None
                ) -> tuple[list[PagedLayerCache], KVStore]:
    """One paged cache per layer over a fresh store, and the store (its counters and stats
    are what the suites report)."""
    caches = make_paged_cache(model, settings, geometry_of(model, dtype))
    paged = [c for c in caches if isinstance(c, PagedLayerCache)]
    if len(paged) != len(caches):
        # The fills tile one layer's pages; a sliding layer keeps a window instead.
        raise StrataError("KV fill: the model has sliding-window layers; the fill suites "
                          "measure full-attention models")
    return paged, paged[0].store


class FillCancelled(Exception):
    """The cancel callback asked to stop a fill (the store holds what was committed)."""


@dataclass
class DocKV:
    """Every layer's KV of one real prefill: keys[i], values[i] are (1, kv_heads, n, dim)."""

    ids: list[int]
    keys: list[Any]
    values: list[Any]
    logits: Any          # (1, vocab) after the document's last token
    prefill_s: float

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        return sum(int(k.nbytes) + int(v.nbytes) for k, v in zip(self.keys, self.values,
                                                                   strict=True))


def doc_kv(lm: Any, n_tokens: int, page_tokens: int = 128, progress: Progress | None = None,
           dtype: Any = None) -> DocKV:
    """Prefill `n_tokens` (rounded down to whole pages) of the benchmark filler text with
    mlx-lm's KVCache; keys and values are cast to `dtype` if given."""
    n = max(page_tokens, n_tokens // page_tokens * page_tokens)
    ids = prompt_ids(lm.tokenizer, n)
    cache = cache_module().make_prompt_cache(lm.model)
    t = time.perf_counter()
    logits = None
    for i in range(0, n, 512):
        logits = lm.model(mx.array(ids[i:i + 512])[None], cache=cache)[:, -1, :]
        mx.eval(logits, [c.keys for c in cache])
        if progress is not None:
            progress(min(n, i + 512), n)
    keys, values = [], []
    for c in cache:
        k, v = c.keys[..., :n, :], c.values[..., :n, :]
        if dtype is not None:
            k, v = k.astype(dtype), v.astype(dtype)
        keys.append(mx.contiguous(k))
        values.append(mx.contiguous(v))
    mx.eval(keys, values)
    return DocKV(ids, keys, values, logits, time.perf_counter() - t)


def tiled_mlx_cache(doc: DocKV, n_tokens: int) -> list[Any]:
    """mlx-lm KVCaches holding `n_tokens` positions that repeat the document's KV, with room
    for 256 more (as mlx-lm's own growth step) so the first decode steps do not copy it."""
    reps, rest = divmod(n_tokens, doc.tokens)
    step = 256
    cap = (n_tokens + step - 1) // step * step + step
    caches = []
    for k, v in zip(doc.keys, doc.values, strict=True):
        def tile(a: Any) -> Any:
            parts = [a] * reps + ([a[..., :rest, :]] if rest else [])
            b, h, _, d = a.shape
            parts.append(mx.zeros((b, h, cap - n_tokens, d), a.dtype))
            return mx.concatenate(parts, axis=2)

        c = cache_module().KVCache()
        c.keys, c.values, c.offset = tile(k), tile(v), n_tokens
        mx.eval(c.keys, c.values)
        caches.append(c)
    return caches


def fill_paged(caches: list[Any], doc: DocKV, n_tokens: int, progress: Progress | None = None,
               cancel: CancelFlag | None = None, chunk: int = 4096) -> None:
    """Append `n_tokens` positions repeating the document's KV to fresh paged caches, through
    `update_and_fetch` (so the store's commit path, its RAM budget and its writer do the
    work). Raises FillCancelled if `cancel()` turns True between chunks."""
    chunk = min(chunk, doc.tokens)
    done = 0
    while done < n_tokens:
        if cancel is not None and cancel():
            raise FillCancelled(f"synthetic fill stopped at {done} tokens")
        a = done % doc.tokens
        b = min(doc.tokens, a + chunk, a + n_tokens - done)
        for c, k, v in zip(caches, doc.keys, doc.values, strict=True):
            c.update_and_fetch(k[..., a:b, :], v[..., a:b, :])
        # Evaluate the RAM tier now: a lazy chain of page writes would hold every chunk.
        mx.eval([c.state for c in caches])
        done += b - a
        if progress is not None:
            progress(done, n_tokens)


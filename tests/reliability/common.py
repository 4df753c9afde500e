"""Shared pieces of the reliability tests: tiny model files, page contents, a hang guard.

Contract: everything here is cheap (no model load) and deterministic from its arguments, so
a child process and the test that checks its files build the same expected bytes.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

# The tiny model every import test uses: one layer, 64 wide, Q8_0 weights, a trained BPE.
TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=128, layers=1)

# KV page layout used by the page-file and prefix-cache tests.
LAYERS, KV_HEADS, HEAD_DIM, PAGE = 2, 2, 8, 8


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A tiny random-weight llama GGUF (about 70 KB) from the factory the importers test."""
    from tests.engine.gguf_factory import ModelSpec, bpe_vocab, write_gguf

    vocab, _ = bpe_vocab()
    write_gguf(path, ModelSpec(**TINY), "Q8_0", vocab, seed=seed)  # type: ignore[arg-type]
    return path


def page_arrays(layer: int, index: int, generation: int, shape: tuple[int, ...]
                ) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values written as page `index` of `layer` in write round `generation`."""
    rng = np.random.default_rng([layer, index, generation])
    k = rng.standard_normal(shape).astype(np.float32)
    return k, -k


def prefix_prompt(n_pages: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 50_000, n_pages * PAGE + 1)]


def prefix_pages(n_pages: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer (kv_heads, n_pages * PAGE, head_dim) keys and values for a prefix job."""
    rng = np.random.default_rng(1000 + seed)
    shape = (KV_HEADS, n_pages * PAGE, HEAD_DIM)
    ks = [rng.standard_normal(shape).astype(np.float32) for _ in range(LAYERS)]
    return ks, [-k for k in ks]


def new_prefix_cache(folder: Path, key: bytes = b"k" * 32) -> Any:
    from engine.kv.prefix import PrefixCache, PrefixSettings

    return PrefixCache(key, LAYERS, KV_HEADS, HEAD_DIM, "float32",
                       PrefixSettings(folder=folder, page_tokens=PAGE, budget_mb=64, flush_s=5))


def write_prefix_pages(cache: Any, prompt: list[int], n_pages: int, seed: int = 0) -> None:
    """Write the prompt's first n_pages pages as one run, synchronously (the writer's code)."""
    from engine.kv.prefix import _Job, chain_hashes

    hashes = chain_hashes(prompt, PAGE, cache.key, n_pages)
    ks, vs = prefix_pages(n_pages, seed)
    pages = [(d, hashes[d - 1] if d else bytes(32), hashes[d],
              np.asarray(prompt[d * PAGE:(d + 1) * PAGE], "<u4")) for d in range(n_pages)]
    cache._write_run(_Job(pages, ks, vs, 0))


def read_prefix_page(cache: Any, prompt: list[int], depth: int
                     ) -> tuple[bool, list[np.ndarray], list[np.ndarray]]:
    """Look the prompt up and read its pages up to `depth` through the cache's verifying
    reader into fresh buffers; (page `depth` verified, its keys, its values)."""
    plan = cache.lookup(prompt)
    plan.hit_pages = min(plan.hit_pages, depth + 1)
    shape = (1, KV_HEADS, (depth + 1) * PAGE, HEAD_DIM)
    ks = [np.zeros(shape, np.float32) for _ in range(LAYERS)]
    vs = [np.zeros(shape, np.float32) for _ in range(LAYERS)]
    good = cache.read_pages(plan, prompt, ks, vs) if plan.hit_pages > depth else 0
    sl = slice(depth * PAGE, (depth + 1) * PAGE)
    return good > depth, [k[:, :, sl] for k in ks], [v[:, :, sl] for v in vs]


class Hang(Exception):
    """A guarded call ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise Hang in the main thread after `seconds` (a loop in Python code cannot hide)."""

    def fire(signum: int, frame: FrameType | None) -> None:
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)

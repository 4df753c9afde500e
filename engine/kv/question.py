"""The question past the trained length, read twice: a wide read votes, a narrow one answers.

Contract: `applies(spec, end)` says whether a question ending at `end` is read twice; while
`wide(store)` holds (engine.kv.attention.ask sets it for the question's first pass), the
question's chunk past the trained length attends `wide_budget(spec)` tokens and records,
per layer and KV head, the softmax weight its rows give each chosen block;
`fixed_blocks(weights, blocks, ...)` turns them into the blocks the second pass and the
reply hold: the FIXED_VOTES best with FIXED_NEIGHBOURS blocks either side, best first,
one row per head. Those then read `narrow_budget(spec, end)` tokens: the fixed blocks, then
what each step chooses as if none were fixed, cut to the budget. No state here but the set
of stores in a wide pass.

Why: at 32k (four times the starter's trained 8k) the starter answered from remapped
positions only when its question and its answer both read the fact from a small read
(768-2,048 tokens): with the fact forced in, found at 5 of 5 depths; at 4,096 never. The
bound and the far rescoring alone rank the fact's blocks low at 32k, but the question's own
attention weights, over a wide read of 6,144 tokens, rank them near the top (0-13th of 432
in most heads of layers 14-23). A narrow read then has room for little else, and at 16k
the answer needs a wider one than at 32k (docs/benchmarks.md, issue 19, 2026-12-07/08).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np

from engine.kv import remap

# The question's first pass reads this share of the trained length (6,144 of 8,192 tokens for
# the starter). STRATA_SPARSE_WIDE=0 turns the two passes off (one pass, the decode budget).
WIDE_SHARE = float(os.environ.get("STRATA_SPARSE_WIDE") or 0.75)
# The second pass and the reply hold the FIXED_VOTES best-voted blocks of each head, each
# with FIXED_NEIGHBOURS blocks either side (a fact's sentence spans two or three 8-token
# blocks, and the votes mark its most-read one).
FIXED_VOTES = 48
FIXED_NEIGHBOURS = 1
# Only up to this many times the trained length, where it was measured (2x and 4x): past
# it the question goes once, as before. The wide pass reads ~3.5x the pages a decode budget
# of 2,048 reads: after 128k stored tokens (16x) it took the first token from 2.3 s to 8.6 s
# and peak RSS from 2.4 to 3.4 GB (issue 18 asks 2 s and 3 GB), for retrieval there that
# nothing measured. STRATA_SPARSE_WIDE_MAX sets it.
WIDE_MAX = float(os.environ.get("STRATA_SPARSE_WIDE_MAX") or 4)

_wide: weakref.WeakSet[Any] = weakref.WeakSet()


def wide(store: Any) -> bool:
    """Whether `store`'s question is in its first (wide) pass."""
    return store in _wide


def set_wide(store: Any, on: bool) -> None:
    if on:
        _wide.add(store)
    else:
        _wide.discard(store)


def applies(spec: remap.RopeSpec, end: int) -> bool:
    """Whether a question ending at token `end` past `spec`'s trained length is read twice:
    two passes on (WIDE_SHARE) and `end` within WIDE_MAX x the trained length."""
    return WIDE_SHARE > 0 and end <= WIDE_MAX * spec.trained


def wide_budget(spec: remap.RopeSpec) -> int:
    """The first pass's tokens: WIDE_SHARE of the trained length."""
    return int(WIDE_SHARE * spec.trained)


def narrow_budget(spec: remap.RopeSpec, end: int) -> int:
    """The second pass's and the reply's tokens at a context ending at `end`: 3/8 of the
    trained length T at 2T, falling as 1/end to T/4 (reached at 3T). In the scratch that
    chose these (the starter): at 16k (2T) 3,072 found 5 of 5 facts, 2,048 3 of 5; at 32k
    (4T) 2,048 found 5 of 5, 3,072 2 of 3; the suite then found 4 of 5 at each
    (docs/benchmarks.md). Beyond WIDE_MAX x T the question goes once."""
    t = spec.trained
    return max(t // 4, min(3 * t // 8, 3 * t * t // (4 * max(end, 1))))


def fixed_blocks(weights: np.ndarray, blocks: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Per head, the FIXED_VOTES blocks of most weight (weights (H, n) for blocks (H, n)),
    each after its left neighbour and before its right one, within [lo, hi), without
    repeats: (H, k) block indices, best first, k the longest head's count, the shorter
    rows ending in -1."""
    rows: list[list[int]] = []
    for w, blk in zip(weights, blocks, strict=True):
        row: list[int] = []
        seen: set[int] = set()
        for i in np.argsort(-w, kind="stable")[:FIXED_VOTES]:
            for x in range(int(blk[i]) - FIXED_NEIGHBOURS, int(blk[i]) + FIXED_NEIGHBOURS + 1):
                if lo <= x < hi and x not in seen:
                    seen.add(x)
                    row.append(x)
        rows.append(row)
    out = np.full((len(rows), max(map(len, rows), default=0)), -1, np.int64)
    for h, row in enumerate(rows):
        out[h, :len(row)] = row
    return out

"""Pass-key retrieval over the paged KV cache: exact and sparse decoding from one prefill.

Contract: `passkey_prompt(tokenizer, n_tokens, depth, key)` builds a chat prompt (the model's
own template) of about `n_tokens` tokens with a 5-digit key hidden at `depth` (0..1) of its
filler. `run_passkey(lm, lengths, depths, modes, ...)` prefills each prompt once through the
paged cache (all but its last token) and lets every mode decode from those same pages: the
last prompt token and the answer are decode steps, so sparse selection is what finds the key.
A cell is found when the key's five digits appear in the greedy answer. Results arrive through
`on_cell` as they finish; `cancel()` returning True stops before the next cell.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.bench.fill import paged_cache
from engine.kv import KVSettings, close_caches

# The filler and question of the pass-key test as the long-context literature writes it
# (Mohtashami & Jaggi, "Landmark Attention", 2023): repetitive text the key must stand out of.
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again. ")
INTRO = ("There is an important pass key hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about the pass key.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? Answer with the five digits of the pass key."
# Said for the assistant, after the template's generation prompt: the answer starts here.
ANSWER_PREFIX = "The pass key is"
MAX_ANSWER_TOKENS = 12


@dataclass(frozen=True)
class PasskeyCell:
    """One (length, depth, mode) result."""

    length: int          # tokens in the prompt (as built, close to the asked length)
    target: int          # the asked length
    depth: float         # where the key sits in the filler, 0..1
    mode: str
    budget_tokens: int   # sparse: attention budget per query; exact: the context
    key: str
    answer: str
    found: bool
    decode_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def passkey_prompt(tokenizer: Any, n_tokens: int, depth: float, key: str) -> list[int]:
    """Token ids of a chat prompt of about n_tokens with `key` at `depth` of the filler."""
    def chat(filler_units: int, at: int) -> str:
        before = FILLER * at
        after = FILLER * (filler_units - at)
        user = INTRO + before + NEEDLE.format(key=key) + after + QUESTION
        return tokenizer.render_chat([{"role": "user", "content": user}]) + ANSWER_PREFIX

    unit = len(tokenizer.encode(FILLER, add_bos=False))
    overhead = len(tokenizer.encode(chat(0, 0), add_bos=False))
    units = max(1, (n_tokens - overhead) // unit)
    for _ in range(3):  # repeated filler tokenizes a little shorter than its units: refine
        ids = tokenizer.encode(chat(units, min(units, round(depth * units))), add_bos=False)
        more = (n_tokens - len(ids)) // unit
        if more <= 0:
            break
        units += more
    return list(ids)


def make_key(seed: int, length: int, depth: float) -> str:
    """A 5-digit key, the same for a (seed, length, depth) cell in every run and mode."""
    return str(random.Random(f"{seed}/{length}/{depth:.3f}").randint(10000, 99999))


def _prefill(lm: Any, cache: list[Any], ids: Sequence[int], chunk: int = 512) -> None:
    for i in range(0, len(ids), chunk):
        lm.model(mx.array(list(ids[i:i + chunk]))[None], cache=cache)
        mx.eval([c.state for c in cache])


def _answer(lm: Any, cache: list[Any], last: int, n: int) -> list[int]:
    """Greedy decode from the last prompt token, one decode step per token."""
    y = mx.array([[last]])
    out: list[int] = []
    for _ in range(n):
        logits = lm.model(y, cache=cache)[:, -1, :]
        tok = int(mx.argmax(logits, axis=-1).item())  # type: ignore[arg-type]
        if tok in lm.eos_ids:
            break
        out.append(tok)
        y = mx.array([[tok]])
    return out


def run_passkey(lm: Any, lengths: Sequence[int], depths: Sequence[float],
                modes: Sequence[str] = ("exact", "sparse"), *, page_tokens: int = 64,
                sink_tokens: int = 64, window_tokens: int = 128,
                budget_fraction: float = 0.25, budget_tokens: int | None = None,
                seed: int = 0, ssd_dir: Path | None = None,
                on_cell: Callable[[PasskeyCell], None] | None = None,
                progress: Callable[[int, int], None] | None = None,
                cancel: Callable[[], bool] | None = None) -> list[PasskeyCell]:
    """Every (length, depth) prompt once, every mode from the same pages; see the docstring.

    Sparse budget: `budget_tokens` if given, else `budget_fraction` of the prompt, rounded
    down to whole pages. Pages stay in the RAM tier (nothing here measures the SSD tier).
    """
    cells: list[PasskeyCell] = []
    total = len(lengths) * len(depths)
    done = 0
    for length in lengths:
        for depth in depths:
            if cancel is not None and cancel():
                return cells
            key = make_key(seed, length, depth)
            ids = passkey_prompt(lm.tokenizer, length, depth, key)
            budget = budget_tokens or int(len(ids) * budget_fraction) // page_tokens * \
                page_tokens
            base = KVSettings(mode="exact", page_tokens=page_tokens, sink_tokens=sink_tokens,
                              window_tokens=window_tokens, budget_tokens=budget, ssd=False,
                              ssd_dir=ssd_dir).validate()
            cache, store = paged_cache(lm.model, base)
            try:
                _prefill(lm, cache, ids[:-1])
                for mode in modes:
                    store.settings = base.with_(mode=mode)
                    for c in cache:
                        c.trim(c.offset - (len(ids) - 1))  # back to the shared prompt pages
                        c.follow_settings()  # sparse: no buffer of every position
                    t = time.perf_counter()
                    toks = _answer(lm, cache, ids[-1], MAX_ANSWER_TOKENS)
                    answer = lm.tokenizer.decode(toks)
                    cell = PasskeyCell(len(ids), length, depth, mode,
                                       budget if mode == "sparse" else len(ids), key,
                                       answer.strip(), key in answer.replace(" ", ""),
                                       round(time.perf_counter() - t, 2))
                    cells.append(cell)
                    if on_cell is not None:
                        on_cell(cell)
            finally:
                close_caches(cache)
            done += 1
            if progress is not None:
                progress(done, total)
    return cells


def passkey_table(cells: Sequence[PasskeyCell]) -> str:
    """A Markdown table: one row per (length, mode), one column per depth; Y found, - not."""
    depths = sorted({c.depth for c in cells})
    rows: dict[tuple[int, str], dict[float, PasskeyCell]] = {}
    for c in cells:
        rows.setdefault((c.target, c.mode), {})[c.depth] = c
    head = "| length | mode | budget | " + " | ".join(f"{d:.0%}" for d in depths) + " | found |"
    lines = [head, "|" + "---|" * (len(depths) + 4)]
    for (length, mode), by_depth in sorted(rows.items(), key=lambda kv: (kv[0][0],
                                                                          kv[0][1])):
        marks = [" " if d not in by_depth else ("Y" if by_depth[d].found else "-")
                 for d in depths]
        found = sum(c.found for c in by_depth.values())
        budget = next(iter(by_depth.values())).budget_tokens
        lines.append(f"| {length:,} | {mode} | {budget:,} | " + " | ".join(marks) +
                     f" | {found}/{len(by_depth)} |")
    return "\n".join(lines)


def sparse_matches_exact(cells: Sequence[PasskeyCell]) -> bool:
    """The goal: sparse finds the key in every cell where exact finds it."""
    exact = {(c.target, c.depth) for c in cells if c.mode == "exact" and c.found}
    sparse = {(c.target, c.depth) for c in cells if c.mode == "sparse" and c.found}
    return exact <= sparse

"""Needles in natural text: a fact hidden in Wikipedia prose, asked for through the chat
template, answered greedily in exact and sparse mode from one prefill (`strata bench needle`).

Contract: `haystack(tokenizer, n_tokens, seed)` is about n_tokens of prose from the
wikitext-2 test set (its tokenization marks undone: "@-@" joins, spaces before punctuation
dropped), starting at a paragraph chosen by `seed`. `needle_prompt(tokenizer, n_tokens,
depth, fact, seed)` builds a chat prompt of about n_tokens with `fact` (a `Fact`: the
sentence, the question, the start of the answer, the answer) a paragraph of its own at
`depth` (0..1) of the prose, returning its ids and the fact's first token index; `ask`
says where the question is asked: "after" the prose only, or "both" before and after it.
`run_needle(lm, lengths, depths, modes, budgets)` prefills each prompt once through the
paged cache (all but its last token, in sparse mode when a sparse mode answers, so that the
question's votes are recorded; the depths of one length share one prose, and a prompt
keeps the pages it shares with the deeper one before it) and lets every mode answer from
those same pages, each answer token a decode step, so sparse selection is what finds the
fact; a cell is found when the answer appears in the greedy reply. `run(args)` is the
suite: a table per (length, asked, RoPE, mode, budget), prefill and decode speed per cell,
JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.errors import StrataError

TEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2-test.txt"
INTRO = "Read the text below, then answer the question after it.\n\n"
# The question before the prose too ("both"): the starter model reads a 4k prompt asked only
# after it as if the fact were not there (exact attention found 2 of 10 depths), and finds
# 10 of 10 when the prose is read knowing the question (Liu et al. 2023, "Lost in the
# Middle": query-aware contextualization). A selection or a remapping can only be judged
# where exact attention finds the fact, so the suite reports both (docs/benchmarks.md).
INTRO_BOTH = "Read the text below, then answer this question: {question}\n\n"
ASKS = ("after", "both")
MAX_ANSWER_TOKENS = 12


@dataclass(frozen=True)
class Fact:
    """A sentence hidden in the prose, the question asking for it and its answer. `prefix`
    is said for the assistant after the template's generation prompt: the reply starts
    there, so a found answer is its first words."""

    sentence: str
    question: str
    prefix: str
    answer: str


def facts(seed: int) -> list[Fact]:
    """The facts of a cell: a number, a name, a short quoted sentence (fixed by `seed`)."""
    rng = random.Random(f"fact/{seed}")
    code = str(rng.randint(10000, 99999))
    colour = rng.choice(["blue", "red", "green", "yellow", "white"])
    name = rng.choice(["Margaret Okafor", "Tobias Lindqvist", "Harriet Vane", "Ignatius Moor"])
    town = rng.choice(["Ashford", "Bramwell", "Corrigan", "Dunmore"])
    motto = rng.choice(["Light follows the patient", "Every bridge remembers its river",
                        "The tide keeps no secrets"])
    return [
        Fact(f"The secret code of the {colour} door is {code}.",
             f"What is the secret code of the {colour} door?",
             f"The secret code of the {colour} door is", code),
        Fact(f"The lighthouse keeper of {town} was named {name}.",
             f"What was the name of the lighthouse keeper of {town}?",
             f"The lighthouse keeper of {town} was named", name),
        Fact(f'The motto carved above the gate of {town} reads "{motto}."',
             f"What does the motto carved above the gate of {town} read?",
             f"The motto carved above the gate of {town} reads", motto),
    ]


def clean(text: str) -> str:
    """wikitext-2's tokenized prose back to ordinary text (headings and <unk> lines go)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("=") or "<unk>" in line:
            continue
        line = re.sub(r" @(.)@ ", r"\1", line)
        line = re.sub(r" ([.,;:!?)'\]])", r"\1", line)
        line = re.sub(r"([(\[]) ", r"\1", line)
        line = line.replace(" 's", "'s").replace(' " ', ' "')
        out.append(line)
    return "\n".join(out)


_paragraphs: dict[Path, list[str]] = {}


def paragraphs(path: Path = TEXT) -> list[str]:
    if path not in _paragraphs:
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise StrataError(f"{path}: cannot read the needle test's text ({exc})") from exc
        _paragraphs[path] = [p for p in clean(raw).split("\n") if len(p) > 200]
    return _paragraphs[path]


def haystack(tokenizer: Any, n_tokens: int, seed: int, path: Path = TEXT) -> list[str]:
    """Paragraphs from a seeded start, in order (wrapping), totalling >= n_tokens tokens."""
    paras = paragraphs(path)
    if not paras:
        raise StrataError(f"{path}: no paragraphs of prose for the needle test")
    i = random.Random(f"hay/{seed}").randrange(len(paras))
    out: list[str] = []
    total = 0
    while total < n_tokens:
        p = paras[i % len(paras)]
        out.append(p)
        total += len(tokenizer.encode(p, add_bos=False)) + 1
        i += 1
    return out


def needle_prompt(tokenizer: Any, n_tokens: int, depth: float, fact: Fact, seed: int = 0,
                  path: Path = TEXT, ask: str = "after") -> tuple[list[int], int]:
    """Chat prompt ids of about n_tokens with `fact` a paragraph of its own at `depth` of the
    prose (a sentence inside a paragraph was missed by exact attention on the starter model
    at 1.6k tokens where the same fact on its own line was found); and the token index where
    the fact's sentence starts (within a token). `ask`: "after" asks the question after the
    prose, "both" before it as well."""
    if ask not in ASKS:
        raise StrataError(f"needle: unknown place to ask {ask!r} ({', '.join(ASKS)})")
    intro = INTRO if ask == "after" else INTRO_BOTH.format(question=fact.question)
    paras = haystack(tokenizer, n_tokens, seed, path)
    lens = [len(tokenizer.encode(p, add_bos=False)) + 1 for p in paras]

    def render(before: list[str], after: list[str]) -> str:
        text = "\n".join([*before, fact.sentence, *after])
        user = intro + text + "\n\nQuestion: " + fact.question
        return tokenizer.render_chat([{"role": "user", "content": user}]) + fact.prefix

    overhead = len(tokenizer.encode(render([], []), add_bos=False))
    n = len(paras)
    while n > 1 and sum(lens[:n]) + overhead > n_tokens:
        n -= 1
    body = paras[:n]
    room = n_tokens - overhead - sum(lens[:n])
    if room > 1 and n < len(paras):
        # The last paragraph cut to land on n_tokens (the question stays whole).
        body.append(tokenizer.decode(tokenizer.encode(paras[n], add_bos=False)[:room - 1]))
    cum, j = 0, 0
    total = sum(lens[:len(body)])
    while j < len(body) and cum + lens[j] / 2 < depth * total:
        cum += lens[j]
        j += 1
    ids = tokenizer.encode(render(body[:j], body[j:]), add_bos=False)
    head = render(body[:j], []).split(fact.sentence)[0]
    return list(ids), len(tokenizer.encode(head, add_bos=False))


@dataclass(frozen=True)
class NeedleCell:
    """One (length, depth, fact, mode, budget) result."""

    length: int          # tokens in the prompt as built
    target: int          # the asked length
    depth: float         # where the fact sits in the prose, 0..1
    kind: str            # number, name or quote
    mode: str
    budget_tokens: int   # sparse: attention budget per query; exact: the context
    rope: str            # "trained" or the scaling the model ran with ("yarn x2.0")
    answer: str
    reply: str
    found: bool
    prefill_tok_s: float
    decode_tok_s: float
    shared_tokens: int = 0  # prompt tokens reused from the previous depth's prefill
    ask: str = "after"      # where the question was asked: "after" the prose or "both"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


KINDS = ("number", "name", "quote")


def _answer(model: Any, eos: set[int] | Sequence[int], cache: list[Any], last: int,
            n: int) -> tuple[list[int], float]:
    """Greedy decode from the last prompt token, one decode step per token; tok/s."""
    y = mx.array([[last]])
    out: list[int] = []
    t = time.perf_counter()
    for _ in range(n):
        logits = model(y, cache=cache)[:, -1, :]
        tok = int(mx.argmax(logits, axis=-1).item())  # type: ignore[arg-type]
        if tok in eos:
            break
        out.append(tok)
        y = mx.array([[tok]])
    return out, (len(out) + 1) / max(1e-9, time.perf_counter() - t)


def run_needle(lm: Any, lengths: Sequence[int], depths: Sequence[float],
               modes: Sequence[str] = ("exact", "sparse"), budgets: Sequence[int] = (768,), *,
               kinds: Sequence[str] = ("number",), model: Any = None, rope: str = "trained",
               page_tokens: int = 128, sink_tokens: int = 128, window_tokens: int = 512,
               seed: int = 0, text: Path = TEXT, ssd_dir: Path | None = None,
               ask: str = "after", on_cell: Callable[[NeedleCell], None] | None = None,
               cancel: Callable[[], bool] | None = None,
               only: Collection[float] | None = None,
               progress: Callable[[int, int], None] | None = None) -> list[NeedleCell]:
    """Every (length, depth, kind) prompt prefilled once, every (mode, budget) answering
    from the same pages (see the module docstring). `model` replaces lm.model (a model
    built at another context, e.g. with RoPE extended; `rope` names it in the cells).
    `ask`: where each prompt asks its question (`needle_prompt`). `only`: run just these of
    `depths` (each depth's fact still fixed by its index in `depths`, so a rerun of some
    cells asks what the full run asked). `progress(done, total)` is called before a prompt's
    prefill and after each chunk of it, with the prompt tokens in the cache."""
    # Engine imports here: the suite's parent process and this module's prompt functions
    # (used by tests) need no KV machinery.
    from engine.bench.fill import paged_cache
    from engine.kv import KVSettings, close_caches, remap

    model = model if model is not None else lm.model
    least = sink_tokens + window_tokens + page_tokens
    base = KVSettings(mode="exact", page_tokens=page_tokens, sink_tokens=sink_tokens,
                      window_tokens=window_tokens, budget_tokens=max([least, *budgets]),
                      ssd=ssd_dir is not None, ssd_dir=ssd_dir).validate()
    runs = [("exact", 0)] if "exact" in modes else []
    runs += [("sparse", b) for b in budgets if "sparse" in modes]
    cells: list[NeedleCell] = []
    for length in lengths:
        # Past the trained length sparse mode remaps positions in prefill too (engine/kv/
        # remap.py), so each sparse budget prefills on its own; exact keeps its prefill.
        probe, _ = paged_cache(model, base)
        spec = remap.attached(probe[0].store)
        close_caches(probe)
        remapped = spec is not None and remap.ENABLED and length > spec.trained
        # One prefill for every mode: in sparse mode when a sparse run answers from it, so
        # that the prompt's last chunk records the question's votes (engine/kv/attention.py;
        # prefill chunks attend exactly either way inside the trained window).
        shared = base.with_(mode="sparse") if any(m == "sparse" for m, _ in runs) else base
        groups = ([(shared, runs)] if not remapped else
                  [(base, [r for r in runs if r[0] == "exact"])] +
                  [(base.with_(mode="sparse", budget_tokens=max(least, b)), [("sparse", b)])
                   for m, b in runs if m == "sparse"])
        for kind in kinds:
            for pre, group in groups:
                if not group:
                    continue
                if cancel is not None and cancel():
                    return cells
                cells += _depths(lm, model, base, pre, group, length, kind, depths, only,
                                 least, seed, text, "remap" if remapped and pre.mode ==
                                 "sparse" else rope, on_cell, cancel, progress, ask)
    return cells


def _depths(lm: Any, model: Any, base: Any, pre: Any, runs: Sequence[tuple[str, int]],
            length: int, kind: str, depths: Sequence[float], only: Collection[float] | None,
            least: int, seed: int, text: Path, rope: str,
            on_cell: Callable[[NeedleCell], None] | None,
            cancel: Callable[[], bool] | None,
            progress: Callable[[int, int], None] | None = None,
            ask: str = "after") -> list[NeedleCell]:
    """The depths of one (length, kind), prefilled with settings `pre`, each run of `runs`
    answering from those pages (see run_needle)."""
    from engine.bench.fill import paged_cache  # as in run_needle
    from engine.kv import QUESTION_L, close_caches, question_steps
    from engine.kv import ask as ask_question

    tok = lm.tokenizer
    cells: list[NeedleCell] = []
    # One prose per (length, kind) and one cache: the depths run deepest first, and each
    # prompt keeps the pages it shares with the one before (the prose up to its own fact),
    # so only the rest is prefilled again (about half the prefill work of ten depths). Facts
    # differ per depth, so no answer carries over.
    order = sorted(((i, d) for i, d in enumerate(depths)
                    if only is None or d in only), key=lambda x: -x[1])
    cache, store = paged_cache(model, pre)
    held: list[int] = []
    try:
        for di, depth in order:
            if cancel is not None and cancel():
                return cells
            fact = facts(seed * 1000 + di)[KINDS.index(kind)]
            ids, _ = needle_prompt(tok, length, depth, fact, seed, text, ask)
            # Past the trained length a sparse run prefills the question's last tokens
            # itself, as one chunk at its own budget (as generate.py does), so
            # the shared pages stop before them.
            store.settings = pre
            split = len(ids) - 1 - question_steps(store, len(ids) - 1)
            keep = _common(held, ids[:split])
            for c in cache:
                c.trim(c.offset - keep)
            t = time.perf_counter()
            if progress is not None:
                progress(keep, len(ids) - 1)  # what this prompt resumes from
            for i in range(keep, split, 512):
                end = min(i + 512, split)
                model(mx.array(ids[i:end])[None], cache=cache)
                mx.eval([c.state for c in cache])
                if progress is not None:
                    progress(end, len(ids) - 1)
                if cancel is not None and cancel():
                    return cells
            prefill = (split - keep) / max(1e-9, time.perf_counter() - t)
            held = ids[:split]
            for mode, budget in runs:
                for c in cache:
                    c.trim(c.offset - len(held))  # back to the prompt's pages
                store.settings = base.with_(
                    mode=mode, budget_tokens=max(least, budget) if mode == "sparse"
                    else base.budget_tokens)
                step = QUESTION_L if question_steps(store, len(ids) - 1) else 512
                for i in range(split, len(ids) - 1, step):
                    ask_question(lambda x: model(x, cache=cache), cache,
                        mx.array(ids[i:min(i + step, len(ids) - 1)])[None])
                    mx.eval([c.state for c in cache])
                out, tps = _answer(model, lm.eos_ids, cache, ids[-1], MAX_ANSWER_TOKENS)
                reply = tok.decode(out).strip()
                cell = NeedleCell(len(ids), length, depth, kind, mode,
                                  budget if mode == "sparse" else len(ids), rope,
                                  fact.answer, reply, _found(fact.answer, reply),
                                  round(prefill, 2), round(tps, 2), keep, ask)
                cells.append(cell)
                if on_cell is not None:
                    on_cell(cell)
            for c in cache:
                c.trim(c.offset - len(held))
    finally:
        close_caches(cache)
    return cells


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _found(answer: str, reply: str) -> bool:
    """The answer in the reply, case and spacing aside (a number's digits together)."""
    def norm(s: str) -> str:
        return re.sub(r"[^0-9a-z]+", " ", s.lower()).strip()

    a, r = norm(answer), norm(reply)
    return bool(a) and (a in r or a.replace(" ", "") in r.replace(" ", ""))


PROGRESS_TOKENS = 4096  # a prefill says where it is once per this many tokens


def prefill_progress(every: int) -> Callable[[int, int], None]:
    """progress(done, total) saying, once per `every` tokens and at the end, the tokens
    prefilled, the rate since the last line, RSS and load: a 100k prefill takes an hour or
    more here, and a stopped run must still say how far it got and how fast."""
    # Here, as in run(): the prompt functions (the tests') need none of the suite's reporting.
    from engine.bench.common import say
    from engine.bench.system import peak_rss_bytes, rss_bytes

    last = {"done": float("inf"), "t": 0.0, "mark": 0.0}

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if done <= last["done"]:  # a new prompt starts here
            last.update(done=done, mark=done, t=now)
            return
        last["done"] = done
        if done // every == last["mark"] // every and done != total:
            return
        rate = (done - last["mark"]) / max(1e-9, now - last["t"])
        last["mark"], last["t"] = done, now
        say(f"  prefill {done:,}/{total:,} tokens, {rate:.1f} tok/s, RSS "
            f"{rss_bytes() / 1e9:.2f} GB (peak {peak_rss_bytes() / 1e9:.2f}), load "
            f"{os.getloadavg()[0]:.1f}, {time.strftime('%H:%M:%S')}")

    return progress


def needle_table(cells: Sequence[NeedleCell]) -> str:
    """Markdown: one row per (length, asked, rope, mode, budget), one column per depth; Y
    found, - not (several kinds: found/asked in the cell); prefill and decode speed
    averaged."""
    depths = sorted({c.depth for c in cells})
    rows: dict[tuple[int, str, str, str, int], list[NeedleCell]] = {}
    for c in cells:
        rows.setdefault((c.target, c.ask, c.rope, c.mode, c.budget_tokens), []).append(c)
    head = ("| length | asked | RoPE | mode | budget | " +
            " | ".join(f"{d:.0%}" for d in depths) + " | found | prefill tok/s | decode tok/s |")
    lines = [head, "|" + "---|" * (len(depths) + 8)]
    for (length, ask, rope, mode, budget), cs in sorted(rows.items()):
        marks = []
        for d in depths:
            at = [c for c in cs if c.depth == d]
            if len(at) == 1:
                marks.append("Y" if at[0].found else "-")
            else:
                marks.append(f"{sum(c.found for c in at)}/{len(at)}" if at else " ")
        found = sum(c.found for c in cs)
        pf = sum(c.prefill_tok_s for c in cs) / len(cs)
        dc = sum(c.decode_tok_s for c in cs) / len(cs)
        lines.append(f"| {length:,} | {ask} | {rope} | {mode} | {budget:,} | " +
                     " | ".join(marks) +
                     f" | {found}/{len(cs)} | {pf:.1f} | {dc:.2f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`strata bench needle`: the table over --needle-lengths x --needle-depths x kinds."""
    # The runtime loads only when the suite runs (engine.bench's contract).
    from engine.bench.common import listed, machine_facts, say
    from engine.bench.system import peak_rss_bytes
    from engine.runtime.fit import trained_context
    from engine.runtime.generate import LoadedModel
    from engine.runtime.model import extend_rope, load_weights_into_model

    lengths = listed(args.needle_lengths, "bench needle: --needle-lengths", int)
    depths = [d / 100 for d in listed(args.needle_depths, "bench needle: --needle-depths",
                                      float)]
    budgets = listed(args.needle_budgets, "bench needle: --needle-budgets", int)
    modes = listed(args.needle_modes, "bench needle: --needle-modes", allowed=("exact",
                                                                              "sparse"))
    kinds = listed(args.needle_kinds, "bench needle: --needle-kinds", allowed=KINDS)
    asks = listed(args.needle_ask, "bench needle: --needle-ask", allowed=ASKS)
    # The options checked before the model loads: a typo costs a line, not a load.
    lm = LoadedModel.load(args.model)
    text = Path(args.text) if args.text else TEXT
    trained = trained_context(lm.config)
    cells: list[NeedleCell] = []

    def show(c: NeedleCell) -> None:
        cells.append(c)  # here, not from run_needle's return: an interrupt keeps these
        say(f"  {c.target} {c.depth:.0%} {c.kind} asked {c.ask} {c.rope} {c.mode} "
            f"{c.budget_tokens}: "
            f"{'found' if c.found else 'missed'} ({c.reply!r}; prefill {c.prefill_tok_s} "
            f"tok/s, decode {c.decode_tok_s} tok/s, load {os.getloadavg()[0]:.1f}, "
            f"{time.strftime('%H:%M:%S')})")

    t0 = time.perf_counter()
    complete = True
    try:
        for length in lengths:
            subjects: list[tuple[str, Any]] = [("trained", None)]
            if length > trained and args.needle_rope in ("yarn", "both"):
                folder = Path(lm.manifest["path"])
                config = extend_rope(lm.config, length)
                scaled, _ = load_weights_into_model(folder, lm.profile, context=length)
                name = f"yarn x{config['rope_scaling']['factor']:g}"
                subjects = ([] if args.needle_rope == "yarn" else subjects) + [(name, scaled)]
            for ask in asks:
                for rope, model in subjects:
                    run_needle(lm, [length], depths, modes, budgets, kinds=kinds, model=model,
                               rope=rope, seed=args.seed, text=text,
                               page_tokens=args.page_tokens, ask=ask, on_cell=show,
                               progress=prefill_progress(PROGRESS_TOKENS))
    except KeyboardInterrupt:
        complete = False
        say("interrupted: reporting what finished")
    wall = time.perf_counter() - t0
    print(needle_table(cells))
    # A long context's functional check is quoted with its wall time and peak RSS (issue 19).
    say(f"wall {wall:.0f} s, peak RSS {peak_rss_bytes() / 1e9:.2f} GB")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"schema": "strata-bench-needle/1", "model": lm.manifest["name"],
             "profile": lm.profile.name, "trained_context": trained, "complete": complete,
             "command": " ".join(sys.argv), "machine": machine_facts(),
             "wall_s": round(wall, 1), "peak_rss_bytes": peak_rss_bytes(),
             "cells": [c.as_dict() for c in cells]}, indent=2))
    return 0 if complete else 130

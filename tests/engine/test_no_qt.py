"""engine/ never imports PySide6, and the first-token path never imports transformers.

Walks every module under engine/ in a fresh interpreter and checks sys.modules afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO

WALK = r"""
import importlib, json, pkgutil, sys
import engine
names = [m.name for m in pkgutil.walk_packages(engine.__path__, "engine.")
         if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names,
                  "qt": sorted(m for m in sys.modules if m.startswith(("PySide6", "shiboken6")))}))
"""

FIRST_TOKEN = r"""
import json, sys
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.sampling import SamplingParams
lm = LoadedModel.load(sys.argv[1])
ids = lm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
next(iter(generate(lm, ids, SamplingParams(temperature=0), 2)))
heavy = ("transformers", "torch", "PySide6")
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""


def test_engine_modules_never_import_qt() -> None:
    proc = subprocess.run([sys.executable, "-c", WALK], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["modules"]) >= 15  # the walk really visited the engine
    assert "engine.server.api" in out["modules"] and "engine.runtime.generate" in out["modules"]
    assert out["qt"] == []


def test_the_command_starts_without_qt() -> None:
    """Every `strata` command builds its parser without importing PySide6, MLX or numpy: each
    subcommand loads its floors when it runs (`strata --help` stays instant)."""
    code = ("import json, sys; from app.cli import build_parser; build_parser(); "
            "heavy = ('PySide6', 'mlx', 'mlx_lm', 'numpy', 'transformers'); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_no_engine_source_names_pyside() -> None:
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "engine").rglob("*.py")
                 if "PySide6" in p.read_text() and "import PySide6" in p.read_text()]
    assert offenders == []


def test_first_token_imports_no_transformers(starter: dict) -> None:  # type: ignore[type-arg]
    proc = subprocess.run([sys.executable, "-c", FIRST_TOKEN, starter["path"]],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []

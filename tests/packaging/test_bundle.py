"""Build the Linux one-folder app with PyInstaller and run its `--smoke` offscreen.

Slow (45 to 100 s to build on two cores) and skipped where PyInstaller is not
installed (`pip install -e ".[package]"`) or not on Linux (macOS: the CI workflow builds
Strata.app and runs the same check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("PyInstaller")
    if not sys.platform.startswith("linux"):
        pytest.skip("the Linux one-folder build; macOS builds Strata.app in CI")
    work = tmp_path_factory.mktemp("pyinstaller")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "PyInstaller", "--noconfirm", "--clean", "--log-level", "WARN",
         "--distpath", str(work / "dist"), "--workpath", str(work / "build"),
         str(REPO / "packaging" / "strata.spec")],
        capture_output=True, text=True, cwd=REPO, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"built in {time.perf_counter() - t0:.0f} s")
    exe = work / "dist" / "Strata" / "Strata"
    assert exe.is_file() and os.access(exe, os.X_OK)
    return exe


def test_packaged_smoke_loads_the_starter_and_generates(
        bundle: Path, tmp_path: Path) -> None:
    from engine.importers.starter import starter_gguf

    starter_gguf()  # in the machine cache, so the bundle imports it without the network
    env = dict(os.environ, STRATA_HOME=str(tmp_path / "home"), QT_QPA_PLATFORM="offscreen")
    proc = subprocess.run([str(bundle), "--smoke"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # one JSON line, nothing else on stdout
    report = json.loads(lines[0])
    assert report["ok"] is True and report["frozen"] is True
    assert report["backend"] == "cpu" and report["profile"] == "cpu-f32"
    assert report["blas"].startswith("openblas")  # the BLAS shim works in the bundle too
    assert report["qt_platform"] == "offscreen"
    assert report["model"] == "smollm2-135m-instruct" and report["token"]
    versions = report["versions"]
    for key in ("strata", "mlx", "mlx_lm", "pyside6", "qt", "python"):
        assert versions[key], key
    timings = report["timings"]
    for key in ("start_to_load_s", "fetch_import_s", "load_s", "first_token_s", "total_s"):
        assert timings[key] >= 0, key
    assert timings["fetch_import_s"] > 0  # a fresh home: the bundle imported the GGUF


def test_packaged_app_leaves_out_what_it_does_not_use(bundle: Path) -> None:
    internal = bundle.parent / "_internal"
    names = {p.name for p in internal.iterdir()}
    assert "transformers" not in names and "torch" not in names
    qt_libs = {p.name for p in (internal / "PySide6" / "Qt" / "lib").iterdir()}
    for unused in ("WebEngine", "Quick", "Qml", "Pdf", "Multimedia", "3D"):
        assert not [n for n in qt_libs if unused in n], unused

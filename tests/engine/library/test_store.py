"""The library on a real disk: atomic installs, aliases, removal, and a killed import."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ImportFailed, ModelNotFound
from engine.importers.starter import starter_gguf
from engine.library import Library
from tests.helpers import REPO


def _snapshot(lib: Library) -> list[str]:
    return sorted(str(p.relative_to(lib.models_dir)) for p in lib.models_dir.rglob("*"))


def _tiny_build(tmp: Path) -> dict[str, Any]:
    (tmp / "model.safetensors").write_bytes(b"x" * 10)
    return {"source": "test", "source_format": "mlx", "bits_per_weight": 16.0}


def test_failed_build_leaves_library_unchanged(tmp_path: Path) -> None:
    lib = Library(tmp_path)
    lib.install("keep", _tiny_build)
    before = _snapshot(lib)

    def broken(tmp: Path) -> dict[str, Any]:
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise ImportFailed("boom")

    with pytest.raises(ImportFailed):
        lib.install("new", broken)
    assert _snapshot(lib) == before


def test_names_aliases_and_removal(tmp_path: Path) -> None:
    lib = Library(tmp_path)
    m = lib.install("alpha", _tiny_build, aliases=["fav"])
    assert m["fingerprint"].startswith("sha256:") and m["bytes"] > 0
    assert lib.get("FAV")["name"] == "alpha"
    lib.install("beta", _tiny_build, aliases=["fav"])  # an alias moves to the newest
    assert lib.get("fav")["name"] == "beta" and lib.get("alpha")["aliases"] == []
    with pytest.raises(ImportFailed, match="already"):
        lib.install("alpha", _tiny_build)
    for bad in ("../evil", "a/b", ".hidden", ""):
        with pytest.raises(ImportFailed, match="invalid model name"):
            lib.install(bad, _tiny_build)
    lib.remove("alpha")
    with pytest.raises(ModelNotFound, match="alpha"):
        lib.get("alpha")
    assert [x["name"] for x in lib.manifests()] == ["beta"]


def test_folder_without_manifest_is_never_listed(tmp_path: Path) -> None:
    lib = Library(tmp_path)
    (lib.models_dir / "half").mkdir()
    (lib.models_dir / "half" / "model.safetensors").write_bytes(b"x")
    assert lib.manifests() == []


def test_killed_import_leaves_nothing_behind(tmp_path: Path) -> None:
    """kill -9 in the middle of a real import; the next start sweeps the temporary folder."""
    home = tmp_path / "home"
    lib = Library(home)
    before = _snapshot(lib)
    src = tmp_path / "copy.gguf"
    shutil.copy(starter_gguf(), src)
    env = dict(os.environ, STRATA_HOME=str(home))
    proc = subprocess.Popen([sys.executable, "-m", "app", "import", str(src)], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(lib.models_dir.glob(".tmp-*/*")):
        time.sleep(0.05)
    assert list(lib.models_dir.glob(".tmp-*")), "the import never started writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert Library(home).manifests() == []
    assert _snapshot(Library(home)) == before

"""engine.matvec: MLX's one-row products reach sgemv through the shim, with the same
results; without a compiler nothing is loaded and MLX computes as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine import matvec, platform
from tests.helpers import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the shim is for MLX on Linux CPU with OpenBLAS")


def _ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) @ b.astype(np.float64)


def test_one_row_products_run_as_sgemv_and_agree() -> None:
    import mlx.core as mx

    # The suite's machines have OpenBLAS and a compiler (the README's setup installs both).
    assert matvec.status() == "on", platform.blas_status()
    assert "one-row products as sgemv" in platform.blas_status()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 576), dtype=np.float32)
    w = rng.standard_normal((1536, 576), dtype=np.float32)   # nn.Linear's layout: x @ w.T
    w2 = rng.standard_normal((576, 1536), dtype=np.float32)  # B as stored: x @ w2
    c = rng.standard_normal((1, 1536), dtype=np.float32)
    xs = rng.standard_normal((576, 1), dtype=np.float32)     # A transposed: xs.T @ w2
    before = matvec.forwarded()
    got = {
        "B transposed": (x @ w.T, mx.array(x) @ mx.array(w).T),
        "B as stored": (x @ w2, mx.array(x) @ mx.array(w2)),
        "A transposed": (xs.T @ w2, mx.array(xs).T @ mx.array(w2)),
        "alpha, beta": (2.0 * (x @ w2) + 0.5 * c,
                        mx.addmm(mx.array(c), mx.array(x), mx.array(w2), alpha=2.0, beta=0.5)),
    }
    mx.eval(*(g for _, g in got.values()))
    assert matvec.forwarded() - before == len(got)
    for name, (want, g) in got.items():
        want = want.astype(np.float64)
        err = np.abs(np.asarray(g, np.float64) - want).max() / np.abs(want).max()
        assert err < 1e-5, (name, err)
    # Two rows and more stay sgemm's (the prefill's products), and agree as well.
    two = mx.array(np.concatenate([x, x + 1]))
    before = matvec.forwarded()
    out = np.asarray(two @ mx.array(w).T)
    assert matvec.forwarded() == before
    assert np.abs(out - _ref(np.asarray(two), w.T)).max() < 1e-3


def _python(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("CC", "STRATA_NO_MATVEC")}
    full.update(STRATA_CACHE=str(cache), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env=full, timeout=120)


_PROBE = """
import json, engine, engine.matvec as m, engine.platform as p, mlx.core as mx
y = mx.ones((1, 64)) @ mx.full((64, 32), 0.5)
mx.eval(y)
print(json.dumps({"blas": p.blas_status(), "status": m.status(), "sum": y.sum().item(),
                  "forwarded": m.forwarded()}))
"""


def test_a_fresh_cache_builds_the_shim_once_and_no_compiler_leaves_it_out(
        tmp_path: Path) -> None:
    first = _python(_PROBE, tmp_path / "a")
    assert first.returncode == 0, first.stderr
    got = json.loads(first.stdout)
    assert got["status"] == "on" and got["forwarded"] == 1 and got["sum"] == 32 * 32.0
    (built,) = (tmp_path / "a" / "native").glob("libstrata-matvec-*.so")
    stamp = built.stat().st_mtime_ns
    again = _python(_PROBE, tmp_path / "a")  # the next process loads what the first built
    assert again.returncode == 0 and json.loads(again.stdout)["status"] == "on"
    assert built.stat().st_mtime_ns == stamp
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no temporary left
    built.write_bytes(b"not a shared library")  # damaged in the cache: built again
    mended = _python(_PROBE, tmp_path / "a")
    assert mended.returncode == 0 and json.loads(mended.stdout)["status"] == "on"
    assert built.read_bytes()[:4] == b"\x7fELF"

    # No compiler on PATH and nothing cached: MLX runs on OpenBLAS's sgemm, as before.
    bare = tmp_path / "bin"
    bare.mkdir()
    alone = _python(_PROBE, tmp_path / "b", PATH=str(bare))
    assert alone.returncode == 0, alone.stderr
    got = json.loads(alone.stdout)
    assert got["status"].startswith("not built (no C compiler"), got
    assert got["blas"].startswith("openblas (") and "sgemv shim not built" in got["blas"]
    assert got["sum"] == 32 * 32.0 and got["forwarded"] == 0
    assert not (tmp_path / "b" / "native").exists() or not any(
        (tmp_path / "b" / "native").iterdir())

    off = _python(_PROBE, tmp_path / "a", STRATA_NO_MATVEC="1")
    assert json.loads(off.stdout)["status"] == "off (STRATA_NO_MATVEC=1)"

"""engine.matvec: MLX's one-row products reach sgemv through the shim, with the same
results; without a compiler nothing is loaded and MLX computes as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _quantized(rows: int, cols: int, bits: int, group: int, seed: int = 0) -> tuple[Any, ...]:
    """A float32 weight dequantized from MLX's affine codes, and those codes as numpy: the
    weight (an MLX array and its buffer), codes as bytes, float32 scales and biases."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    dense = mx.array(rng.standard_normal((rows, cols), dtype=np.float32) * 0.05)
    codes, scales, biases = mx.quantize(dense, group_size=group, bits=bits)
    w = mx.dequantize(codes, scales, biases, group_size=group, bits=bits, dtype=mx.float32)
    mx.eval(w, codes, scales, biases)
    return (w, np.asarray(w), np.asarray(codes).view(np.uint8).reshape(rows, -1),
            np.asarray(scales), np.asarray(biases))


def _packed_products(bits: int, group: int) -> dict[str, Any]:
    """Register a weight, run one-row products over it through MLX; what was served how."""
    import mlx.core as mx

    w, w_np, codes, scales, biases = _quantized(384, 640, bits, group)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 640), dtype=np.float32)
    c = rng.standard_normal((1, 384), dtype=np.float32)
    want = x.astype(np.float64) @ w_np.T.astype(np.float64)
    out: dict[str, Any] = {"registered": matvec.pack(w_np, codes, scales, biases, bits, group)}
    rows = rng.standard_normal((9, 640), dtype=np.float32)
    before = matvec.packed()
    y = mx.array(x) @ w.T
    y2 = mx.addmm(mx.array(c), mx.array(x), w.T, alpha=2.0, beta=0.5)
    # a verify step's rows (up to 8): packed too; and each row as its own one-row product
    few = mx.array(np.concatenate([x, rows[:4]])) @ w.T
    alone = [mx.array(r[None]) @ w.T for r in rows[:4]]
    mx.eval(y, y2, few, *alone)
    out["served"] = matvec.packed() - before
    before = matvec.packed()
    nine = mx.array(rows) @ w.T  # nine rows and more: a prompt chunk's, sgemm's
    mx.eval(nine)
    out["served_nine"] = matvec.packed() - before
    scale = np.abs(want).max()
    out["err"] = float(np.abs(np.asarray(y, np.float64) - want).max() / scale)
    out["err_addmm"] = float(np.abs(np.asarray(y2, np.float64) - (2 * want + 0.5 * c)).max()
                             / scale)
    want_rows = rows.astype(np.float64) @ w_np.T.astype(np.float64)
    out["err_rows"] = float(max(
        np.abs(np.asarray(few, np.float64)[1:] - want_rows[:4]).max(),
        np.abs(np.asarray(nine, np.float64) - want_rows).max()) / scale)
    # bit for bit: a row's result does not depend on the rows beside it
    out["rows_alone_equal"] = bool(np.array_equal(np.asarray(few)[0], np.asarray(y)[0]) and all(
        np.array_equal(np.asarray(few)[i + 1], np.asarray(a)[0]) for i, a in enumerate(alone)))
    matvec.unpack(w_np)
    before = matvec.packed()
    mx.eval(mx.array(x) @ w.T)
    out["served_after_unpack"] = matvec.packed() - before
    return out


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (4, 64), (8, 32), (8, 128)])
def test_packed_weights_serve_products_of_up_to_8_rows_and_agree(bits: int, group: int
                                                                  ) -> None:
    assert matvec.packs(bits), "the suite's machines are x86-64 with AVX2"
    got = _packed_products(bits, group)
    assert got["registered"] and got["served"] == 7 and got["served_nine"] == 0, got
    assert got["err"] < 1e-5 and got["err_addmm"] < 1e-5 and got["err_rows"] < 1e-5, got
    assert got["rows_alone_equal"]
    assert got["served_after_unpack"] == 0


_KERNEL = """
import json, engine, engine.matvec as m
from tests.engine.test_matvec import _packed_products
print(json.dumps({"packs": [m.packs(4), m.packs(8)],
                  "runs": [_packed_products(b, g) for b, g in ((4, 32), (8, 64))]}))
"""


def test_the_avx2_kernels_agree_and_no_kernel_leaves_sgemv(tmp_path: Path) -> None:
    avx2 = _python(_KERNEL, tmp_path, STRATA_MATVEC_ISA="avx2")
    assert avx2.returncode == 0, avx2.stderr
    got = json.loads(avx2.stdout)
    assert got["packs"] == [True, True]
    for run in got["runs"]:
        assert run["registered"] and run["served"] == 7 and run["err"] < 1e-5, run
        assert run["err_addmm"] < 1e-5 and run["err_rows"] < 1e-5 and run["rows_alone_equal"]
    none = _python(_KERNEL, tmp_path, STRATA_MATVEC_ISA="none")
    assert none.returncode == 0, none.stderr
    got = json.loads(none.stdout)
    assert got["packs"] == [False, False]
    for run in got["runs"]:
        assert not run["registered"] and run["served"] == 0 and run["err"] < 1e-5, run


def test_a_weight_is_packed_only_as_it_dequantizes_and_while_it_is_unchanged() -> None:
    import ctypes

    w, w_np, codes, scales, biases = _quantized(64, 256, 4, 32, seed=3)
    off = w_np.copy()
    off[0, 5] = np.nextafter(off[0, 5], np.float32(1))  # one ulp from the codes' value
    assert not matvec.pack(off, codes, scales, biases, 4, 32)
    assert not matvec.pack(w_np, codes, scales, biases, 4, 16)  # groups of 16: no kernel
    assert not matvec.pack(w_np, codes, scales[:, :4], biases, 4, 32)  # shapes disagree
    # MLX's own buffers never change; a buffer of ours can, as a freed weight's memory
    # reused by another array would: once its checked values differ it is sgemv's again.
    mine = w_np.copy()
    assert matvec.pack(mine, codes, scales, biases, 4, 32)
    lib = ctypes.CDLL(None)  # the global scope: the shim's cblas_sgemm
    x = np.random.default_rng(4).standard_normal(256, dtype=np.float32)
    y = np.empty(64, np.float32)
    f, p = ctypes.c_float, ctypes.c_void_p

    def product() -> np.ndarray:
        lib.cblas_sgemm(101, 111, 112, 1, 64, 256, f(1.0), p(x.ctypes.data), 256,
                        p(mine.ctypes.data), 256, f(0.0), p(y.ctypes.data), 64)
        return y.copy()

    try:
        before = matvec.packed()
        assert np.abs(product() - mine @ x).max() < 1e-4
        assert matvec.packed() - before == 1
        mine[-1, -1] += 1.0
        assert np.abs(product() - mine @ x).max() < 1e-4
        assert matvec.packed() - before == 1  # served by sgemv
    finally:
        matvec.unpack(mine)
    del w

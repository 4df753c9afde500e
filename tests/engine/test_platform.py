"""engine.platform: the macOS GPU check's verdicts and the pinned mlx / mlx-lm versions."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from engine.errors import StrataError
from engine.platform import check_versions, version_problem
from tests.helpers import REPO


def test_installed_mlx_and_mlx_lm_are_the_tested_ones() -> None:
    import mlx.core as mx

    from engine.runtime.model import mlx_lm_version

    # The venv the README makes installs the pinned minor versions.
    check_versions({"mlx": mx.__version__, "mlx-lm": mlx_lm_version()})


def test_a_version_outside_the_pin_is_one_line() -> None:
    problem = version_problem("mlx-lm", "0.33.1")
    assert problem is not None and "mlx-lm 0.33.1" in problem and "0.32.x" in problem
    assert "\n" not in problem
    assert version_problem("mlx", "0.32.9") is None
    assert "not installed" in (version_problem("mlx", None) or "")
    with pytest.raises(StrataError, match="mlx 0.31.0 is installed"):
        check_versions({"mlx": "0.31.0", "mlx-lm": "0.32.2"})


def test_a_wrong_mlx_lm_fails_at_start_not_in_a_reply(tmp_path: Path) -> None:
    """An mlx_lm 0.99 package first on the path: `strata generate` stops before loading."""
    pkg = tmp_path / "mlx_lm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_version.py").write_text('__version__ = "0.99.0"\n')
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "app", "generate", "--prompt", "hi",
                           "--max-tokens", "1"], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("strata: error: mlx-lm 0.99.0 is installed but Strata is tested "
                           "with 0.32.x only"), line


# -- the macOS GPU check, with MLX's Metal answers faked (no Mac here) --------------------
class _FakeMetal:
    def __init__(self, available: bool) -> None:
        self.available = available

    def is_available(self) -> bool:
        return self.available


@pytest.fixture
def fake_mac(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # noqa: ANN201
    """sys.platform 'darwin', mlx.core with a fake `metal`, the metallib in tmp_path."""
    import mlx
    import mlx.core

    from engine import platform as smoke

    fake = types.SimpleNamespace(metal=_FakeMetal(True), __file__=mlx.core.__file__)
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(mlx, "core", fake)
    monkeypatch.setitem(sys.modules, "mlx.core", fake)
    monkeypatch.delenv("STRATA_DEVICE", raising=False)
    metallib = tmp_path / "mlx.metallib"
    metallib.write_bytes(b"MTLB")
    monkeypatch.setattr(smoke, "metallib_path", lambda: metallib)
    monkeypatch.setattr(smoke, "_gpu_probe", lambda: None)
    return types.SimpleNamespace(mx=fake, metallib=metallib, smoke=smoke)


def test_gpu_check_passes_when_a_kernel_runs(fake_mac) -> None:  # noqa: ANN001
    assert fake_mac.smoke.check_gpu() == {"gpu_check": "ok"}


def test_gpu_check_fails_loudly_without_metal(fake_mac) -> None:  # noqa: ANN001
    fake_mac.mx.metal.available = False
    with pytest.raises(StrataError, match="Metal is not available.*STRATA_DEVICE=cpu"):
        fake_mac.smoke.check_gpu()


def test_gpu_check_fails_loudly_without_the_metallib(fake_mac) -> None:  # noqa: ANN001
    fake_mac.metallib.unlink()
    with pytest.raises(StrataError, match="Metal library is missing"):
        fake_mac.smoke.check_gpu()


def test_gpu_check_fails_loudly_when_kernels_fail(
        fake_mac, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(fake_mac.smoke, "_gpu_probe",
                        lambda: "Failed to load the default metallib.")
    with pytest.raises(StrataError, match="cannot run Metal kernels.*default metallib") as err:
        fake_mac.smoke.check_gpu()
    assert "\n" not in str(err.value)  # one line for the CLI and the dialog


def test_gpu_check_is_skipped_on_the_cpu_by_choice(
        fake_mac, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    fake_mac.mx.metal.available = False
    monkeypatch.setenv("STRATA_DEVICE", "cpu")
    assert fake_mac.smoke.check_gpu() == {"gpu_check": "skipped (STRATA_DEVICE=cpu)"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="numpy bundles OpenBLAS on Linux")
def test_numpy_blas_is_held_to_one_thread_and_mlx_blas_is_not() -> None:
    """Importing the paged attention holds numpy's bundled OpenBLAS to one thread (in a fresh
    process, read back through the library's own getter), and leaves the system OpenBLAS MLX
    runs on as it was: its thread count is still the machine's default."""
    code = (
        "import ctypes, glob, os, numpy as np\n"
        "libs = glob.glob(os.path.join(os.path.dirname(np.__file__), '..', 'numpy.libs',"
        " 'lib*openblas*.so*'))\n"
        "lib = ctypes.CDLL(libs[0])\n"
        "names = ('scipy_openblas_get_num_threads64_', 'openblas_get_num_threads64_',"
        " 'openblas_get_num_threads')\n"
        "get = next(getattr(lib, n) for n in names if hasattr(lib, n))\n"
        "before = get()\n"
        "import engine.kv.attention\n"
        "from engine import platform\n"
        "print(before, get(), platform.blas_threads())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "2"})
    before, after, mlx_blas = out.stdout.split()
    assert (before, after) == ("2", "1")
    assert mlx_blas == "2"

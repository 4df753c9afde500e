"""`strata --smoke` in a checkout (one JSON line), and the macOS GPU check's verdicts."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from engine.errors import StrataError
from tests.helpers import run_strata


def test_smoke_prints_one_json_line(starter: dict, strata_home: Path) -> None:  # type: ignore[type-arg]
    proc = run_strata("--smoke", home=strata_home, env={"QT_QPA_PLATFORM": "offscreen"})
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    report = json.loads(line)
    assert report["ok"] is True and report["frozen"] is False
    assert report["model"] == starter["name"] and report["token"]
    assert report["backend"] in ("cpu", "metal", "cuda", "gpu")
    assert set(report["versions"]) >= {"strata", "mlx", "mlx_lm", "pyside6", "qt", "python"}
    assert report["timings"]["fetch_import_s"] < 1  # the session's library has the starter
    assert report["timings"]["load_s"] > 0 and report["timings"]["first_token_s"] > 0


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

    from engine import smoke

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

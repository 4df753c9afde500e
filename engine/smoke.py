"""The packaged app's GPU start-up check and the `strata --smoke` self-test.

Contract: `check_gpu()` raises StrataError with one line when, on macOS, MLX's Metal library
(mlx.metallib) is missing or cannot run a kernel, rather than letting Strata run on the CPU
unnoticed (STRATA_DEVICE=cpu chooses the CPU on purpose); elsewhere it only reports. `run_smoke()`
checks Qt, fetches and imports the starter model if STRATA_HOME lacks it, loads it, generates
one token and returns one JSON-able dict (versions, backend, profile, timings in seconds).
Qt is reached through `app.smoke` by name only, so the engine still never imports PySide6.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

from engine.errors import StrataError


def _process_age_s() -> float:
    """Seconds since this process started (the OS's clock, so a bundle's unpacking counts)."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # noqa: BLE001  (a figure for the report; never worth failing over)
        from engine.telemetry import PROCESS_START

        return time.perf_counter() - PROCESS_START


def metallib_path() -> Path:
    """Where MLX's wheel (and Strata's bundle) keeps mlx.metallib: next to libmlx."""
    import mlx.core as mx

    return Path(mx.__file__).resolve().parent / "lib" / "mlx.metallib"


def _gpu_probe() -> str | None:
    """Run one small kernel on the GPU; None if it ran, else the error's first line.

    Runs on a throwaway thread: MLX streams belong to the thread that made them, and the
    engine's own thread must be the one to create the streams it uses.
    """
    result: list[str | None] = ["the GPU probe did not finish"]

    def probe() -> None:
        try:
            import mlx.core as mx

            with mx.stream(mx.gpu):
                out = mx.arange(8, dtype=mx.float32) * 2
                mx.eval(out)
            if out.tolist() != [float(2 * i) for i in range(8)]:
                result[0] = f"wrong result from the GPU: {out.tolist()}"
            else:
                result[0] = None
        except Exception as exc:  # noqa: BLE001  (any failure here is what we report)
            result[0] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]

    t = threading.Thread(target=probe, name="strata-gpu-probe", daemon=True)
    t.start()
    t.join(60)
    return result[0]


def check_gpu() -> dict[str, Any]:
    """On macOS, fail loudly unless MLX can run Metal kernels; a small report otherwise."""
    if sys.platform != "darwin":
        return {"gpu_check": "skipped (not macOS)"}
    if os.environ.get("STRATA_DEVICE") == "cpu":
        return {"gpu_check": "skipped (STRATA_DEVICE=cpu)"}
    import mlx.core as mx

    problem: str | None = None
    if not mx.metal.is_available():
        problem = "Metal is not available on this Mac, so MLX would run on the CPU"
    elif not metallib_path().is_file():
        # A bundle that missed mlx.metallib: MLX would fail at the first kernel.
        problem = f"MLX's Metal library is missing ({metallib_path()})"
    else:
        error = _gpu_probe()
        if error is not None:
            problem = f"MLX cannot run Metal kernels from {metallib_path().name}: {error}"
    if problem is None:
        return {"gpu_check": "ok"}
    raise StrataError(problem + "; set STRATA_DEVICE=cpu to run on the CPU anyway")


def _versions() -> dict[str, str | None]:
    import mlx.core as mx

    import engine
    from engine.runtime.model import _ensure_mlx_lm_package

    mlx_lm_version: str | None
    try:
        _ensure_mlx_lm_package()  # else mlx_lm/__init__ would run and import transformers
        from mlx_lm._version import __version__ as mlx_lm_version  # type: ignore[attr-defined]
    except (ImportError, StrataError):
        mlx_lm_version = None
    return {"strata": engine.__version__, "mlx": str(getattr(mx, "__version__", None)),
            "mlx_lm": mlx_lm_version, "python": platform.python_version()}


def run_smoke(qt: bool = True) -> dict[str, Any]:
    """Start, check Qt and the GPU, load the starter model, generate one token; the report."""
    started_s = _process_age_s()
    t0 = time.perf_counter()
    report: dict[str, Any] = {"ok": False, "frozen": bool(getattr(sys, "frozen", False)),
                              "platform": f"{sys.platform}-{platform.machine()}"}
    if qt:
        try:
            report.update(importlib.import_module("app.smoke").qt_probe())
        except (ImportError, RuntimeError) as exc:
            raise StrataError(f"the desktop window's Qt does not work: {exc}") from exc
    from engine.library import Library
    from engine.library.starter import ensure_starter
    from engine.platform import backend, blas_status
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams

    report.update(check_gpu())
    library = Library()
    t_fetch = time.perf_counter()
    manifest = ensure_starter(library, progress=lambda msg: print(msg, file=sys.stderr))
    fetch_s = time.perf_counter() - t_fetch
    t_load = time.perf_counter()
    lm = LoadedModel.load(manifest["name"], library=library)
    load_s = time.perf_counter() - t_load
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    events = list(generate(lm, ids, SamplingParams(temperature=0.0), 1))
    if not events or events[-1].generated_tokens < 1:
        raise StrataError("the starter model produced no token")
    last = events[-1]
    report.update({
        "ok": True,
        "versions": {**_versions(), "pyside6": report.pop("pyside6", None),
                     "qt": report.pop("qt", None)},
        "backend": backend(),
        "blas": blas_status(),
        "profile": lm.profile.name,
        "model": lm.manifest["name"],
        "token": "".join(e.text for e in events),
        "timings": {
            # process start to the moment the model starts loading, fetch/import excluded
            "start_to_load_s": round(started_s + (t_load - t0) - fetch_s, 3),
            "fetch_import_s": round(fetch_s, 3),
            "load_s": round(load_s, 3),
            "first_token_s": round(last.ttft_s, 3),
            "total_s": round(started_s + time.perf_counter() - t0, 3),
        },
    })
    return report

"""`strata --smoke`: start, load the starter model, generate one token, report in one dict.

Contract: `run_smoke(qt_probe)` fetches and imports the starter model if STRATA_HOME lacks it,
loads it, generates one token and returns one JSON-able dict (versions, backend, profile,
timings in seconds). Qt is checked by the `qt_probe` callable the command passes in (the
window's half of the check), so the engine never imports PySide6.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import engine
from engine.errors import StrataError
from engine.importers.starter import ensure_starter
from engine.library import Library
from engine.platform import backend, blas_status, check_gpu
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.model import mlx_lm_version
from engine.runtime.sampling import SamplingParams
from engine.telemetry import PROCESS_START


def _process_age_s() -> float:
    """Seconds since this process started (the OS's clock, so a bundle's unpacking counts)."""
    try:
        import psutil  # third-party; only the smoke report needs the process's start time

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # noqa: BLE001  (a figure for the report; never worth failing over)
        return time.perf_counter() - PROCESS_START


def _versions() -> dict[str, str | None]:
    import mlx.core as mx  # heavy: loaded when the report is made, after the BLAS shim

    return {"strata": engine.__version__, "mlx": str(getattr(mx, "__version__", None)),
            "mlx_lm": mlx_lm_version(), "python": platform.python_version()}


def run_smoke(qt_probe: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Start, check Qt (`qt_probe`, given by the command) and the GPU, load the starter model,
    generate one token; the report."""
    started_s = _process_age_s()
    t0 = time.perf_counter()
    report: dict[str, Any] = {"ok": False, "frozen": bool(getattr(sys, "frozen", False)),
                              "platform": f"{sys.platform}-{platform.machine()}"}
    if qt_probe is not None:
        try:
            report.update(qt_probe())
        except (ImportError, RuntimeError) as exc:
            raise StrataError(f"the desktop window's Qt does not work: {exc}") from exc
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

"""One-row matrix products as matrix-vector products, for MLX on Linux CPU with OpenBLAS.

Contract: `load(cache, openblas)` compiles matvec.c (beside this file) once per machine and
source into `cache/native/`, with the C compiler `cc` (or $CC), loads it with RTLD_GLOBAL
and hands it OpenBLAS's sgemm and sgemv; it must run before OpenBLAS is loaded globally and
before the first `import mlx.core`, so that MLX's matmul finds its `cblas_sgemm` first
(engine.platform.preload_blas calls it so). A row-major product with one row (each
projection of a decode step) then runs as one sgemv, every other as before.
Where no compiler or no OpenBLAS is found nothing is loaded and MLX runs on OpenBLAS's
sgemm as before: slower decode, the same products up to float rounding. `status()` says
which; `forwarded()` counts the products sent to sgemv (the tests check MLX's path).
STRATA_NO_MATVEC=1 leaves it out (to measure without it).
`pack(weight, codes, scales, biases, bits, group)` registers a float32 weight dequantized
from 4- or 8-bit affine codes: its products of up to 8 rows then read the codes (x86-64 with
AVX2 or AVX-512); the caller keeps all four arrays alive until `unpack(weight)`. `packed()` counts
the products served so, `registered()` the weights registered now.

Why: OpenBLAS 0.3.21 (Debian 12) packs B for every sgemm, one row of A included (later
versions forward those to gemv). A starter decode step at depth 0 took 44 ms with it and
25 ms with sgemv (docs/benchmarks.md). Nothing here imports mlx.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path
from typing import Any

from engine import native

SOURCE = Path(__file__).with_name("matvec.c")
_state: dict[str, Any] = {"lib": None, "why": "not loaded"}


def _built(cache: Path) -> Path:
    """The shared library for this source and machine (engine.native). Raises OSError or
    SubprocessError."""
    return native.built(SOURCE, cache, name="strata-matvec")


def load(cache: Path, openblas: Any) -> bool:
    """Compile (once) and load the library globally, pointed at `openblas`'s cblas_sgemm and
    cblas_sgemv (a ctypes handle loaded locally: its own symbols, where the global scope's
    cblas_sgemm is ours from here on). False, with the reason in `status()`, where it
    cannot be (no compiler, a failed compile, STRATA_NO_MATVEC=1): nothing is loaded then."""
    if _state["lib"] is not None:
        return True
    if os.environ.get("STRATA_NO_MATVEC") == "1":
        _state["why"] = "off (STRATA_NO_MATVEC=1)"
        return False
    try:
        # Both looked up first: loaded globally and not attached, the library's cblas_sgemm
        # would jump to NULL.
        gemm = ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p)
        gemv = ctypes.cast(openblas.cblas_sgemv, ctypes.c_void_p)
        path = _built(cache)
        try:
            lib = ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
        except OSError:  # a damaged file in the cache (renames are whole): built again
            path.unlink(missing_ok=True)
            lib = ctypes.CDLL(str(_built(cache)), mode=os.RTLD_GLOBAL)
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        _state["why"] = f"not built ({e}{': ' + detail.decode()[:200] if detail else ''})"
        return False
    lib.strata_matvec_attach(gemm, gemv)
    lib.strata_matvec_count.restype = ctypes.c_ulonglong
    lib.strata_matvec_packed_count.restype = ctypes.c_ulonglong
    ptr = ctypes.c_void_p
    lib.strata_matvec_pack.argtypes = [ptr, ctypes.c_int, ctypes.c_int, ptr, ptr, ptr,
                                       ctypes.c_int, ctypes.c_int]
    lib.strata_matvec_unpack.argtypes = [ptr]
    _state["lib"] = lib
    _state["why"] = "on"
    return True


def status() -> str:
    """'on', or why not ('off (...)', 'not built (...)', 'not loaded')."""
    return str(_state["why"])


def forwarded() -> int:
    """One-row products sent to sgemv so far in this process (0 when not on)."""
    lib = _state["lib"]
    return int(lib.strata_matvec_count()) if lib is not None and status() == "on" else 0


def packs(bits: int) -> bool:
    """Whether one-row products can read `bits`-bit codes on this machine (the shim on, and
    a kernel for the CPU)."""
    lib = _state["lib"]
    return lib is not None and bool(lib.strata_matvec_packs(int(bits)))


def pack(weight: Any, codes: Any, scales: Any, biases: Any, bits: int, group: int) -> bool:
    """Register `weight` (n x k float32, C-contiguous: the buffer MLX multiplies by) as
    dequantized from `codes` (n rows of k * bits / 8 bytes, MLX's packing), `scales` and
    `biases` (n x k / group float32): w = scale * q + bias. False where it cannot be (the shim
    off, no kernel, a shape it does not take, a row that does not dequantize to weight
    exactly). numpy arrays (or anything with `ctypes.data`); all four must outlive the
    registration."""
    lib = _state["lib"]
    if lib is None or weight.ndim != 2:
        return False
    n, k = weight.shape
    if (codes.shape[0] != n or codes.nbytes != n * k * bits // 8 or group <= 0 or k % group
            or scales.shape != (n, k // group) or biases.shape != (n, k // group)):
        return False
    for a, dtype in ((weight, "float32"), (scales, "float32"), (biases, "float32")):
        if str(a.dtype) != dtype or not a.flags["C_CONTIGUOUS"]:
            return False
    if not codes.flags["C_CONTIGUOUS"]:
        return False
    return bool(lib.strata_matvec_pack(weight.ctypes.data, n, k, codes.ctypes.data,
                                       scales.ctypes.data, biases.ctypes.data, bits, group))


def unpack(weight: Any) -> None:
    """Forget `weight`'s registration (none: nothing happens)."""
    lib = _state["lib"]
    if lib is not None:
        lib.strata_matvec_unpack(weight.ctypes.data)


def packed() -> int:
    """One-row products served from packed codes so far in this process."""
    lib = _state["lib"]
    return int(lib.strata_matvec_packed_count()) if lib is not None else 0


def registered() -> int:
    """Weights registered now (see `pack`)."""
    lib = _state["lib"]
    return int(lib.strata_matvec_packed_live()) if lib is not None else 0

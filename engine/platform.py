"""Platform facts: which backend MLX runs on, the Linux BLAS shim, memory, compute profiles.

`preload_blas()` must run before the first `import mlx.core`; `engine/__init__` calls it.
`keep_freed_memory()` (glibc) runs when a model starts loading: memory the load frees then
serves the buffers that follow. `check_versions(versions)` refuses, in one line, an mlx or
mlx-lm outside the minor versions Strata was tested with (it reaches into their internals).
`check_gpu()` refuses, on macOS, an MLX that cannot run Metal kernels (the packaged app's
start-up check). Nothing here imports mlx at module level.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import matvec
from engine.errors import StrataError

if TYPE_CHECKING:
    import subprocess

_BLAS_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)
_blas_path: str | None = None


def preload_blas() -> str | None:
    """Load the system OpenBLAS globally on Linux so MLX's CPU matmuls use it.

    MLX's Linux wheel links a slow reference BLAS; symbols already loaded with RTLD_GLOBAL
    win over it (about 30x on float32 matmul here). Ahead of it goes engine.matvec's
    cblas_sgemm, which sends one-row products to sgemv (where a C compiler built it).
    Returns the library loaded, or None. Set STRATA_NO_BLAS_SHIM=1 to measure without both.
    """
    global _blas_path
    if _blas_path is not None or not sys.platform.startswith("linux"):
        return _blas_path
    if os.environ.get("STRATA_NO_BLAS_SHIM") == "1":
        return None
    if "mlx.core" in sys.modules:
        # Too late to interpose; say so through blas_status() rather than fail.
        return None
    for candidate in _BLAS_CANDIDATES:
        try:
            local = ctypes.CDLL(candidate)  # RTLD_LOCAL: its own sgemm, for the shim below
        except OSError:
            continue
        # First in the global scope, so MLX's one-row products reach it (engine.matvec).
        matvec.load(default_cache(), local)
        ctypes.CDLL(candidate, mode=os.RTLD_GLOBAL)
        _blas_path = candidate
        return candidate
    return None


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit
_KEEP_TRIM_THRESHOLD = 512 << 20
_STEADY_TRIM_THRESHOLD = 64 << 20  # glibc's own ceiling for its moving trim threshold
_allocator: dict[str, bool] = {}


def _glibc() -> Any:
    """The C library, if it is glibc (mallopt and malloc_trim), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed_memory() -> bool:
    """Keep memory a model load frees on the heap, for the KV and the prefill that follow.

    A load frees its staging and dequantization buffers (about 140 MB for the starter in
    cpu-f32). By default glibc hands most of them back to the OS: buffers over its moving mmap
    threshold are unmapped, and a heap top over its trim threshold is cut. The next buffers
    (a prefix restore's, the prefill's) are then fresh memory that the kernel faults in and
    zeroes 4 KB at a time: ~17,500 faults and 40 ms of CPU for a 94 MB restore here. With a
    fixed mmap threshold (32 MiB) and a trim threshold of 512 MiB they reuse the freed
    memory instead (docs/benchmarks.md, prefix cache, sixth pass). `release_freed_memory()`
    gives back what is still unused after the first reply and lowers the trim threshold to
    64 MiB again, so later frees (a closed chat's KV) go back to the OS as by default. Applies
    at every load. glibc only (Linux); elsewhere a no-op. Returns whether it applied;
    STRATA_KEEP_FREED=0 turns it off.
    """
    libc = None if os.environ.get("STRATA_KEEP_FREED") == "0" else _glibc()
    ok = bool(libc is not None
              and libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_MMAP_THRESHOLD) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_TRIM_THRESHOLD) == 1)
    _allocator["keep"] = ok
    return ok


def release_freed_memory() -> bool:
    """Return free heap memory to the OS (glibc's malloc_trim) and trim the heap's top past
    64 MiB from now on; True if any memory was returned."""
    libc = _glibc() if _allocator.get("keep") else None
    if libc is None:
        return False
    freed = bool(libc.malloc_trim(0))
    libc.mallopt(_M_TRIM_THRESHOLD, _STEADY_TRIM_THRESHOLD)
    return freed


_openblas_lib: list[Any] = []  # the handle, once looked up (verify passes switch per step)


def _openblas() -> Any:
    """The OpenBLAS `preload_blas()` loaded (the same handle: dlopen counts), else None."""
    if _blas_path is None:
        return None
    if not _openblas_lib:
        try:
            lib = ctypes.CDLL(_blas_path, mode=os.RTLD_GLOBAL)
        except OSError:
            return None
        _openblas_lib.append(lib if hasattr(lib, "openblas_set_num_threads") else None)
    return _openblas_lib[0]


def blas_threads() -> int | None:
    """Threads OpenBLAS uses for one call now (None: not OpenBLAS, or not loaded by us)."""
    lib = _openblas()
    return int(lib.openblas_get_num_threads()) if lib is not None and hasattr(
        lib, "openblas_get_num_threads") else None


def set_blas_threads(n: int) -> bool:
    """Make OpenBLAS use `n` threads (at least 1) for its calls from now on, for the process.

    For batched decode on a few cores: a matmul of a few rows is too small to split, and
    OpenBLAS's spinning workers then cost more than they give (docs/benchmarks.md, concurrent
    requests). False where MLX does not run on the OpenBLAS `preload_blas()` loaded.
    """
    lib = _openblas()
    if lib is None:
        return False
    lib.openblas_set_num_threads(ctypes.c_int(max(1, int(n))))
    return True


def numpy_blas_one_thread() -> bool:
    """Make numpy's own bundled OpenBLAS (scipy-openblas in Linux wheels, apart from the one
    MLX runs on) use one thread. Its workers spin after each call, and on a few cores they
    took the cores MLX's stream and the page reads needed: a question after 128k stored
    tokens with the sparse selection in numpy went 1.7 -> 2.5-3.3 s (docs/benchmarks.md);
    numpy's matmuls there are small. False where numpy bundles no OpenBLAS."""
    if not sys.platform.startswith("linux"):
        return False
    import glob  # (one lookup at start, not at every import of this leaf)

    import numpy as np  # (the same: loading the engine needs no numpy)
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for path in sorted(glob.glob(str(libs / "lib*openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads_64_",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(1))
                return True
    return False


def blas_status() -> str:
    """Which BLAS MLX's CPU path uses: 'openblas (path), one-row products as sgemv' (or
    with why not: engine.matvec; and how many weights are packed now, engine.runtime.packed),
    'reference' or 'accelerate'."""
    if sys.platform == "darwin":
        return "accelerate"
    if not _blas_path:
        return "reference"
    gemv = matvec.status()
    packed = matvec.registered()
    return f"openblas ({_blas_path}), " + (
        "one-row products as sgemv" if gemv == "on" else f"sgemv shim {gemv}") + (
        f", {packed} weights' decode products from their codes" if packed else "")


def select_device() -> None:
    """Honour STRATA_DEVICE=cpu: MLX computes on the CPU even where there is a GPU.

    For GPUs that cannot be trusted (hosted CI runners' paravirtual Metal device) and for
    CPU-against-GPU comparisons. backend() calls it, so every model load honours it.
    """
    if os.environ.get("STRATA_DEVICE") == "cpu":
        import mlx.core as mx

        if mx.default_device() != mx.cpu:
            mx.set_default_device(mx.cpu)


def backend() -> str:
    """'metal', 'cuda' or 'cpu': where MLX's default device computes."""
    import mlx.core as mx

    select_device()
    if mx.default_device() == mx.gpu:
        if mx.metal.is_available():
            return "metal"
        cuda = getattr(mx, "cuda", None)
        if cuda is not None and cuda.is_available():
            return "cuda"
        return "gpu"
    return "cpu"


@dataclass(frozen=True)
class ComputeProfile:
    """How weights are held for compute on a backend.

    dequantize: expand quantized layers to `dtype` at load (Linux CPU: MLX's quantized CPU
    kernels do not use BLAS and run 30x slower than float32 + OpenBLAS).
    """

    name: str
    dequantize: bool
    dtype: str  # "float32" | "float16" | "bfloat16"


def compute_profile(name: str | None = None) -> ComputeProfile:
    """The profile for this backend, or the one named ('native', 'cpu-f32')."""
    name = name or os.environ.get("STRATA_PROFILE") or ""
    if name == "native":
        # Quantized weights as stored; float16 activations on a GPU. On the CPU float16 has
        # no fast kernels, so activations stay float32 there.
        return ComputeProfile("native", dequantize=False,
                              dtype="float32" if backend() == "cpu" else "float16")
    if name == "cpu-f32":
        return ComputeProfile("cpu-f32", dequantize=True, dtype="float32")
    if name:
        raise StrataError(f"unknown compute profile {name!r}: use 'native' or 'cpu-f32'")
    return compute_profile("cpu-f32" if backend() == "cpu" else "native")


@dataclass(frozen=True)
class MemoryFacts:
    total_bytes: int
    available_bytes: int
    process_rss_bytes: int


def memory_facts() -> MemoryFacts:
    """System and process memory from psutil."""
    import psutil

    vm = psutil.virtual_memory()
    return MemoryFacts(vm.total, vm.available, psutil.Process().memory_info().rss)


@dataclass(frozen=True)
class MemorySnapshot:
    """Where memory is, in bytes, at `taken_at` (time.time()).

    None means the counter does not exist on this platform or is not in use (the KV tier on
    the SSD without a paged KV mode, the prefix cache on disk when it is off): show it as
    unavailable, never as zero; the `*_reason` fields say why, for the panel's hint column.
    """

    taken_at: float
    weights_bytes: int | None
    kv_ram_bytes: int | None
    kv_ssd_bytes: int | None
    prefix_disk_bytes: int | None
    process_rss_bytes: int
    mlx_active_bytes: int | None
    mlx_peak_bytes: int | None
    mlx_cache_bytes: int | None
    system_total_bytes: int
    system_available_bytes: int
    system_used_percent: float
    swap_used_bytes: int | None
    wired_bytes: int | None
    compressed_bytes: int | None
    kv_ssd_reason: str | None = None
    prefix_disk_reason: str | None = None
    kv_shared_bytes: int | None = None  # pages a paged cache maps from the prefix cache
    prefix_hits: int | None = None  # prompts that restored stored pages, of prefix_lookups
    prefix_lookups: int | None = None
    # The page store's one SSD budget (stored prefixes; live sessions' tiers count in it).
    store_budget_bytes: int | None = None
    # The page table (engine.kv.prefix_table): stored full pages, those on the chains of more
    # than one stored prompt, and this process's page hit rate (found of asked).
    store_pages: int | None = None
    store_shared_pages: int | None = None
    store_asked_pages: int | None = None
    store_found_pages: int | None = None


def memory_snapshot(weights_bytes: int | None = None,
                    kv_ram_bytes: int | None = None,
                    kv_ssd_bytes: int | None = None,
                    prefix_disk_bytes: int | None = None,
                    kv_ssd_reason: str | None = None,
                    prefix_disk_reason: str | None = None,
                    kv_shared_bytes: int | None = None,
                    prefix_hits: int | None = None,
                    prefix_lookups: int | None = None,
                    store_budget_bytes: int | None = None) -> MemorySnapshot:
    """psutil's system and process figures plus MLX's counters (only if MLX is loaded).

    The caller supplies what only the runtime knows: weights and KV bytes in RAM, the paged
    KV cache's bytes on the SSD (engine.kv.store.KVStore.stats()["bytes_ssd"]) and the
    prefix cache's bytes on disk (engine.kv.prefix.prefix_folder_bytes). A figure left None
    gets a reason (the caller's, else a default) so the panel can say why it is missing.
    MLX counters are read without importing MLX: a process that has not loaded it reports
    them as None.
    """
    import time

    import psutil

    vm = psutil.virtual_memory()
    try:
        swap: int | None = int(psutil.swap_memory().used)
    except (OSError, RuntimeError):
        swap = None
    active = peak = cache = None
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        active = int(mx.get_active_memory())
        peak = int(mx.get_peak_memory())
        cache = int(mx.get_cache_memory())
    wired = getattr(vm, "wired", None)
    return MemorySnapshot(
        taken_at=time.time(),
        weights_bytes=weights_bytes,
        kv_ram_bytes=kv_ram_bytes,
        kv_ssd_bytes=kv_ssd_bytes,
        prefix_disk_bytes=prefix_disk_bytes,
        process_rss_bytes=int(psutil.Process().memory_info().rss),
        mlx_active_bytes=active,
        mlx_peak_bytes=peak,
        mlx_cache_bytes=cache,
        system_total_bytes=int(vm.total),
        system_available_bytes=int(vm.available),
        system_used_percent=float(vm.percent),
        swap_used_bytes=swap,
        wired_bytes=int(wired) if wired is not None else None,
        compressed_bytes=None,  # psutil does not report macOS compressed memory
        kv_ssd_reason=None if kv_ssd_bytes is not None else (kv_ssd_reason or "paged KV off"),
        prefix_disk_reason=None if prefix_disk_bytes is not None
        else (prefix_disk_reason or "prefix cache off"),
        kv_shared_bytes=kv_shared_bytes,
        prefix_hits=prefix_hits,
        prefix_lookups=prefix_lookups,
        store_budget_bytes=store_budget_bytes,
    )


def parameter_bytes(model: object) -> int:
    """Bytes held by a model's parameters (MLX arrays): the weights figure of the memory panel."""
    from mlx.utils import tree_flatten

    flat: Any = tree_flatten(model.parameters())  # type: ignore[attr-defined]
    return sum(int(leaf[1].nbytes) for leaf in flat)


def stop_child(proc: subprocess.Popen[Any], sig: int, grace: float) -> None:
    """Ask a child to stop with `sig` (so it can save or clean up), kill it after `grace` s."""
    import subprocess  # here: this module is on the path to the first token

    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (temporary files of dead ones can be swept)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def default_home() -> Path:
    """STRATA_HOME, else the platform's per-user data folder."""
    env = os.environ.get("STRATA_HOME")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "Strata"
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(xdg) / "strata"


def default_cache() -> Path:
    """Downloads kept once per machine (the starter wheel): STRATA_CACHE or the user cache."""
    env = os.environ.get("STRATA_CACHE")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "Strata"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "strata"


# -- versions and the GPU ---------------------------------------------------------------
# mlx and mlx-lm move monthly and Strata reaches into them (the bare mlx_lm package, the
# attention hook in model modules, KVCache fields): the minor versions tested, per package.
TESTED_VERSIONS = {"mlx": (0, 32), "mlx-lm": (0, 32)}


def version_problem(package: str, version: str | None) -> str | None:
    """Why `version` of `package` cannot run Strata (None: it can, or it is not pinned)."""
    tested = TESTED_VERSIONS.get(package)
    if tested is None:
        return None
    want = ".".join(map(str, tested))
    if version is None:
        return f"{package} is not installed (Strata needs {want}.x): reinstall Strata"
    parts = version.split(".")
    try:
        minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return f"{package} {version} is not a version Strata knows (it needs {want}.x)"
    if minor != tested:
        return (f"{package} {version} is installed but Strata is tested with {want}.x only: "
                f"pip install '{package}=={want}.*'")
    return None


def check_versions(versions: Mapping[str, str | None]) -> None:
    """Raise StrataError, one line, for the first package outside the tested minor versions
    (versions: package -> installed version, None if absent)."""
    for package, version in versions.items():
        problem = version_problem(package, version)
        if problem is not None:
            raise StrataError(problem)


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

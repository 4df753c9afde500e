"""What the OS says about this process and its files, for every benchmark suite.

Contract: the one place engine/bench reads memory and storage figures and asks the OS to
forget cached file pages. `rss_bytes()` is the resident set now and `peak_rss_bytes()` the
peak so far (ru_maxrss), both in bytes on every OS; `footprint_bytes()` is macOS's physical
footprint (None elsewhere); `io_bytes()` what this process made the storage device read and
write (None where the OS does not say). `drop_page_cache(paths)` advises the OS to drop the
files' pages (posix_fadvise DONTNEED, after an fsync with `sync=True`, since dirty pages
stay) and says whether it worked, checked with mincore where the OS has it
(`resident_fraction`). Nothing here imports MLX: the benchmark's child processes import this
module before they choose what to load.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil


# -- memory -------------------------------------------------------------------------------
def rss_bytes() -> int:
    """This process's resident set now."""
    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """This process's peak resident set so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS: bytes; Linux: KiB


def footprint_bytes() -> int | None:
    """macOS physical footprint (what Activity Monitor shows), via proc_pid_rusage."""
    if sys.platform != "darwin":
        return None
    try:
        class RUsageInfoV2(ctypes.Structure):
            _fields_ = [("uuid", ctypes.c_uint8 * 16)] + [
                (f"f{i}", ctypes.c_uint64) for i in range(25)]

        libproc = ctypes.CDLL("/usr/lib/libproc.dylib")
        info = RUsageInfoV2()
        if libproc.proc_pid_rusage(os.getpid(), 2, ctypes.byref(info)) != 0:
            return None
        return int(info.f9)  # ri_phys_footprint is the tenth 64-bit field after the uuid
    except OSError:
        return None


def io_bytes() -> tuple[int, int] | None:
    """Bytes this process made the storage device read and write (page-cache hits are not
    counted); None where the OS does not report it (psutil has no io_counters on macOS)."""
    try:
        c = psutil.Process().io_counters()  # type: ignore[attr-defined]
    except (AttributeError, psutil.Error):
        return None
    return int(c.read_bytes), int(c.write_bytes)


# -- page cache ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PageDrop:
    """What `drop_page_cache` did: `done` when the OS let go of the pages (or could not be
    checked), `nbytes` the size of the files advised, `note` why not, or what went unchecked."""

    done: bool
    nbytes: int
    note: str


def resident_fraction(paths: Sequence[Path]) -> float | None:
    """Share of the files' pages in the page cache (mincore), or None where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        resident = total = 0
        for path in paths:
            size = path.stat().st_size
            if size == 0:
                continue
            with open(path, "rb") as fh:
                # ACCESS_COPY gives a writable buffer (for ctypes) without faulting pages in.
                mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
                try:
                    n = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * n)()
                    buf = (ctypes.c_char * size).from_buffer(mm)
                    if libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)),
                                    ctypes.c_size_t(size), vec) != 0:
                        return None
                    resident += sum(1 for b in vec if b & 1)
                    total += n
                    del buf
                finally:
                    mm.close()
        return resident / total if total else None
    except (OSError, AttributeError, ValueError, BufferError):
        return None


def sync_files(paths: Sequence[Path]) -> None:
    """fsync each file that exists: written pages stay dirty, and the OS keeps dirty pages
    cached whatever it is advised, and writes them back later, during the next measurement."""
    for path in paths:
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def drop_page_cache(paths: Sequence[Path], *, sync: bool = False) -> PageDrop:
    """Ask the OS to drop the files (those that exist) from the page cache, so that the next
    read comes from the disk; with `sync`, fsync them first."""
    files = [p for p in paths if p.is_file()]
    nbytes = sum(p.stat().st_size for p in files)
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return PageDrop(False, nbytes,
                        f"posix_fadvise is not available on {sys.platform}: cold = warm files")
    if sync:
        sync_files(files)
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except OSError as exc:
        return PageDrop(False, nbytes, f"posix_fadvise failed ({exc}): cold = warm files")
    left = resident_fraction(files)
    if left is not None and left > 0.5:
        return PageDrop(False, nbytes,
                        f"the OS kept {left:.0%} of the files' pages cached after DONTNEED")
    return PageDrop(True, nbytes, "" if left is not None else
                    "page residency not checked (no mincore)")

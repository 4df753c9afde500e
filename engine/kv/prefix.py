"""The prefix cache on the SSD: the KV of prompt prefixes, in full pages that survive restarts.

Contract: a page of `page_tokens` prompt tokens is stored once, in `<hash>.kvp` under the
prefix folder, where hash = sha256(parent hash, model key, page token ids): a chain, so a page
is found only after the same tokens, on the same weights, config (RoPE, quantization), compute
profile and KV dtype/bits (`model_key`). `lookup` finds the longest run of stored pages from
the start of a prompt; `restore` reads them into mlx-lm KVCaches, verifying every byte (a
corrupt or truncated page is deleted and the match ends before it); `store` snapshots new
pages on the calling thread and writes them from a background thread (temp file + rename), and
least recently used pages leave when the folder passes its disk budget. Each file is the prefix
header (hashes, token ids, an xxh3-64 digest of the rest, CRC-32 of the header) followed by one
SSD-tier page record per layer (engine.kv.pagefile's header and CRC), so the two tiers share
one record format; a restore checks the digest, which covers every byte of the records, instead
of the records' own CRC-32s (xxh3 runs at about 10x the speed of zlib's CRC-32).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import os
import queue
import struct
import threading
import time
import weakref
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import xxhash

from engine.errors import StrataError
from engine.kv.pagefile import _CRC, _HEADER, DTYPE_CODES, FORMAT_VERSION, MAGIC, PageHeader
from engine.platform import pid_alive

PREFIX_MAGIC = b"STRATAPX"
PREFIX_VERSION = 2
# magic, version, page tokens, depth (page index), layers, parent hash, own hash,
# xxh3-64 of the layer records that follow the header
_PX = struct.Struct("<8sHIII32s32sQ")
# pagefile knows float32 (1) and float16 (2); bfloat16 travels as raw 16-bit words.
_BF16_CODE = 3
PAGE_TOKENS = 128  # as the paged KV cache; 64 vs 256 not yet measured (docs/benchmarks.md)
_IOV_MAX = 1024
_STEP = 256  # mlx-lm KVCache grows in steps of 256 positions: restore with that headroom
# Page files read at once by a restore. The readers mostly wait on the disk, so more files in
# flight than cores is faster: 8 against 4 took 6-12% off a cold 16-page restore
# (docs/benchmarks.md, prefix cache, third pass).
_READERS = 8


class PrefixCacheError(StrataError):
    """The prefix cache folder or settings cannot be used."""


@dataclass(frozen=True)
class PrefixSettings:
    """Where and how much: folder (None: STRATA_HOME/prefix), disk budget, page size."""

    folder: Path | None = None
    budget_mb: float = 4096
    page_tokens: int = PAGE_TOKENS
    flush_s: float = 30.0  # longest wait at exit for queued pages; the rest are abandoned

    def root(self) -> Path:
        if self.folder is not None:
            return Path(self.folder)
        from engine.platform import default_home

        return default_home() / "prefix"


def settings_from_env(**overrides: Any) -> PrefixSettings:
    """PrefixSettings from STRATA_PREFIX_DIR / STRATA_PREFIX_MB / STRATA_PREFIX_PAGE."""
    env: dict[str, Any] = {}
    try:
        if os.environ.get("STRATA_PREFIX_DIR"):
            env["folder"] = Path(os.environ["STRATA_PREFIX_DIR"])
        if os.environ.get("STRATA_PREFIX_MB"):
            env["budget_mb"] = float(os.environ["STRATA_PREFIX_MB"])
        if os.environ.get("STRATA_PREFIX_PAGE"):
            env["page_tokens"] = int(os.environ["STRATA_PREFIX_PAGE"])
    except ValueError as exc:
        raise PrefixCacheError(f"prefix cache setting is not a whole number ({exc})") from exc
    env.update({k: v for k, v in overrides.items() if v is not None})
    s = PrefixSettings(**env)
    if s.page_tokens < 8 or s.page_tokens & (s.page_tokens - 1):
        raise PrefixCacheError(f"prefix page size {s.page_tokens} must be a power of two >= 8")
    if s.budget_mb < 0:
        raise PrefixCacheError(f"prefix cache budget {s.budget_mb} MB is negative")
    return s


# -- keys ---------------------------------------------------------------------------------
def model_key(lm: Any, kv_bits: int = 16) -> bytes:
    """What must match for a stored KV page to be valid: weights, config, profile, KV format."""
    manifest = getattr(lm, "manifest", {}) or {}
    weights = manifest.get("fingerprint") or _folder_fingerprint(manifest.get("path"))
    facts = {
        "format": [PREFIX_VERSION, FORMAT_VERSION],
        "weights": weights,
        # The whole config: architecture, RoPE (theta, scaling, traditional), quantization.
        "config": lm.config,
        "profile": [lm.profile.name, lm.profile.dtype, lm.profile.dequantize],
        "kv": [kv_dtype(lm), kv_bits],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).digest()


def _folder_fingerprint(path: str | None) -> str:
    """A bare folder: its manifest's fingerprint, else weight names, sizes and mtimes."""
    if not path:
        return "unknown"
    folder = Path(path)
    with contextlib.suppress(OSError, ValueError):
        fp = json.loads((folder / "manifest.json").read_text()).get("fingerprint")
        if fp:
            return str(fp)
    parts = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}"
             for f in sorted(folder.glob("*.safetensors"))]
    return "stat:" + hashlib.sha256("|".join(parts).encode()).hexdigest()


def kv_dtype(lm: Any) -> str:
    """The dtype keys and values are computed in: the compute profile's."""
    return str(lm.profile.dtype)


def chain_hashes(tokens: Sequence[int], page_tokens: int, key: bytes, n_pages: int
                 ) -> list[bytes]:
    """hash_i = sha256(hash_{i-1}, key, tokens of page i); hash_{-1} is 32 zero bytes."""
    out: list[bytes] = []
    parent = bytes(32)
    arr = np.asarray(tokens[: n_pages * page_tokens], dtype="<u4")
    for i in range(n_pages):
        h = hashlib.sha256(parent)
        h.update(key)
        h.update(arr[i * page_tokens:(i + 1) * page_tokens].tobytes())
        parent = h.digest()
        out.append(parent)
    return out


# -- the cache ----------------------------------------------------------------------------
@dataclass
class Plan:
    """What `lookup` found: chain hashes of the prompt's full pages, and how many are stored."""

    hashes: list[bytes]
    hit_pages: int
    page_tokens: int

    @property
    def hit_tokens(self) -> int:
        return self.hit_pages * self.page_tokens


@dataclass
class _Job:
    pages: list[tuple[int, bytes, bytes, np.ndarray]]  # depth, parent, hash, tokens
    k: list[np.ndarray]  # per layer (kv_heads, n*P, head_dim), page-contiguous per head
    v: list[np.ndarray]
    first: int  # depth of the first page in k/v


@dataclass
class PrefixStats:
    hits: int = 0
    restored_tokens: int = 0
    restore_s: float = 0.0
    bytes_read: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    corrupt_pages: int = 0
    evicted_pages: int = 0
    write_errors: list[str] = field(default_factory=list)


class PrefixCache:
    """One model's view of the prefix folder (the folder itself is shared by all models)."""

    def __init__(self, key: bytes, n_layers: int, kv_heads: int, head_dim: int, dtype: str,
                 settings: PrefixSettings | None = None) -> None:
        self.settings = settings or settings_from_env()
        self.P = self.settings.page_tokens
        self.key = key
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype_name = dtype
        # numpy has no bfloat16: such pages are moved as raw 16-bit words.
        self.np_dtype = np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)
        self.dtype_code = _BF16_CODE if dtype == "bfloat16" else DTYPE_CODES[self.np_dtype]
        self.half = kv_heads * self.P * head_dim * self.np_dtype.itemsize
        self.head_bytes = self.P * head_dim * self.np_dtype.itemsize
        self.file_bytes = (_PX.size + 4 * self.P + _CRC.size
                           + n_layers * (_HEADER.size + 2 * self.half + _CRC.size))
        self.folder = self.settings.root()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PrefixCacheError(f"prefix cache folder {self.folder} cannot be created "
                                   f"({exc.strerror or exc})") from exc
        self.stats = PrefixStats()
        self._sweep_temp()
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._pool = ThreadPoolExecutor(_READERS, thread_name_prefix="strata-prefix-read")
        self._thread = threading.Thread(target=self._run, name="strata-prefix-writer",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        # A process that exits flushes its queued pages (bounded by flush_s) or abandons them;
        # an abandoned temp file is never renamed into place, so it is never read.
        atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def for_model(cls, lm: Any, settings: PrefixSettings | None = None) -> PrefixCache:
        attn = lm.model.layers[0].self_attn
        kv_heads = int(attn.n_kv_heads)
        head_dim = int(getattr(attn, "head_dim", 0) or attn.k_proj.weight.shape[0] // kv_heads)
        kv = getattr(lm, "kv_settings", None)
        bits = int(getattr(kv, "bits", 16) or 16)
        return cls(model_key(lm, bits), len(lm.model.layers), kv_heads, head_dim, kv_dtype(lm),
                   settings)

    def path(self, h: bytes) -> Path:
        return self.folder / f"{h.hex()}.kvp"

    # -- lookup and restore -------------------------------------------------------------
    def lookup(self, prompt: Sequence[int]) -> Plan:
        """Chain hashes of the prompt's full pages (at least one token left to prefill) and
        the longest run of them on disk."""
        n = max(0, (len(prompt) - 1) // self.P)
        hashes = chain_hashes(prompt, self.P, self.key, n)
        hit = 0
        while hit < n and self.path(hashes[hit]).is_file():
            hit += 1
        return Plan(hashes, hit, self.P)

    def restore(self, caches: list[Any], prompt: Sequence[int], plan: Plan, cached: int
                ) -> int:
        """Fill `caches` (which hold `cached` tokens) with stored pages up to plan.hit_pages;
        returns the tokens the caches hold now. Only pages that verify are used."""
        import mlx.core as mx

        first = cached // self.P
        if plan.hit_pages <= first:
            return cached
        t0 = time.perf_counter()
        n = plan.hit_pages - first
        total = n * self.P
        cap = -(-(total + 1) // _STEP) * _STEP if first == 0 else total
        shape = (1, self.kv_heads, cap, self.head_dim)
        # The disk starts on every page now, while the buffers are made.
        self._pool.submit(_will_need, [self.path(h) for h in plan.hashes[first:plan.hit_pages]])
        # Pages are read straight into MLX's own buffers (writable through the buffer
        # protocol), which are left unwritten until then: each byte of fresh memory is
        # touched once, by the read, and no copy follows.
        raw = mx.uint16 if self.dtype_name == "bfloat16" else getattr(mx, self.dtype_name)
        mk = [_unfilled(shape, raw, self.np_dtype) for _ in range(self.n_layers)]
        mv = [_unfilled(shape, raw, self.np_dtype) for _ in range(self.n_layers)]
        mx.eval(mk, mv)
        ks = [np.asarray(memoryview(cast(Any, a))) for a in mk]
        vs = [np.asarray(memoryview(cast(Any, a))) for a in mv]
        futs = [self._pool.submit(self._read_page, plan.hashes[first + i], first + i,
                                  prompt, ks, vs, i * self.P) for i in range(n)]
        ok = [f.result() for f in futs]  # all of them: no reader may outlive the buffers
        good = ok.index(False) if False in ok else n
        plan.hit_pages = first + good  # pages past a bad one are rewritten by the next store
        if good == 0:
            ks.clear()
            vs.clear()
            return cached
        end = (first + good) * self.P
        base = first * self.P
        if cached > base:
            for c in caches:  # drop the partial page held in memory; the stored one replaces it
                c.trim(cached - base)
        direct = first == 0 and all(_is_kvcache(c) and c.keys is None for c in caches)
        ks.clear()  # no view may outlive the hand-over: the caches then own the buffers
        vs.clear()
        for layer, c in enumerate(caches):
            k, v = mk[layer], mv[layer]
            if self.dtype_name == "bfloat16":
                k, v = k.view(mx.bfloat16), v.view(mx.bfloat16)
            if direct:
                # Capacity past `end` lets the suffix's prefill write in place.
                c.keys, c.values, c.offset = k, v, end
            else:
                c.update_and_fetch(k[:, :, :end - base], v[:, :, :end - base])
        mk.clear()
        mv.clear()
        mx.eval([c.keys for c in caches if _is_kvcache(c)])
        self._touch(plan.hashes[:first + good])
        self.stats.hits += 1
        self.stats.restored_tokens += end - base
        self.stats.bytes_read += good * self.file_bytes
        self.stats.restore_s += time.perf_counter() - t0
        return end

    def _read_page(self, h: bytes, depth: int, prompt: Sequence[int], ks: list[np.ndarray],
                   vs: list[np.ndarray], pos: int) -> bool:
        """Read one page file straight into the layers' arrays at `pos`; verify it all.
        A page that does not verify is deleted (the next store writes it again)."""
        path = self.path(h)
        try:
            ok = self._read_into(path, h, depth, prompt, ks, vs, pos)
        except OSError:
            ok = False
        if not ok:
            self.stats.corrupt_pages += 1
            with contextlib.suppress(OSError):
                path.unlink()
        return ok

    def _read_into(self, path: Path, h: bytes, depth: int, prompt: Sequence[int],
                   ks: list[np.ndarray], vs: list[np.ndarray], pos: int) -> bool:
        P = self.P
        head = bytearray(_PX.size + 4 * P + _CRC.size)
        rec_heads = [bytearray(_HEADER.size) for _ in range(self.n_layers)]
        crcs = [bytearray(_CRC.size) for _ in range(self.n_layers)]
        bufs: list[Any] = [head]
        for layer in range(self.n_layers):
            bufs.append(rec_heads[layer])
            for arr in (ks[layer], vs[layer]):
                bufs.extend(arr[0, hh, pos:pos + P].data.cast("B")
                            for hh in range(self.kv_heads))
            bufs.append(crcs[layer])
        # Never through a link: only files this cache wrote into its own folder are read.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            if os.fstat(fd).st_size != self.file_bytes:
                return False  # truncated or from another layout
            off = 0
            for i in range(0, len(bufs), _IOV_MAX):
                chunk = bufs[i:i + _IOV_MAX]
                want = sum(len(b) for b in chunk)
                if os.preadv(fd, chunk, off) != want:
                    return False
                off += want
        finally:
            os.close(fd)
        # Prefix header: magic, layout, hashes, digest, tokens, CRC.
        body = bytes(head[:-_CRC.size])
        if zlib.crc32(body) != _CRC.unpack(head[-_CRC.size:])[0]:
            return False
        magic, version, ptok, d, layers, _parent, own, digest = _PX.unpack(body[:_PX.size])
        if (magic, version, ptok, d, layers, own) != (PREFIX_MAGIC, PREFIX_VERSION, P, depth,
                                                      self.n_layers, h):
            return False
        toks = np.frombuffer(body, "<u4", count=P, offset=_PX.size)
        if not np.array_equal(toks, np.asarray(prompt[depth * P:(depth + 1) * P], "<u4")):
            return False  # a hash collision would land here, never in the cache
        # Every byte of the layer records (headers, keys, values, their CRCs) against the digest.
        x = xxhash.xxh3_64()
        for b in bufs[1:]:
            x.update(b)
        if x.intdigest() != digest:
            return False
        # One SSD-tier record per layer: header, keys, values, CRC-32.
        per = 1 + 2 * self.kv_heads + 1
        for layer in range(self.n_layers):
            f = _HEADER.unpack(bytes(bufs[1 + layer * per]))
            expect = (MAGIC, FORMAT_VERSION, layer, depth, depth * P, P, self.dtype_code, 16,
                      self.kv_heads, self.head_dim, P, 2 * self.half)
            if f != expect:
                return False
        return True

    def _touch(self, hashes: Sequence[bytes]) -> None:
        """Mark pages used now; deeper pages look slightly older, so LRU drops them first
        (a page without its parent can never be reached)."""
        now = time.time_ns()
        for depth, h in enumerate(hashes):
            t = now - depth * 1000
            with contextlib.suppress(OSError):
                os.utime(self.path(h), ns=(t, t))

    # -- store --------------------------------------------------------------------------
    def store(self, caches: list[Any], prompt: Sequence[int], plan: Plan) -> int:
        """Queue the prompt's full pages that are not on disk; returns pages queued.
        Runs on the generating thread (MLX arrays belong to it): copies the new pages out."""
        import mlx.core as mx

        if self._closed or not all(_is_kvcache(c) and c.keys is not None for c in caches):
            return 0
        n = len(plan.hashes)
        todo = [d for d in range(plan.hit_pages, n) if not self.path(plan.hashes[d]).is_file()]
        if not todo:
            self._touch(plan.hashes)
            return 0
        first, last = todo[0], todo[-1] + 1
        if any(c.offset < last * self.P for c in caches):
            return 0
        a, b = first * self.P, last * self.P
        ks, vs = [], []
        for c in caches:
            k, v = c.keys[..., a:b, :], c.values[..., a:b, :]
            if self.dtype_name == "bfloat16":
                k, v = k.view(mx.uint16), v.view(mx.uint16)
            kn, vn = np.array(k[0], copy=True), np.array(v[0], copy=True)
            if kn.dtype != self.np_dtype or kn.shape[0] != self.kv_heads:
                return 0  # a cache that is not what the key says: never store it
            ks.append(kn)
            vs.append(vn)
        pages = []
        for d in todo:
            parent = plan.hashes[d - 1] if d else bytes(32)
            toks = np.asarray(prompt[d * self.P:(d + 1) * self.P], "<u4")
            pages.append((d, parent, plan.hashes[d], toks))
        self._q.put(_Job(pages, ks, vs, first))
        self._touch(plan.hashes[:plan.hit_pages])
        return len(pages)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued pages are on disk; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._q.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush(self.settings.flush_s)
        self._q.put(None)
        self._thread.join(timeout=1.0)
        self._pool.shutdown(wait=False)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                for depth, parent, h, toks in job.pages:
                    try:
                        self._write_page(job, depth, parent, h, toks)
                    except OSError as exc:
                        # A full disk or a read-only folder: the cache is optional, go on.
                        self.stats.write_errors.append(f"{self.path(h).name}: "
                                                       f"{exc.strerror or exc}")
                        break
                self._evict()
            finally:
                self._q.task_done()

    def _write_page(self, job: _Job, depth: int, parent: bytes, h: bytes, toks: np.ndarray
                    ) -> None:
        P = self.P
        bufs: list[Any] = [b""]  # the prefix header, once the digest of the records is known
        x = xxhash.xxh3_64()
        pos = (depth - job.first) * P
        for layer in range(self.n_layers):
            head = PageHeader(layer, depth, depth * P, P, self.dtype_code, 16, self.kv_heads,
                              self.head_dim, P, 2 * self.half).pack()
            segs: list[Any] = [head]
            for arr in (job.k[layer], job.v[layer]):
                segs.extend(np.ascontiguousarray(arr[hh, pos:pos + P]).data.cast("B")
                            for hh in range(self.kv_heads))
            crc = 0
            for s in segs:
                crc = zlib.crc32(s, crc)
            segs.append(_CRC.pack(crc))
            for s in segs:
                x.update(s)
            bufs.extend(segs)
        body = _PX.pack(PREFIX_MAGIC, PREFIX_VERSION, P, depth, self.n_layers, parent, h,
                        x.intdigest()) + toks.tobytes()
        bufs[0] = body + _CRC.pack(zlib.crc32(body))
        final = self.path(h)
        tmp = self.folder / f".tmp-{os.getpid()}-{h.hex()[:16]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for i in range(0, len(bufs), _IOV_MAX):
                chunk = bufs[i:i + _IOV_MAX]
                want = sum(len(b) for b in chunk)
                if os.writev(fd, chunk) != want:
                    raise OSError(28, "No space left on device (short write)")
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(fd)
        # No fsync: a torn page after a crash fails its checksum and is rebuilt.
        os.replace(tmp, final)
        t = time.time_ns() - depth * 1000
        os.utime(final, ns=(t, t))
        self.stats.pages_written += 1
        self.stats.bytes_written += self.file_bytes

    # -- disk budget --------------------------------------------------------------------
    def disk_bytes(self) -> int:
        return sum(size for _, size, _ in _scan(self.folder))

    def _evict(self) -> None:
        budget = int(self.settings.budget_mb * (1 << 20))
        entries = _scan(self.folder)
        total = sum(size for _, size, _ in entries)
        if total <= budget:
            return
        for _mtime, size, path in sorted(entries):
            with contextlib.suppress(OSError):
                path.unlink()
                self.stats.evicted_pages += 1
                total -= size
            if total <= budget:
                break

    def _sweep_temp(self) -> None:
        """Remove temp files of writers that died (their pid is gone) or are a day old."""
        for tmp in self.folder.glob(".tmp-*"):
            try:
                pid = int(tmp.name.split("-")[1])
                alive = pid == os.getpid() or pid_alive(pid)
                old = time.time() - tmp.stat().st_mtime > 86400
            except (ValueError, IndexError, OSError):
                alive, old = False, True
            if not alive or old:
                with contextlib.suppress(OSError):
                    tmp.unlink()


def _scan(folder: Path) -> list[tuple[int, int, Path]]:
    out = []
    with contextlib.suppress(OSError):
        for e in os.scandir(folder):
            if e.name.endswith(".kvp"):
                with contextlib.suppress(OSError):
                    st = e.stat()
                    out.append((st.st_mtime_ns, st.st_size, Path(e.path)))
    return out


def _close_at_exit(ref: weakref.ref[PrefixCache]) -> None:
    cache = ref()
    if cache is not None:
        cache.close()


def _will_need(paths: Sequence[Path]) -> None:
    """Ask the OS to start reading these files into the page cache (no wait, no error)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for path in paths:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


class _Unwritten(io.RawIOBase):
    """A .npy stream whose data `mx.load` reads into its fresh buffer and leaves as it is."""

    name = "kv.npy"

    def __init__(self, header: bytes, nbytes: int) -> None:
        super().__init__()
        self._head, self._size, self._pos = header, len(header) + nbytes, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset + (0, self._pos, self._size)[whence]
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._size - self._pos)
        if self._pos < len(self._head):
            n = min(n, len(self._head) - self._pos)
            b[:n] = self._head[self._pos:self._pos + n]
        self._pos += n  # past the header: nothing written, the restore fills it
        return n


def _unfilled(shape: tuple[int, ...], dtype: Any, np_dtype: np.dtype) -> Any:
    """An MLX array whose memory is allocated but not yet written: mx.zeros would touch (and
    so fault in) every page first, which costs as much as reading the page from the disk.
    Falls back to mx.zeros where this MLX cannot load from a file object."""
    import mlx.core as mx

    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": np_dtype.str, "fortran_order": False,
                                                "shape": shape})
    try:
        src = cast(Any, _Unwritten(head.getvalue(), int(np.prod(shape)) * np_dtype.itemsize))
        a = mx.load(src, format="npy")
        if isinstance(a, mx.array) and tuple(a.shape) == tuple(shape) and a.dtype == dtype:
            return a
    except (ValueError, RuntimeError, TypeError):
        pass
    return mx.zeros(shape, dtype=dtype)


def _is_kvcache(c: Any) -> bool:
    """mlx-lm's plain KVCache (not rotating, quantized or paged): the layout pages map onto."""
    return type(c).__name__ == "KVCache" and hasattr(c, "keys")


def prefix_folder_bytes(settings: PrefixSettings | None = None) -> int:
    """Bytes the prefix folder holds (for the memory panel), 0 if it does not exist."""
    s = settings or settings_from_env()
    return sum(size for _, size, _ in _scan(s.root()))

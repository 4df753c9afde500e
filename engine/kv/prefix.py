"""The prefix cache on the SSD: the KV of prompt prefixes, in full pages that survive restarts.

Contract: a page is `page_tokens` prompt tokens; its hash is sha256(parent hash, model key,
page token ids): a chain, so a page is found only after the same tokens, on the same weights,
config (RoPE, quantization), compute profile and KV dtype/bits (`model_key`).

Format 4 (this one): each `store` writes the pages that are not on disk yet as ONE run file,
`<hash of its first page>.kvp` in the prefix folder: a run header (layout, parent hash, model
key, the chain hashes of its pages, CRC-32), then one page record per page, each `page_bytes`
long: the page header (hashes, depth, token ids, xxh3-64 digests of the layer records and of
the summaries, CRC-32), the key summaries (every layer's min and max of the keys as computed
per block of BLOCK_TOKENS, float32), and one SSD-tier record per layer (engine.kv.pagefile's
header and CRC), so the two tiers share one record format. Pages an earlier run holds are
referenced, not copied: a run starts where the stored chain ended and names its parent, and
`lookup` walks from run to run (the run named after the next page's hash), matching page by
page, so a prompt that diverges inside a run (or inside a page) reuses exactly the pages
before. After the full pages, the prompt's partial last page and its next-token logits are a
tail record (engine.kv.tail), so a stored prompt restores whole.

Integrity: an mlx-lm restore checks every byte of the pages it uses (page header CRC, hashes,
depth, tokens, the digest over the layer records: xxh3 runs at about 10x zlib's CRC-32); a
paged restore checks each page's header and summaries, and the store checks each layer
record (its header and CRC-32) when it first reads it. The first page that fails ends the
match; its run is cut before it (truncated, or deleted if it was the run's first page), so
it and the run's later pages are never used and the next `store` writes them again (a
mapped page that fails later is recomputed by the runtime: `damaged`). A run header that
does not verify, a truncated page and a file of another format are ignored; the next store
of that name replaces it, and eviction removes unusable files first.

Sliding-window layers (Gemma 2/3, gpt-oss, Mistral's windowed releases): their KV at a depth
is only the window before it, which mlx-lm's rotating cache no longer holds once the prompt
runs past it, so page records carry the full-attention layers only, and each stored prompt
also writes a window file, `<chain hash of its last full page>.kvw`: the sliding layers' last
min(window, depth) keys and values at that depth (header with the page size, depth, tokens
per layer, an xxh3-64 digest of the arrays, CRC-32), taken by `snapshot(caches)` when the
prefill reaches that depth. A lookup for such a model ends at the deepest matched page that
has a window file, and a restore sets each sliding layer's rotating cache to its window, so
a restored prefix gives the logits a prefill would. Window files go with the budget like runs
(least recently used first) and when their page is no longer stored.

Every KV mode: `restore` and `store` take mlx-lm's caches (pages map onto its KVCache arrays)
or the paged KV cache's (engine.kv.cache): a paged restore maps the pages into the caches'
store (`KVStore.map_pages`: cold pages read in place when attention needs them, the run files
held open so eviction cannot take them from a live session, never copied to the session's
files), with their block summaries, and a paged store copies new pages out of the store
(either tier). The records hold the pages as the store encodes them: at 16 bits the keys and
values in the compute dtype (the same records as mlx-lm's cache, so all three modes share
them), at 8 and 4 bits the quantized bytes (format 2 layer records, with the group); the
summaries are always of the keys before quantization, so a restore gives the very pages and
sparse selections the prefilling store had; bits and group are in the key (`model_key`). The
page size is the store's (the runtime sets it). A sliding model's window file sets the
paged mode's window caches; such a model restores into an empty cache only.

Writes: `store` snapshots new pages on the calling thread; a background thread writes the run
(temp file + rename, so a run appears whole or not at all). Disk budget: least recently used
whole runs leave when the folder passes it, and with them every run whose parent page is no
longer stored (so nothing points into a deleted file); a store never writes a run larger than
the budget. Files of earlier formats are never found (the key includes the format) and go
first.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
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
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import xxhash

from engine.errors import StrataError
from engine.kv.cache import WINDOW_STEP, PagedLayerCache, WindowLayerCache
from engine.kv.codec import PageCodec, Parts
from engine.kv.pagefile import (
    _CRC,
    _HEADER,
    _HEADER_Q,
    DTYPE_CODES,
    FORMAT_VERSION,
    MAGIC,
    PageHeader,
)
from engine.kv.settings import SESSION_NAME, SESSIONS_DIR, KVGeometry, store_root
from engine.kv.table import BLOCK_TOKENS, SUMMARY_DTYPE
from engine.kv.tail import SUFFIX as TAIL_SUFFIX
from engine.kv.tail import Tail, TailLayout, common_prefix, read_tail, tail_name, write_tail
from engine.platform import pid_alive

PREFIX_MAGIC = b"STRATAPX"
RUN_MAGIC = b"STRATARN"
PREFIX_VERSION = 4
# Page header: magic, version, page tokens, depth (page index), layers, parent hash, own
# hash, xxh3-64 of the layer records, xxh3-64 of the key summaries; then the token ids and a
# CRC-32. The summaries follow the header (so a mapped restore reads header and summaries
# in one read and nothing else), then the layer records.
_PX = struct.Struct("<8sHIII32s32sQQ")
# Run header: magic, version, page tokens, layers, depth of the first page, pages, bytes per
# page record, parent hash of the first page, model key; then the pages' hashes and a CRC-32.
_RUN = struct.Struct("<8sHIIIIQ32s32s")
# Window file header: magic, version, page tokens, depth (pages), sliding layers, own hash
# (the chain hash of the depth's last page), xxh3-64 of the arrays; then each layer's token
# count (u32) and a CRC-32 of all that. The arrays follow: per layer keys, then values.
WINDOW_MAGIC = b"STRATAWN"
_WIN = struct.Struct("<8sHIII32sQ")
# pagefile knows float32 (1) and float16 (2); bfloat16 travels as raw 16-bit words.
_BF16_CODE = 3
PAGE_TOKENS = 128  # as the paged KV cache; 64 vs 256 not yet measured (docs/benchmarks.md)
_IOV_MAX = 1024
_STEP = 256  # mlx-lm KVCache grows in steps of 256 positions: restore with that headroom
# Threads that check pages (and ask for readahead) while the restore's one reader reads on.
_CHECKERS = 2
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class PrefixCacheError(StrataError):
    """The prefix cache folder or settings cannot be used."""


@dataclass(frozen=True)
class PrefixSettings:
    """Where and how much: folder (None: the page store, engine.kv.settings.store_root), the
    store's disk budget (live sessions' tiers inside the folder count against it: stored
    runs make room for them), page size."""

    folder: Path | None = None
    budget_mb: float = 4096
    page_tokens: int = PAGE_TOKENS
    flush_s: float = 30.0  # longest wait at exit for queued pages; the rest are abandoned
    tails: bool = True  # the partial last page and its logits too (engine.kv.tail)

    def root(self) -> Path:
        if self.folder is not None:
            return Path(self.folder)
        return store_root()


def settings_from_env(**overrides: Any) -> PrefixSettings:
    """PrefixSettings from STRATA_PREFIX_DIR / STRATA_PREFIX_MB / STRATA_PREFIX_PAGE /
    STRATA_PREFIX_TAILS."""
    env: dict[str, Any] = {}
    try:
        if os.environ.get("STRATA_PREFIX_DIR"):
            env["folder"] = Path(os.environ["STRATA_PREFIX_DIR"])
        if os.environ.get("STRATA_PREFIX_MB"):
            env["budget_mb"] = float(os.environ["STRATA_PREFIX_MB"])
        if os.environ.get("STRATA_PREFIX_PAGE"):
            env["page_tokens"] = int(os.environ["STRATA_PREFIX_PAGE"])
        if os.environ.get("STRATA_PREFIX_TAILS"):  # 0: full pages only (to measure them)
            env["tails"] = os.environ["STRATA_PREFIX_TAILS"] not in ("0", "no", "false")
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
def model_key(identity: Mapping[str, Any]) -> bytes:
    """The key bytes every page hash carries: the model's identity (weights fingerprint,
    config, compute profile, KV dtype and bits: what must match for a stored page to be
    valid; the runtime builds it) and this format's versions."""
    facts = {"format": [PREFIX_VERSION, FORMAT_VERSION], **identity}
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).digest()


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
@dataclass(frozen=True)
class _Run:
    """A run file as `lookup` saw it: the pages it holds whole, from depth `first` on."""

    path: Path
    ino: int
    first: int
    parent: bytes
    hashes: list[bytes]  # as the header lists them
    present: int  # pages wholly in the file (a cut or truncated run holds fewer)
    head: int  # bytes before the first page record

    def offset(self, i: int, page_bytes: int) -> int:
        return self.head + i * page_bytes


@dataclass
class Plan:
    """What `lookup` found: chain hashes of the prompt's full pages, how many are stored, and
    the runs that hold them (in order; run k holds pages runs[k].first..)."""

    hashes: list[bytes]
    hit_pages: int
    page_tokens: int
    runs: list[_Run] = field(default_factory=list)
    # Pages stored in a row (>= hit_pages: a sliding model's hit ends at its deepest window).
    stored_pages: int | None = None
    # The next-token logits (MLX, (1, vocab)) when the whole prompt came from the store.
    logits: Any = None

    @property
    def hit_tokens(self) -> int:
        return self.hit_pages * self.page_tokens

    def where(self, depth: int) -> tuple[_Run, int]:
        """The run holding page `depth` and the page's index in it."""
        for run in reversed(self.runs):
            if depth >= run.first:
                return run, depth - run.first
        raise IndexError(depth)


@dataclass
class Window:
    """The sliding layers' KV at `tokens` (a page boundary), from `PrefixCache.snapshot`:
    per sliding layer (kv_heads, n, key dim) keys and values, n = min(window, tokens)."""

    tokens: int
    k: list[np.ndarray]
    v: list[np.ndarray]


@dataclass
class _Job:
    pages: list[tuple[int, bytes, bytes, np.ndarray]]  # depth, parent, hash, tokens
    k: list[np.ndarray]  # per layer (kv_heads, n*P, head_dim), page-contiguous per head
    v: list[np.ndarray]
    first: int  # depth of the first page in k/v
    mtime_ns: int = 0  # 0: now; else older than its parent runs' (LRU drops children first)
    window: Window | None = None  # the sliding layers' window at the prompt's depth
    hash: bytes | None = None  # the chain hash of that depth's last page
    # From the paged store instead of k/v: per page, per layer (k parts, v parts, key min,
    # key max), numpy arrays as the store encodes them (summaries as float32).
    paged: list[list[tuple[Parts, Parts, Any, Any]]] | None = None
    tail: tuple[str, Tail, bytes] | None = None  # file name, record, parent hash


@dataclass
class TailSnapshot:
    """What `tail_snapshot` took at the end of a prefill: the positions after the last full
    page, (paged caches) their tail arrays as they stood then, and the next-token logits."""

    start: int
    tokens: np.ndarray
    k: list[Any] | None
    v: list[Any] | None
    logits: Any


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    restored_tokens: int = 0
    restore_s: float = 0.0
    bytes_read: int = 0
    pages_written: int = 0
    runs_written: int = 0
    bytes_written: int = 0
    corrupt_pages: int = 0
    evicted_pages: int = 0
    evicted_runs: int = 0
    write_errors: list[str] = field(default_factory=list)


class PrefixCache:
    """One model's view of the prefix folder (the folder itself is shared by all models)."""

    def __init__(self, key: bytes, n_layers: int, kv_heads: int, head_dim: int, dtype: str,
                 settings: PrefixSettings | None = None, windows: Sequence[int] = (),
                 window_shapes: Sequence[tuple[int, int, int]] = (), bits: int = 16,
                 group: int = 64) -> None:
        """n_layers, kv_heads, head_dim: the full-attention layers' (those in page records).
        windows: each model layer's sliding window, 0 for full attention (empty: all full);
        window_shapes: (kv_heads, key dim, value dim) of each sliding layer, in order.
        bits, group: the paged KV cache's page encoding (engine.kv.codec); 8 and 4 bits store
        the quantized page bytes as the paged store holds them (the key must say so too)."""
        self.settings = settings or settings_from_env()
        if bits != 16 and dtype == "bfloat16":
            raise PrefixCacheError("prefix cache: quantized pages of bfloat16 KV are not held")
        self.codec = PageCodec(bits, group, "float32" if dtype == "bfloat16" else dtype)
        wins = list(windows) or [0] * n_layers
        # Model layer indices: full-attention ones (page records), sliding ones (window files).
        self.full = [i for i, w in enumerate(wins) if w == 0]
        self.sliding = [(i, w) for i, w in enumerate(wins) if w > 0]
        if len(self.full) != n_layers or len(window_shapes) != len(self.sliding):
            raise PrefixCacheError(f"prefix cache: {n_layers} paged layers and "
                                   f"{len(window_shapes)} window shapes do not match the "
                                   f"layer windows {wins}")
        self.window_shapes = [tuple(x) for x in window_shapes]
        self.P = self.settings.page_tokens
        self.key = key
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype_name = dtype
        # numpy has no bfloat16: such pages are moved as raw 16-bit words.
        self.np_dtype = np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)
        self.dtype_code = _BF16_CODE if dtype == "bfloat16" else DTYPE_CODES[self.np_dtype]
        self.half = kv_heads * self.P * head_dim * self.np_dtype.itemsize
        self.head_bytes = self.P * head_dim * self.np_dtype.itemsize
        self.page_head = _PX.size + 4 * self.P + _CRC.size
        # One layer record: the SSD tier's (format 1 as computed, format 2 quantized). A
        # quantized page also carries its key summaries (per layer min and max of the keys
        # before quantization, compute dtype), so a sparse restore selects as the original.
        self.payload = 2 * kv_heads * self.P * self.codec.vector_bytes(head_dim)
        self.layer_bytes = (_HEADER_Q.size if self.codec.quantized else _HEADER.size
                            ) + self.payload + _CRC.size
        # Every page carries each layer's key summaries per block of BLOCK_TOKENS (min and
        # max of the keys as computed, in the table's SUMMARY_DTYPE: what sparse selection
        # reads, engine.kv.attention), so a restore can map the page records without
        # reading them and sparse mode selects as the prefilling store did.
        self.block = min(BLOCK_TOKENS, self.P)
        self.blocks = self.P // self.block
        self.sum_dtype = np.dtype(str(SUMMARY_DTYPE).rsplit(".", 1)[-1])
        self.summary_bytes = (n_layers * 2 * kv_heads * self.blocks * head_dim
                              * self.sum_dtype.itemsize)
        self.page_bytes = self.page_head + self.summary_bytes + n_layers * self.layer_bytes
        self.folder = self.settings.root()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PrefixCacheError(f"prefix cache folder {self.folder} cannot be created "
                                   f"({exc.strerror or exc})") from exc
        self.stats = PrefixStats()
        # The prompt's partial last page (engine.kv.tail); a sliding model's window would
        # have to be stored at that depth too, so such models keep full pages only.
        self.tails = not self.sliding and self.settings.tails
        self.tail_layout = TailLayout(self.P, n_layers, kv_heads, head_dim, self.dtype_code,
                                      self.np_dtype)
        self._sweep_temp()
        self._q: queue.Queue[_Job | None] = queue.Queue()
        self._pool = ThreadPoolExecutor(_CHECKERS, thread_name_prefix="strata-prefix-check")
        self._thread = threading.Thread(target=self._run, name="strata-prefix-writer",
                                        daemon=True)
        self._thread.start()
        self._closed = False
        # A process that exits flushes its queued pages (bounded by flush_s) or abandons them;
        # an abandoned temp file is never renamed into place, so it is never read.
        atexit.register(_close_at_exit, weakref.ref(self))

    def label(self, name: str) -> None:
        """Name this cache's key in the folder's labels file (what `folder_summary` shows
        per model); a failure to write it costs only the name."""
        path = self.folder / LABELS
        with contextlib.suppress(OSError, ValueError):
            labels = json.loads(path.read_text()) if path.is_file() else {}
            if labels.get(self.key.hex()) == name:
                return
            labels[self.key.hex()] = name
            tmp = self.folder / f".tmp-{os.getpid()}-labels"
            try:
                tmp.write_text(json.dumps(labels, indent=1, sort_keys=True))
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)  # gone after the rename; a failed write's too

    @classmethod
    def for_geometry(cls, geometry: KVGeometry, key: bytes,
                     settings: PrefixSettings | None = None, bits: int = 16, group: int = 64
                     ) -> PrefixCache:
        """The prefix cache of a model with this KV geometry and key (`model_key`), its pages
        encoded as the paged store's at `bits` and `group`; refused (PrefixCacheError, the
        geometry's one line) for a model it cannot hold."""
        if geometry.no_prefix is not None:
            raise PrefixCacheError(geometry.no_prefix)
        sliding = geometry.window_layers
        return cls(key, len(geometry.paged_layers), geometry.kv_heads, geometry.head_dim,
                   geometry.dtype, settings, geometry.windows,
                   [geometry.shape(i) for i in sliding], bits, group)

    @property
    def has_windows(self) -> bool:
        """Whether the model has sliding-window layers (so stores need a `snapshot`)."""
        return bool(self.sliding)

    def window_path(self, h: bytes) -> Path:
        """The window file of the depth whose last page has chain hash `h`."""
        return self.folder / f"{h.hex()}.kvw"

    def path(self, h: bytes) -> Path:
        """The run file that starts with page `h` (whether or not it exists)."""
        return self.folder / f"{h.hex()}.kvp"

    def run_head_bytes(self, pages: int) -> int:
        return _RUN.size + 32 * pages + _CRC.size

    # -- run headers --------------------------------------------------------------------
    def _run_info(self, path: Path) -> _Run | None:
        """The run header of `path` if it is a run of this layout that verifies, else None.
        A link in the folder is not ours: it is removed, never followed."""
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                with contextlib.suppress(OSError):
                    path.unlink()
            return None
        try:
            st = os.fstat(fd)
            head = os.pread(fd, 4096, 0)
            if len(head) < _RUN.size:
                return None
            (magic, version, ptok, layers, first, n, pbytes, parent,
             key) = _RUN.unpack_from(head)
            if (magic, version, ptok, layers, pbytes, key) != (
                    RUN_MAGIC, PREFIX_VERSION, self.P, self.n_layers, self.page_bytes, self.key):
                return None
            size = self.run_head_bytes(n)
            if n < 1 or size > st.st_size:
                return None
            if size > len(head):
                head += os.pread(fd, size - len(head), len(head))
            if len(head) < size:
                return None
            body = head[:size - _CRC.size]
            if zlib.crc32(body) != _CRC.unpack_from(head, size - _CRC.size)[0]:
                return None
            hashes = [body[_RUN.size + 32 * i:_RUN.size + 32 * (i + 1)] for i in range(n)]
            present = min(n, (st.st_size - size) // self.page_bytes)
            return _Run(path, st.st_ino, first, parent, hashes, present, size)
        except OSError:
            return None
        finally:
            os.close(fd)

    def _walk(self, hashes: Sequence[bytes], start: int) -> tuple[int, list[_Run]]:
        """From page `start` on: the pages stored in a row and the runs that hold them."""
        d, runs = start, []
        while d < len(hashes):
            run = self._run_info(self.path(hashes[d]))
            parent = hashes[d - 1] if d else bytes(32)
            if run is None or run.first != d or run.parent != parent:
                break
            j = 0
            while j < run.present and d + j < len(hashes) and run.hashes[j] == hashes[d + j]:
                j += 1
            if j == 0:
                break
            runs.append(run)
            d += j
        return d, runs

    # -- lookup and restore -------------------------------------------------------------
    def lookup(self, prompt: Sequence[int]) -> Plan:
        """Chain hashes of the prompt's full pages (at least one token left to prefill) and
        the longest run of them on disk."""
        n = max(0, (len(prompt) - 1) // self.P)
        self.stats.lookups += 1
        hashes = chain_hashes(prompt, self.P, self.key, n)
        hit, runs = self._walk(hashes, 0)
        stored = hit
        if self.sliding:
            # A restore needs the sliding layers' window at its depth: the deepest one stored.
            while hit > 0 and not self.window_path(hashes[hit - 1]).is_file():
                hit -= 1
        return Plan(hashes, hit, self.P, runs, stored)

    def restore(self, caches: list[Any], prompt: Sequence[int], plan: Plan, cached: int
                ) -> int:
        """Fill `caches` (which hold `cached` tokens) with stored pages up to plan.hit_pages,
        then, when every full page is there, the stored tail's tokens that the prompt shares
        (engine.kv.tail; with the logits, `plan.logits`, when it is the whole prompt);
        returns the tokens the caches hold now. Only what verifies is used. `caches` are
        mlx-lm's (pages go into their arrays) or the paged KV cache's (pages are mapped into
        its store; `_restore_paged`)."""
        got = self._restore_pages(caches, prompt, plan, cached)
        n = len(plan.hashes)
        if not self.tails or got != n * self.P or len(prompt) <= got:
            return got
        return self._restore_tail(caches, prompt, plan, got)

    def _tail_path(self, plan: Plan) -> tuple[Path, bytes]:
        parent = plan.hashes[-1] if plan.hashes else bytes(32)
        return self.folder / tail_name(self.key, parent), parent

    def _restore_tail(self, caches: list[Any], prompt: Sequence[int], plan: Plan, got: int
                      ) -> int:
        """The stored tail after the prompt's last full page, as far as the prompt shares
        it, into the caches (which hold exactly the full pages)."""
        t0 = time.perf_counter()
        path, parent = self._tail_path(plan)
        tail = read_tail(path, parent, len(plan.hashes), self.tail_layout)
        if tail is None:
            return got
        want = np.asarray(prompt[got:], "<u4")
        m = common_prefix(tail.tokens, want)
        whole = m == len(want) == len(tail.tokens) and tail.logits is not None
        if not whole:
            m = min(m, len(want) - 1)  # a token must be left to compute the logits from
        full = [caches[i] for i in self.full]
        paged = _paged(caches, self.full)
        if m <= 0 or (paged and any(c.offset != got or c.tail_k is not None for c in full)):
            return got
        for layer, c in enumerate(full):
            k = mx.array(tail.k[layer][None, :, :m])
            v = mx.array(tail.v[layer][None, :, :m])
            if self.dtype_name == "bfloat16":
                k, v = k.view(mx.bfloat16), v.view(mx.bfloat16)
            if paged and m == self.P:  # a whole page (a prompt ending on its boundary)
                c.store.commit(c.layer, k[0], v[0])
                c.offset = got + m
            elif paged:
                c.tail_k, c.tail_v, c.offset = k, v, got + m
            else:
                c.update_and_fetch(k, v)
        mx.eval([c.state for c in full])
        if whole:
            assert tail.logits is not None
            plan.logits = mx.array(tail.logits)[None]
        self.stats.restored_tokens += m
        self.stats.restore_s += time.perf_counter() - t0
        return got + m

    def tail_snapshot(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
                      logits: Any) -> TailSnapshot | None:
        """Take the prompt's tail at the end of its prefill (the caches hold exactly the
        prompt; `logits`, (1, vocab), the next token's): references only, `store` copies.
        None if there is nothing new to keep (the whole prompt came from the store)."""
        if not self.tails or plan.logits is not None or self._closed:
            return None
        a, b = len(plan.hashes) * self.P, len(prompt)
        full = [caches[i] for i in self.full]
        ks = vs = None
        if _paged(caches, self.full):
            if b - a == self.P and all(c.offset == b and c.tail_k is None for c in full):
                # A prompt ending on a page boundary: its tail filled the page, committed
                # during the prefill; kept as the session holds it (decoded if quantized).
                try:
                    kv = [c.store.page_np(c.layer, a // self.P) for c in full]
                except StrataError:
                    return None  # its page does not verify on the SSD tier: never stored
                ks, vs = [k[None] for k, _ in kv], [v[None] for _, v in kv]
            elif any(c.offset != b or c.tail_k is None or c.tail_k.shape[2] != b - a
                     for c in full):
                return None  # a tail past a page the prefill committed: skip
            else:
                ks, vs = [c.tail_k for c in full], [c.tail_v for c in full]
        elif not all(_is_kvcache(c) and c.keys is not None and c.offset == b for c in full):
            return None
        return TailSnapshot(a, np.asarray(prompt[a:b], "<u4"), ks, vs, logits)

    def _tail_job(self, caches: list[Any], plan: Plan, snap: TailSnapshot
                  ) -> tuple[str, Tail, bytes] | None:
        """The snapshot as numpy (mlx-lm's caches: sliced now; their first positions past
        the prompt may be written since, never these)."""
        a, b = snap.start, snap.start + len(snap.tokens)
        full = [caches[i] for i in self.full]
        if snap.k is not None and snap.v is not None:
            ks, vs = snap.k, snap.v
        else:
            if not all(_is_kvcache(c) and c.keys is not None and c.offset >= b for c in full):
                return None
            ks = [c.keys[..., a:b, :] for c in full]
            vs = [c.values[..., a:b, :] for c in full]
        if self.dtype_name == "bfloat16":
            ks, vs = [k.view(mx.uint16) for k in ks], [v.view(mx.uint16) for v in vs]
        kn = [np.array(k[0], copy=True) for k in ks]
        vn = [np.array(v[0], copy=True) for v in vs]
        if any(k.dtype != self.np_dtype or k.shape != (self.kv_heads, b - a, self.head_dim)
               for k in kn):
            return None
        logits = np.array(snap.logits.astype(mx.float32)).reshape(-1)
        path, parent = self._tail_path(plan)
        return path.name, Tail(len(plan.hashes), snap.tokens, kn, vn, logits), parent

    def _restore_pages(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
                       cached: int) -> int:
        first = cached // self.P
        if plan.hit_pages <= first:
            return cached
        if _paged(caches, self.full):
            return self._restore_paged(caches, prompt, plan, cached)
        if self.codec.quantized:
            return cached  # quantized pages map onto the paged store only
        t0 = time.perf_counter()
        window = None
        if self.sliding:
            window = self._read_window(plan.hashes[plan.hit_pages - 1], plan.hit_pages)
            if window is None:
                return cached
        want = plan.hit_pages
        opened = self._open(plan, first)  # the disk starts on every page now
        n = plan.hit_pages - first
        if n <= 0 or (window is not None and plan.hit_pages != want):
            for _, fd, advice in opened:
                advice.result()
                os.close(fd)
            return cached
        total = n * self.P
        cap = -(-(total + 1) // _STEP) * _STEP if first == 0 else total
        shape = (1, self.kv_heads, cap, self.head_dim)
        full = [caches[i] for i in self.full]
        # Pages are read straight into MLX's own buffers (writable through the buffer
        # protocol), which are left unwritten until then: each byte of fresh memory is
        # touched once, by the read, and no copy follows.
        raw = mx.uint16 if self.dtype_name == "bfloat16" else getattr(mx, self.dtype_name)
        both = _unfilled(2 * self.n_layers, shape, raw, self.np_dtype)
        mk, mv = both[:self.n_layers], both[self.n_layers:]
        both.clear()
        mx.eval(mk, mv)
        ks = [np.asarray(memoryview(cast(Any, a))) for a in mk]
        vs = [np.asarray(memoryview(cast(Any, a))) for a in mv]
        good = self._read(opened, plan, first, prompt, ks, vs)
        if good == 0 or (window is not None and good < n):
            ks.clear()  # (a sliding model's window belongs to the last page: all or nothing)
            vs.clear()
            return cached
        end = (first + good) * self.P
        base = first * self.P
        if cached > base:
            for c in full:  # drop the partial page held in memory; the stored one replaces it
                c.trim(cached - base)
        direct = first == 0 and all(_is_kvcache(c) and c.keys is None for c in full)
        ks.clear()  # no view may outlive the hand-over: the caches then own the buffers
        vs.clear()
        if window is not None:
            for (i, w), (k, v) in zip(self.sliding, window, strict=True):
                # mlx-lm's rotating cache as a prefill would have left it at `end`: the last
                # min(window, end) positions in order, the write index after them.
                caches[i].state = (k, v, end, 0, w, k.shape[2])
        for layer, c in enumerate(full):
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
        mx.eval([c.keys for c in caches if _is_kvcache(c) or _is_rotating(c)])
        self._touch(plan.runs, plan.hit_pages)
        if window is not None:
            with contextlib.suppress(OSError):
                os.utime(self.window_path(plan.hashes[plan.hit_pages - 1]))
        self.stats.hits += 1
        self.stats.restored_tokens += end - base
        self.stats.bytes_read += good * self.page_bytes
        self.stats.restore_s += time.perf_counter() - t0
        return end

    def _restore_paged(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
                       cached: int) -> int:
        """The paged KV cache's restore: stored pages are mapped, not copied. Each page's
        header and key summaries are read and verified (one small read per page); its layer
        records stay where they are and join the store's table as cold pages (`map_pages`),
        read in place and checked (header, CRC-32) when attention first needs them. The run
        files stay open in the store, so eviction meanwhile cannot take them away. Pages
        after one that fails are not used. A sliding layer's window cache is set to the
        stored window; such a model restores into an empty cache only."""
        P = self.P
        full = [caches[i] for i in self.full]
        store = full[0].store
        if not self._fits(store):
            return cached  # a store of another layout: its pages are not these records
        if self.sliding and cached:
            return cached
        t0 = time.perf_counter()
        window = None
        if self.sliding:
            window = self._read_window(plan.hashes[plan.hit_pages - 1], plan.hit_pages)
            if window is None:
                return cached
        first = cached // P
        want = plan.hit_pages
        opened = self._open(plan, first, advise=False)  # only headers are read now
        if plan.hit_pages <= first or (window is not None and plan.hit_pages != want):
            for _, fd, _ in opened:
                os.close(fd)
            return cached
        head = self.page_head + self.summary_bytes
        good = 0
        records: list[list[tuple[int, int]]] = [[] for _ in range(self.n_layers)]
        # Every page's summaries, read straight into one layer-major array: (layers, 2,
        # pages, kv_heads, blocks, head_dim) in the records' dtype, so each layer's min and
        # max are contiguous (a page's record holds them layer by layer: one iovec each).
        sums = np.empty((self.n_layers, 2, plan.hit_pages - first, self.kv_heads,
                         self.blocks, self.head_dim), self.sum_dtype)
        fds = {run.path: fd for run, fd, _ in opened}
        buf = bytearray(self.page_head)
        for d in range(first, plan.hit_pages):
            run, i = plan.where(d)
            off = run.offset(i, self.page_bytes)
            segs = [sums[layer, j, d - first].data.cast("B")
                    for layer in range(self.n_layers) for j in range(2)]
            try:
                n = os.preadv(fds[run.path], [buf, *segs], off)
                size = os.fstat(fds[run.path]).st_size
            except OSError:
                n, size = 0, 0
            if n != head or size < off + self.page_bytes:
                break  # truncated since lookup: this page and those after it are unused
            digests = self._header_digest(bytes(buf[:self.page_head]), plan.hashes[d], d,
                                          prompt)
            x = xxhash.xxh3_64()
            for seg in segs:
                x.update(seg)
            if digests is None or x.intdigest() != digests[1]:
                self.stats.corrupt_pages += 1
                self._cut(run, i)
                plan.stored_pages = d
                break
            fd = fds[run.path]
            for layer in range(self.n_layers):
                records[layer].append((fd, off + head + layer * self.layer_bytes))
            good += 1
        used = {fd for recs in records[:1] for fd, _ in recs}
        for _, fd, _ in opened:
            if fd in used:
                store.hold(fd)
            else:
                os.close(fd)
        plan.hit_pages = first + good
        if good == 0 or (window is not None and plan.hit_pages != want):
            return cached  # nothing mapped: the caches are as they were
        if cached > first * P:
            for c in full:  # the partial page held in memory: the stored one replaces it
                c.trim(cached - first * P)
        name = plan.runs[0].path.name
        dt = getattr(mx, self.dtype_name)
        for layer in range(self.n_layers):
            table = store.tables[layer]
            lo = mx.array(sums[layer, 0, :good])  # (n, heads, blocks, dim), contiguous
            hi = mx.array(sums[layer, 1, :good])
            if table.block_tokens == self.block and table.block_pages == table.n_pages:
                table.add_blocks(lo, hi)
            # The page's own bound is its blocks' extreme.
            store.map_pages(layer, records[layer], lo.astype(mx.float32).min(axis=2).astype(dt),
                            hi.astype(mx.float32).max(axis=2).astype(dt), name)
        end = (first + good) * P
        for c in full:
            c.offset = end
            c.tail_k = c.tail_v = None
        if window is not None:
            for (i, _w), (k, v) in zip(self.sliding, window, strict=True):
                _set_window(caches[i], k, v, end)
        self._touch(plan.runs, plan.hit_pages)
        if window is not None:
            with contextlib.suppress(OSError):
                os.utime(self.window_path(plan.hashes[plan.hit_pages - 1]))
        self.stats.hits += 1
        self.stats.restored_tokens += end - first * P
        self.stats.bytes_read += good * head
        self.stats.restore_s += time.perf_counter() - t0
        return end

    def damaged(self, plan: Plan, page: int) -> None:
        """A mapped page of `plan` failed its check when read (engine.kv.store's
        MappedPageCorrupt): its run is cut before it, so it and the pages after it are
        stored again by the next `store`."""
        if page >= len(plan.hashes):
            return
        with contextlib.suppress(IndexError):
            run, i = plan.where(page)
            self._cut(run, i)
        self.stats.corrupt_pages += 1
        plan.hit_pages = min(plan.hit_pages, page)
        plan.stored_pages = min(plan.stored_pages if plan.stored_pages is not None
                                else page, page)

    def _fits(self, store: Any) -> bool:
        """Whether a paged store's pages are this cache's records: page size, shape, dtype,
        bits and (quantized) group."""
        c = store.codec
        return ((store.P, store.kv_heads, store.head_dim, store.n_layers, c.bits, c.dtype)
                == (self.P, self.kv_heads, self.head_dim, self.n_layers, self.codec.bits,
                    self.codec.dtype)
                and (not c.quantized or c.group == self.codec.group))

    def read_pages(self, plan: Plan, prompt: Sequence[int], ks: list[np.ndarray],
                   vs: list[np.ndarray], first: int = 0) -> int:
        """Read pages first..plan.hit_pages into per-layer arrays shaped (1, kv_heads, >= n*P,
        head_dim), page `first` at position 0; returns how many verified in a row (the restore
        without MLX, for tests and tools)."""
        return self._read(self._open(plan, first), plan, first, prompt, ks, vs)

    def _open(self, plan: Plan, first: int, advise: bool = True
              ) -> list[tuple[_Run, int, Future[None]]]:
        """Open the runs holding pages first..hit_pages and (advise) ask the OS to read those
        ranges ahead. A run replaced since `lookup` (another process) ends the match before
        it."""
        out: list[tuple[_Run, int, Future[None]]] = []
        for k, run in enumerate(plan.runs):
            end = plan.runs[k + 1].first if k + 1 < len(plan.runs) else plan.hit_pages
            if end <= first:
                continue
            try:
                fd = os.open(run.path, os.O_RDONLY | _NOFOLLOW)
            except OSError:
                plan.hit_pages = max(first, run.first)
                break
            if os.fstat(fd).st_ino != run.ino:
                os.close(fd)
                plan.hit_pages = max(first, run.first)
                break
            a = max(first, run.first) - run.first
            if not advise:
                done: Future[None] = Future()
                done.set_result(None)
                out.append((run, fd, done))
                continue
            out.append((run, fd, self._pool.submit(_will_need, fd, run.offset(a, self.page_bytes),
                                                   (end - run.first - a) * self.page_bytes)))
        return out

    def _read(self, opened: list[tuple[_Run, int, Future[None]]], plan: Plan, first: int,
              prompt: Sequence[int], ks: list[np.ndarray], vs: list[np.ndarray]) -> int:
        """Read and verify pages first..plan.hit_pages from the opened runs; closes them.
        Cuts the run of the first page that fails, and sets plan.hit_pages before it.

        One thread (this one) reads the pages in file order, as one sequential stream the
        kernel's readahead keeps ahead of; the checks of each page run on the pool meanwhile.
        Several readers at once were 20-40% slower here (docs/benchmarks.md, fifth pass)."""
        checks: list[Future[bool]] = []
        seen = 0  # checks known to have passed
        try:
            fds = {run.path: fd for run, fd, _ in opened}
            for d in range(first, plan.hit_pages):
                run, i = plan.where(d)
                bufs = self._fill_page(fds[run.path], run.offset(i, self.page_bytes), ks, vs,
                                       (d - first) * self.P)
                if bufs is None:
                    break  # truncated since lookup: this page and those after it are not used
                checks.append(self._pool.submit(self._check_page, bufs, plan.hashes[d], d,
                                                prompt))
                while seen < len(checks) and checks[seen].done() and checks[seen].result():
                    seen += 1
                if seen < len(checks) and checks[seen].done():
                    break  # a page failed: reading on would be wasted
            ok = [c.result() for c in checks]  # all of them: no check may outlive the buffers
        finally:
            for _, fd, advice in opened:
                advice.result()  # the fd is closed only once nothing uses it
                os.close(fd)
        good = ok.index(False) if False in ok else len(ok)
        if first + good < plan.hit_pages:
            self.stats.corrupt_pages += 1
            run, i = plan.where(first + good)
            self._cut(run, i)
        if first + good < plan.hit_pages:
            plan.stored_pages = first + good
        plan.hit_pages = first + good  # pages past a bad one are rewritten by the next store
        return good

    def _cut(self, run: _Run, i: int) -> None:
        """Drop page i of a run and all after it: truncate the file before it, or remove the
        file if nothing is left. Only the file `lookup` saw (same inode) is touched."""
        with contextlib.suppress(OSError):
            fd = os.open(run.path, os.O_WRONLY | _NOFOLLOW)
            try:
                if os.fstat(fd).st_ino != run.ino:
                    return
                if i == 0:
                    run.path.unlink()
                else:
                    os.ftruncate(fd, run.offset(i, self.page_bytes))
            finally:
                os.close(fd)

    def _fill_page(self, fd: int, off: int, ks: list[np.ndarray], vs: list[np.ndarray],
                   pos: int) -> list[Any] | None:
        """Read one page record at `off` straight into the layers' arrays at `pos`; returns
        the buffers it filled (page header first), or None if the file ends before it."""
        P = self.P
        bufs: list[Any] = [bytearray(self.page_head), bytearray(self.summary_bytes)]
        for layer in range(self.n_layers):
            bufs.append(bytearray(_HEADER.size))
            for arr in (ks[layer], vs[layer]):
                bufs.extend(arr[0, hh, pos:pos + P].data.cast("B")
                            for hh in range(self.kv_heads))
            bufs.append(bytearray(_CRC.size))
        try:
            for i in range(0, len(bufs), _IOV_MAX):
                chunk = bufs[i:i + _IOV_MAX]
                want = sum(len(b) for b in chunk)
                if os.preadv(fd, chunk, off) != want:
                    return None
                off += want
        except OSError:
            return None
        return bufs

    def _header_digest(self, head: bytes, h: bytes, depth: int, prompt: Sequence[int]
                       ) -> tuple[int, int] | None:
        """The digests a page header promises (layer records, summaries), if the header
        checks (CRC, magic, layout, its hash, depth, tokens); None otherwise."""
        P = self.P
        body = head[:-_CRC.size]
        if zlib.crc32(body) != _CRC.unpack(head[-_CRC.size:])[0]:
            return None
        (magic, version, ptok, d, layers, _parent, own, digest,
         sum_digest) = _PX.unpack(body[:_PX.size])
        if (magic, version, ptok, d, layers, own) != (PREFIX_MAGIC, PREFIX_VERSION, P, depth,
                                                      self.n_layers, h):
            return None
        toks = np.frombuffer(body, "<u4", count=P, offset=_PX.size)
        if not np.array_equal(toks, np.asarray(prompt[depth * P:(depth + 1) * P], "<u4")):
            return None  # a hash collision would land here, never in the cache
        return int(digest), int(sum_digest)

    def _check_page(self, bufs: list[Any], h: bytes, depth: int, prompt: Sequence[int]
                    ) -> bool:
        """Verify a page `_fill_page` read: False if any byte, the hash, the depth or the
        tokens are not as expected."""
        P = self.P
        digests = self._header_digest(bytes(bufs[0]), h, depth, prompt)
        if digests is None:
            return False
        # Every byte of the layer records (headers, keys, values, their CRCs) against the digest.
        x = xxhash.xxh3_64()
        for b in bufs[2:]:
            x.update(b)
        if x.intdigest() != digests[0]:
            return False
        # One SSD-tier record per layer: header, keys, values, CRC-32.
        per = 1 + 2 * self.kv_heads + 1
        for layer in range(self.n_layers):
            f = _HEADER.unpack(bytes(bufs[2 + layer * per]))
            expect = (MAGIC, FORMAT_VERSION, layer, depth, depth * P, P, self.dtype_code, 16,
                      self.kv_heads, self.head_dim, P, 2 * self.half)
            if f != expect:
                return False
        return True

    def _touch(self, runs: Sequence[_Run], hit_pages: int, now: int | None = None) -> int:
        """Mark the runs used now; deeper runs look slightly older, so LRU drops them first
        (a run without its parent can never be reached). Returns the oldest time set."""
        t = time.time_ns() if now is None else now
        for run in runs:
            if run.first >= hit_pages:
                break
            with contextlib.suppress(OSError):
                os.utime(run.path, ns=(t, t))
            t -= 1000
        return t

    # -- store --------------------------------------------------------------------------
    def snapshot(self, caches: list[Any]) -> Window | None:
        """The sliding layers' window as the caches hold it now (call when their offset is
        the depth to store, a page boundary); None for a model without sliding layers or
        caches that are not mlx-lm's rotating ones. Copies the arrays out."""
        if not self.sliding:
            return None
        ks, vs, tokens = [], [], None
        for (i, w), (heads, dk, dv) in zip(self.sliding, self.window_shapes, strict=True):
            c = caches[i]
            if isinstance(c, WindowLayerCache):
                # The paged mode's window cache: positions [start, offset) from index 0.
                if c.keys is None or (tokens is not None and c.offset != tokens):
                    return None
                tokens = int(c.offset)
                n, held = min(w, tokens), c.offset - c.start
                if held < n:
                    return None
                k, v = c.keys[0, :, held - n:held], c.values[0, :, held - n:held]
            else:
                if not _is_rotating(c) or c.keys is None:
                    return None
                keys, values, offset, keep, _max, idx = c.state
                if keep or (tokens is not None and offset != tokens):
                    return None
                tokens = int(offset)
                n = min(w, tokens)
                k, v = _temporal(keys, idx, tokens), _temporal(values, idx, tokens)
                k, v = k[0, :, k.shape[2] - n:], v[0, :, v.shape[2] - n:]
            if self.dtype_name == "bfloat16":
                k, v = k.view(mx.uint16), v.view(mx.uint16)
            kn, vn = np.array(k, copy=True), np.array(v, copy=True)
            if (kn.shape != (heads, n, dk) or vn.shape != (heads, n, dv)
                    or kn.dtype != self.np_dtype):
                return None
            ks.append(kn)
            vs.append(vn)
        if tokens is None or tokens % self.P:
            return None
        return Window(tokens, ks, vs)

    def store(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
              window: Window | None = None, tail: TailSnapshot | None = None) -> int:
        """Queue the prompt's full pages that are not on disk, as one run (and, for a model
        with sliding layers, `window`: their `snapshot` at the last full page, if it is
        that depth; else `tail`, the prompt's `tail_snapshot`); returns pages queued. Runs
        on the generating thread (MLX arrays belong to it): copies them out."""
        queued = self._store_pages(caches, prompt, plan, window)
        if tail is not None and not self._closed:
            # After the pages: on a disk with room for one of them, the pages matter more.
            job = self._tail_job(caches, plan, tail)
            if job is not None:
                self._q.put(_Job([], [], [], 0, tail=job))
        return queued

    def _store_pages(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
                     window: Window | None) -> int:
        full = [caches[i] for i in self.full]
        paged = _paged(caches, self.full)
        if paged:
            if not self._fits(full[0].store):
                return 0  # a store of another layout: never store it under this key
        elif self.codec.quantized or not all(_is_kvcache(c) and c.keys is not None
                                             for c in full):
            return 0
        if self._closed:
            return 0
        n = len(plan.hashes)
        if window is not None and (not n or window.tokens != n * self.P
                                   or self.window_path(plan.hashes[n - 1]).is_file()):
            window = None  # not this depth, or stored already
        # Pages stored since lookup (another process, an earlier queued run) are kept.
        held = plan.hit_pages if plan.stored_pages is None else plan.stored_pages
        start, more = self._walk(plan.hashes, held)
        runs = [r for r in plan.runs if r.first < held] + more
        if start >= n:
            oldest = self._touch(runs, n)
            if window is not None:
                self._q.put(_Job([], [], [], n, mtime_ns=oldest, window=window,
                                 hash=plan.hashes[n - 1]))
            return 0
        # The new run ends where a stored run begins (it is referenced, not copied), and is
        # never larger than the whole budget.
        stop = next((d for d in range(start + 1, n) if self.path(plan.hashes[d]).is_file()), n)
        fits = int(self.settings.budget_mb * (1 << 20)) - self.run_head_bytes(stop - start)
        stop = min(stop, start + max(0, fits // self.page_bytes))
        if stop <= start or any(c.offset < stop * self.P for c in full):
            return 0
        if stop < n:
            window = None  # its page is not stored: it could never be used
        pages = []
        for d in range(start, stop):
            parent = plan.hashes[d - 1] if d else bytes(32)
            toks = np.asarray(prompt[d * self.P:(d + 1) * self.P], "<u4")
            pages.append((d, parent, plan.hashes[d], toks))
        if paged:
            copied = self._copy_paged(full[0].store, start, stop)
            if copied is None:
                return 0
            oldest = self._touch(runs, start)
            self._q.put(_Job(pages, [], [], start, mtime_ns=oldest, window=window,
                             hash=plan.hashes[n - 1], paged=copied))
            return len(pages)
        a, b = start * self.P, stop * self.P
        ks, vs = [], []
        for c in full:
            k, v = c.keys[..., a:b, :], c.values[..., a:b, :]
            if self.dtype_name == "bfloat16":
                k, v = k.view(mx.uint16), v.view(mx.uint16)
            kn, vn = np.array(k[0], copy=True), np.array(v[0], copy=True)
            if kn.dtype != self.np_dtype or kn.shape[0] != self.kv_heads:
                return 0  # a cache that is not what the key says: never store it
            ks.append(kn)
            vs.append(vn)
        oldest = self._touch(runs, start)
        self._q.put(_Job(pages, ks, vs, start, mtime_ns=oldest, window=window,
                         hash=plan.hashes[n - 1]))
        return len(pages)

    def store_pages(self, prompt: Sequence[int], plan: Plan, start: int, ks: list[np.ndarray],
                    vs: list[np.ndarray]) -> int:
        """Queue pages start.. of `prompt` given as numpy keys and values per full layer
        ((kv_heads, n*P, head_dim), compute dtype), as one run continuing the stored chain
        before `start`: a stored context made without a forward pass (the benchmarks'
        synthetic fill). Returns pages queued."""
        n = ks[0].shape[1] // self.P if ks else 0
        if n == 0 or start + n > len(plan.hashes) or self._closed:
            return 0
        pages = []
        for d in range(start, start + n):
            parent = plan.hashes[d - 1] if d else bytes(32)
            pages.append((d, parent, plan.hashes[d],
                          np.asarray(prompt[d * self.P:(d + 1) * self.P], "<u4")))
        self._q.put(_Job(pages, ks, vs, start, hash=plan.hashes[start + n - 1]))
        return n

    def _copy_paged(self, store: Any, start: int, stop: int
                    ) -> list[list[tuple[Parts, Parts, Any, Any]]] | None:
        """Pages start..stop of every layer of a paged store, copied out as the store
        encodes them (cold pages read back from its SSD tier), with their key summaries
        when quantized; None if a page cannot be read or is not of this layout."""
        out: list[list[tuple[Parts, Parts, Any, Any]]] = []
        dims = self.codec.part_dims(self.head_dim)
        want = [(self.kv_heads, self.P, n) for n, _ in dims]
        try:
            for d in range(start, stop):
                row: list[tuple[Parts, Parts, Any, Any]] = []
                for layer in range(self.n_layers):
                    kp, vp = store.page_parts(layer, d)
                    if ([tuple(a.shape) for a in kp] != want
                            or [tuple(a.shape) for a in vp] != want
                            or [a.dtype for a in kp] != [dt for _, dt in dims]):
                        return None
                    kmin, kmax = self._block_summary(store, layer, d)
                    row.append((kp, vp, kmin, kmax))
                out.append(row)
        except StrataError:
            return None  # a page of the SSD tier that does not verify: never stored
        return out

    def _block_summary(self, store: Any, layer: int, page: int) -> tuple[Any, Any]:
        """A stored page's key min and max per block (kv_heads, blocks, head_dim) in the
        records' dtype: the store's own (taken from the keys as computed) when it has them,
        else from the page as it holds it (as sparse selection would catch them up)."""
        table = store.tables[layer]
        if table.block_tokens == self.block and table.block_pages > page:
            bmin, bmax = table.block_summaries  # (kv_heads, pages * blocks, head_dim)
            at = slice(page * self.blocks, (page + 1) * self.blocks)
            lo, hi = bmin[:, at], bmax[:, at]
        else:
            k, _ = store.page_np(layer, page)  # (kv_heads, P, head_dim), decoded
            kb = k.reshape(self.kv_heads, self.blocks, self.block, self.head_dim)
            lo, hi = kb.min(axis=2), kb.max(axis=2)
        return (np.array(lo.astype(SUMMARY_DTYPE)), np.array(hi.astype(SUMMARY_DTYPE)))

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
                if job.pages:
                    try:
                        self._write_run(job)
                    except OSError as exc:
                        # A full disk or a read-only folder: the cache is optional, go on.
                        self.stats.write_errors.append(f"{self.path(job.pages[0][2]).name}: "
                                                       f"{exc.strerror or exc}")
                if job.tail is not None:
                    name, rec, parent = job.tail
                    try:
                        self.stats.bytes_written += write_tail(self.folder, name, rec, parent,
                                                               self.tail_layout)
                    except OSError as exc:
                        self.stats.write_errors.append(f"{name}: {exc.strerror or exc}")
                if job.window is not None and job.hash is not None:
                    try:
                        self._write_window(job.hash, job.window, job.mtime_ns)
                    except OSError as exc:
                        self.stats.write_errors.append(f"{job.hash.hex()}.kvw: "
                                                       f"{exc.strerror or exc}")
                self._evict()
            finally:
                self._q.task_done()

    def _page_record(self, job: _Job, depth: int, parent: bytes, h: bytes, toks: np.ndarray
                     ) -> list[Any]:
        """One page's record as buffers: page header, then one SSD-tier record per layer."""
        P = self.P
        # The page header, once the digests are known; then the summaries.
        bufs: list[Any] = [b"", b""]
        x = xxhash.xxh3_64()
        pos = (depth - job.first) * P
        q = self.codec.quantized
        sums = np.empty((self.n_layers, 2, self.kv_heads, self.blocks, self.head_dim),
                        self.sum_dtype)
        for layer in range(self.n_layers):
            head = PageHeader(layer, depth, depth * P, P, self.dtype_code, self.codec.bits,
                              self.kv_heads, self.head_dim, P, self.payload,
                              self.codec.group if q else 0).pack()
            segs: list[Any] = [head]
            if job.paged is not None:
                # Part by part, each (kv_heads, P, n): the SSD tier's record layout.
                kp, vp, lo, hi = job.paged[depth - job.first][layer]
                sums[layer, 0], sums[layer, 1] = lo, hi
                for parts in (kp, vp):
                    segs.extend(np.ascontiguousarray(a).data.cast("B") for a in parts)
            else:
                keys = _as_float32(job.k[layer][:, pos:pos + P]).reshape(
                    self.kv_heads, self.blocks, self.block, self.head_dim)
                sums[layer, 0], sums[layer, 1] = keys.min(axis=2), keys.max(axis=2)
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
        bufs[1] = sums.data.cast("B")
        body = _PX.pack(PREFIX_MAGIC, PREFIX_VERSION, P, depth, self.n_layers, parent, h,
                        x.intdigest(), xxhash.xxh3_64_intdigest(bufs[1])) + toks.tobytes()
        bufs[0] = body + _CRC.pack(zlib.crc32(body))
        return bufs

    def _write_run(self, job: _Job) -> None:
        """Write the job's pages as one run file: temp file, then rename into place."""
        first, parent, h0, _ = job.pages[0]
        body = _RUN.pack(RUN_MAGIC, PREFIX_VERSION, self.P, self.n_layers, first,
                         len(job.pages), self.page_bytes, parent, self.key)
        body += b"".join(h for _, _, h, _ in job.pages)
        final = self.path(h0)
        tmp = self.folder / f".tmp-{os.getpid()}-{h0.hex()[:16]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, body + _CRC.pack(zlib.crc32(body)))
            for depth, par, h, toks in job.pages:
                bufs = self._page_record(job, depth, par, h, toks)
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
        t = job.mtime_ns or time.time_ns()
        os.utime(final, ns=(t, t))
        self.stats.runs_written += 1
        self.stats.pages_written += len(job.pages)
        self.stats.bytes_written += self.run_head_bytes(len(job.pages)) + len(
            job.pages) * self.page_bytes

    # -- window files -------------------------------------------------------------------
    def _window_head(self, h: bytes, depth: int, counts: Sequence[int], digest: int) -> bytes:
        body = _WIN.pack(WINDOW_MAGIC, PREFIX_VERSION, self.P, depth, len(self.sliding), h,
                         digest) + struct.pack(f"<{len(counts)}I", *counts)
        return body + _CRC.pack(zlib.crc32(body))

    def _write_window(self, h: bytes, window: Window, mtime_ns: int = 0) -> None:
        """Write a window file (temp file, then rename into place, as runs)."""
        x = xxhash.xxh3_64()
        segs: list[Any] = []
        for k, v in zip(window.k, window.v, strict=True):
            for a in (k, v):
                seg = np.ascontiguousarray(a).data.cast("B")
                x.update(seg)
                segs.append(seg)
        head = self._window_head(h, window.tokens // self.P, [k.shape[1] for k in window.k],
                                 x.intdigest())
        final = self.window_path(h)
        tmp = self.folder / f".tmp-{os.getpid()}-{h.hex()[:16]}w"
        with open(tmp, "wb") as f:
            f.write(head)
            for seg in segs:
                f.write(seg)
        os.replace(tmp, final)
        t = mtime_ns or time.time_ns()
        os.utime(final, ns=(t, t))

    def _read_window(self, h: bytes, depth: int) -> list[tuple[Any, Any]] | None:
        """The sliding layers' (keys, values) at `depth` as MLX arrays (1, heads, n, dim),
        every byte verified; None if the file is missing or does not verify (then it goes)."""
        path = self.window_path(h)
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except OSError:
            return None
        try:
            data = b""
            size = os.fstat(fd).st_size
            while len(data) < size:
                chunk = os.pread(fd, size - len(data), len(data))
                if not chunk:
                    break
                data += chunk
        except OSError:
            return None
        finally:
            os.close(fd)
        out = self._parse_window(data, h, depth)
        if out is None:
            with contextlib.suppress(OSError):
                path.unlink()
            self.stats.corrupt_pages += 1
        return out

    def _parse_window(self, data: bytes, h: bytes, depth: int
                      ) -> list[tuple[Any, Any]] | None:
        m = len(self.sliding)
        head_size = _WIN.size + 4 * m + _CRC.size
        if len(data) < head_size:
            return None
        body = data[:head_size - _CRC.size]
        if zlib.crc32(body) != _CRC.unpack_from(data, head_size - _CRC.size)[0]:
            return None
        magic, version, ptok, d, layers, own, digest = _WIN.unpack_from(body)
        if (magic, version, ptok, d, layers, own) != (WINDOW_MAGIC, PREFIX_VERSION, self.P,
                                                      depth, m, h):
            return None
        counts = struct.unpack_from(f"<{m}I", body, _WIN.size)
        item = self.np_dtype.itemsize
        want = head_size
        for (_, w), cnt, (heads, dk, dv) in zip(self.sliding, counts, self.window_shapes,
                                                strict=True):
            if cnt != min(w, depth * self.P):
                return None
            want += heads * cnt * (dk + dv) * item
        if len(data) != want:
            return None
        payload = memoryview(data)[head_size:]
        if xxhash.xxh3_64_intdigest(payload) != digest:
            return None
        out = []
        pos = 0
        for cnt, (heads, dk, dv) in zip(counts, self.window_shapes, strict=True):
            arrs = []
            for dim in (dk, dv):
                nbytes = heads * cnt * dim * item
                a = np.frombuffer(payload[pos:pos + nbytes], self.np_dtype).reshape(
                    1, heads, cnt, dim)
                pos += nbytes
                x = mx.array(a)
                arrs.append(x.view(mx.bfloat16) if self.dtype_name == "bfloat16" else x)
            out.append((arrs[0], arrs[1]))
        return out

    # -- disk budget --------------------------------------------------------------------
    def disk_bytes(self) -> int:
        return sum(size for _, size, _ in _scan(self.folder))

    def set_budget(self, budget_mb: float) -> None:
        """A new disk budget, in force from now: the writer evicts down to it next."""
        if budget_mb < 0:
            raise PrefixCacheError(f"prefix cache budget {budget_mb} MB is negative")
        self.settings = replace(self.settings, budget_mb=float(budget_mb))
        if not self._closed:
            self._q.put(_Job([], [], [], 0))  # no pages: the writer only evicts

    def clear(self) -> tuple[int, int]:
        """Remove every stored run (queued runs are written first, then go too); returns the
        files and bytes removed. Call from the thread that stores."""
        self.flush()
        return clear_folder(self.folder)

    def _evict(self) -> None:
        """Over budget: remove files this layout cannot use, then least recently used runs,
        each with the runs that continue it (their parent page is gone: unreachable)."""
        # One budget for the store: live sessions' tiers in it are never evicted, runs make room.
        budget = int(self.settings.budget_mb * (1 << 20)) - sessions_bytes(self.folder)[1]
        entries = _scan(self.folder)
        total = sum(size for _, size, _ in entries)
        if total <= budget:
            return
        info = {path: self._run_info(path) for _, _, path in entries}
        size_of = {path: size for _, size, path in entries}
        alive = set(size_of)

        def remove(path: Path) -> None:
            nonlocal total
            with contextlib.suppress(OSError):
                path.unlink()
            alive.discard(path)
            total -= size_of[path]
            run = info[path]
            if run is not None:
                self.stats.evicted_runs += 1
                self.stats.evicted_pages += run.present

        def usable(path: Path) -> bool:
            return info[path] is not None or path.suffix in (".kvw", TAIL_SUFFIX)

        order = sorted(entries, key=lambda e: (usable(e[2]), e[0]))
        for _mtime, _size, path in order:
            if total <= budget:
                break
            if path not in alive:
                continue
            remove(path)
            # Runs whose parent page no longer is on disk: drop them too, until none is left.
            while True:
                stored = {h for p in alive if (r := info[p]) is not None
                          for h in r.hashes[:r.present]}
                orphans = [p for p in alive if (r := info[p]) is not None and r.first > 0
                           and r.parent not in stored]
                # Window files whose page is gone: no lookup can reach them.
                orphans += [p for p in alive if p.suffix == ".kvw"
                            and _stem_hash(p) not in stored]
                if not orphans:
                    break
                for p in orphans:
                    remove(p)

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
            if e.name.endswith((".kvp", ".kvw", TAIL_SUFFIX)):
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    out.append((st.st_mtime_ns, st.st_size, Path(e.path)))
    return out


LABELS = "labels.json"  # model key (hex) -> the model's name, written by `label`


def sessions_bytes(folder: Path) -> tuple[int, int]:
    """Live sessions' SSD tiers inside a store folder (engine.kv.store): (sessions, bytes).
    A dead process's tier (swept by the next store that opens) does not count."""
    n = total = 0
    with contextlib.suppress(OSError):
        for e in os.scandir(folder / SESSIONS_DIR):
            m = SESSION_NAME.match(e.name)
            if not e.is_dir(follow_symlinks=False) or (m and not pid_alive(int(m.group(1)))):
                continue
            n += 1
            with contextlib.suppress(OSError):
                for f in os.scandir(e.path):
                    with contextlib.suppress(OSError):
                        total += f.stat(follow_symlinks=False).st_size
    return n, total


def folder_summary(folder: Path) -> dict[str, Any]:
    """What a page store folder holds, for `strata cache` and the memory panel: runs, full
    pages, tails, window files and bytes, in all and per model (keyed by the runs' model
    key, named from the labels file), and the live sessions' tiers (`sessions`,
    `session_bytes`, not in `bytes`); files of another format count as `stale`."""
    try:
        labels = json.loads((folder / LABELS).read_text())
    except (OSError, ValueError):
        labels = {}
    total: dict[str, Any] = {"runs": 0, "pages": 0, "tails": 0, "windows": 0, "bytes": 0,
                             "stale_files": 0, "stale_bytes": 0}
    models: dict[str, dict[str, Any]] = {}
    for _, size, path in _scan(folder):
        total["bytes"] += size
        if path.suffix == TAIL_SUFFIX:
            total["tails"] += 1
            continue
        if path.suffix == ".kvw":
            total["windows"] += 1
            continue
        head = b""
        with contextlib.suppress(OSError), open(path, "rb") as f:
            head = f.read(_RUN.size)
        if len(head) < _RUN.size or head[:8] != RUN_MAGIC or struct.unpack_from(
                "<H", head, 8)[0] != PREFIX_VERSION:
            total["stale_files"] += 1
            total["stale_bytes"] += size
            continue
        *_, n, pbytes, _parent, key = _RUN.unpack(head)
        pages = min(n, max(0, size - _RUN.size - 32 * n - _CRC.size) // max(1, pbytes))
        m = models.setdefault(key.hex(), {"name": labels.get(key.hex()), "runs": 0,
                                          "pages": 0, "bytes": 0})
        m["runs"] += 1
        m["pages"] += pages
        m["bytes"] += size
        total["runs"] += 1
        total["pages"] += pages
    total["models"] = sorted(models.values(), key=lambda m: -m["bytes"])
    total["sessions"], total["session_bytes"] = sessions_bytes(folder)
    return total


def folder_runs(folder: Path) -> tuple[int, int]:
    """How many run files a prefix folder holds and the bytes of everything stored (window
    files included); (0, 0) if it does not exist."""
    entries = _scan(folder)
    return (sum(1 for _, _, p in entries if p.suffix == ".kvp"),
            sum(size for _, size, _ in entries))


def clear_folder(folder: Path) -> tuple[int, int]:
    """Remove the run files (and format 2's page files) in a prefix folder; (files, bytes).
    A process restoring from one of them still reads it through its open descriptor."""
    files = removed = 0
    for _, size, path in _scan(folder):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            files += 1
            removed += size
    return files, removed


def _close_at_exit(ref: weakref.ref[PrefixCache]) -> None:
    cache = ref()
    if cache is not None:
        cache.close()


def _will_need(fd: int, offset: int, length: int) -> None:
    """Ask the OS to start reading this range into the page cache (no wait, no error)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        with contextlib.suppress(OSError):
            advise(fd, offset, length, os.POSIX_FADV_WILLNEED)


class _Unwritten(io.RawIOBase):
    """A file whose header `mx.load` parses and whose data it reads into its fresh buffers,
    which this stream leaves as they are."""

    def __init__(self, name: str, header: bytes, nbytes: int) -> None:
        super().__init__()
        self.name = name  # mx.load may look at the suffix
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


_ST_DTYPES = {"float32": "F32", "float16": "F16", "uint16": "U16"}


def _unfilled(count: int, shape: tuple[int, ...], dtype: Any, np_dtype: np.dtype) -> list[Any]:
    """`count` MLX arrays whose memory is allocated but not yet written: mx.zeros would touch
    (and so fault in) every page first, which costs as much as reading the page from the disk.
    One safetensors stream makes them all (a .npy load per array took about twice as long).
    Falls back to mx.zeros where this MLX cannot load from a file object."""
    nbytes = int(np.prod(shape)) * np_dtype.itemsize
    meta = {f"a{i}": {"dtype": _ST_DTYPES.get(np_dtype.name, "?"), "shape": list(shape),
                      "data_offsets": [i * nbytes, (i + 1) * nbytes]} for i in range(count)}
    head = json.dumps(meta).encode()
    head += b" " * (-len(head) % 8)
    try:
        src = cast(Any, _Unwritten("kv.safetensors", struct.pack("<Q", len(head)) + head,
                                   count * nbytes))
        loaded = mx.load(src, format="safetensors")
        out = [loaded[f"a{i}"] for i in range(count)] if isinstance(loaded, dict) else []
        if all(tuple(a.shape) == tuple(shape) and a.dtype == dtype for a in out) and out:
            return out
    except (ValueError, RuntimeError, TypeError, KeyError):
        pass
    return [mx.zeros(shape, dtype=dtype) for _ in range(count)]


def _as_float32(a: np.ndarray) -> np.ndarray:
    """Keys as float32 (exact): bfloat16 travels as raw 16-bit words, the top half of a
    float32."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _stem_hash(path: Path) -> bytes | None:
    """The chain hash a window file is named after, None if the name is not one."""
    try:
        return bytes.fromhex(path.stem)
    except ValueError:
        return None


def _is_rotating(c: Any) -> bool:
    """mlx-lm's RotatingKVCache: a sliding-window layer's cache."""
    return type(c).__name__ == "RotatingKVCache" and hasattr(c, "keys")


def _temporal(a: Any, idx: int, offset: int) -> Any:
    """A rotating cache's keys or values in position order (its keep is 0), as mlx-lm's
    own reordering: the write index `idx` marks where the oldest position now sits."""
    size = a.shape[2]
    if idx == size:
        return a
    if idx < offset:
        return mx.concatenate([a[..., idx:, :], a[..., :idx, :]], axis=2)
    return a[..., :idx, :]


def _is_kvcache(c: Any) -> bool:
    """mlx-lm's plain KVCache (not rotating, quantized or paged): the layout pages map onto."""
    return type(c).__name__ == "KVCache" and hasattr(c, "keys")


def prefix_folder_bytes(settings: PrefixSettings | None = None) -> int:
    """Bytes the prefix folder holds (for the memory panel), 0 if it does not exist."""
    s = settings or settings_from_env()
    return sum(size for _, size, _ in _scan(s.root()))


def _paged(caches: Sequence[Any], full: Sequence[int]) -> bool:
    """Whether the full-attention layers' caches are the paged KV cache's, over one store."""
    cs = [caches[i] for i in full]
    return bool(cs) and all(isinstance(c, PagedLayerCache) for c in cs) and len(
        {id(c.store) for c in cs}) == 1


def _set_window(c: Any, k: Any, v: Any, end: int) -> None:
    """A sliding layer's cache as a prefill to `end` would leave it: its last min(window,
    end) positions (k, v: (1, heads, n, dim)); mlx-lm's rotating cache or the paged mode's
    window cache."""
    if isinstance(c, WindowLayerCache):
        n = k.shape[2]
        cap = -(-(n + WINDOW_STEP) // WINDOW_STEP) * WINDOW_STEP
        nk = mx.zeros((1, k.shape[1], cap, k.shape[3]), k.dtype)
        nv = mx.zeros((1, v.shape[1], cap, v.shape[3]), v.dtype)
        nk[..., :n, :] = k
        nv[..., :n, :] = v
        mx.eval(nk, nv)
        c.keys, c.values, c.start, c.offset = nk, nv, end - n, end
    else:
        c.state = (k, v, end, 0, c.max_size, k.shape[2])

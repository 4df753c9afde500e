"""The page store's file format: keys, chain hashes, run files, page records, window files.

Contract: a page is `page_tokens` prompt tokens; its hash is sha256(parent hash, model key,
page token ids): a chain, so a page is found only after the same tokens, on the same weights,
config (RoPE, quantization), compute profile and KV dtype/bits (`model_key`). Format 4: a run
file, `<hash of its first page>.kvp`, is a run header (layout, parent hash, model key, the
chain hashes of its pages, CRC-32), then one page record per page, each `page_bytes` long:
the page header (hashes, depth, token ids, xxh3-64 digests of the layer records and of the
summaries, CRC-32), the key summaries (every layer's min and max of the keys per block of
BLOCK_TOKENS), and one SSD-tier record per layer (engine.kv.pagefile's header and CRC), so
the two tiers share one record format. `PrefixLayout` holds one model's sizes and reads,
checks and builds these records; it writes and restores nothing itself
(engine.kv.prefix_writer, engine.kv.prefix_restore) and keeps no index (engine.kv.prefix_table).
A window file (`<chain hash>.kvw`) holds a sliding model's window layers at a page boundary.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
import xxhash

from engine.errors import StrataError
from engine.kv.cache import WINDOW_STEP, PagedLayerCache, WindowLayerCache
from engine.kv.codec import PageCodec
from engine.kv.crc import crc32
from engine.kv.pagefile import (
    _CRC,
    _HEADER,
    _HEADER_Q,
    DTYPE_CODES,
    FORMAT_VERSION,
    MAGIC,
)
from engine.kv.settings import store_root
from engine.kv.table import BLOCK_TOKENS, SUMMARY_DTYPE
from engine.kv.tail import TailLayout

PREFIX_MAGIC = b"STRATAPX"


RUN_MAGIC = b"STRATARN"


PREFIX_VERSION = 4


_PX = struct.Struct("<8sHIII32s32sQQ")


_RUN = struct.Struct("<8sHIIIIQ32s32s")


WINDOW_MAGIC = b"STRATAWN"


_WIN = struct.Struct("<8sHIII32sQ")


_BF16_CODE = 3


PAGE_TOKENS = 128  # as the paged KV cache; 64 vs 256 not yet measured (docs/benchmarks.md)


_IOV_MAX = 1024


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


class RunHead(NamedTuple):
    """A run file's verified header, whatever its layout: its inode and size, page tokens,
    layers, first depth, pages listed, bytes per page record, parent hash, model key, the
    hashes it lists and the bytes before its first page record."""

    ino: int
    size: int
    ptok: int
    layers: int
    first: int
    n: int
    pbytes: int
    parent: bytes
    key: bytes
    hashes: list[bytes]
    head: int


def read_run_head(path: Path, remove_link: bool = False) -> RunHead | None:
    """`path`'s run header if it is a run of this format whose header checksum verifies,
    else None. A link is never followed (and removed with `remove_link`: the folder's own
    readers remove what is not theirs; the folder views only look)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as exc:
        if remove_link and exc.errno == errno.ELOOP:
            with contextlib.suppress(OSError):
                path.unlink()
        return None
    try:
        st = os.fstat(fd)
        head = os.pread(fd, 4096, 0)
        if len(head) < _RUN.size:
            return None
        magic, version, ptok, layers, first, n, pbytes, parent, key = _RUN.unpack_from(head)
        size = _RUN.size + 32 * n + _CRC.size
        if (magic, version) != (RUN_MAGIC, PREFIX_VERSION) or n < 1 or pbytes < 1 \
                or size > st.st_size:
            return None
        if size > len(head):
            head += os.pread(fd, size - len(head), len(head))
        if len(head) < size or crc32(head[:size - _CRC.size]) != _CRC.unpack_from(
                head, size - _CRC.size)[0]:
            return None
        hashes = [head[_RUN.size + 32 * i:_RUN.size + 32 * (i + 1)] for i in range(n)]
        return RunHead(st.st_ino, st.st_size, ptok, layers, first, n, pbytes, parent, key,
                       hashes, size)
    except OSError:
        return None
    finally:
        os.close(fd)


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
class TailSnapshot:
    """What `tail_snapshot` took at the end of a prefill: the positions after the last full
    page, (paged caches) their tail arrays as they stood then, the next-token logits and (sparse
    mode) each layer's question votes, taken at token `votes_at`."""

    start: int
    tokens: np.ndarray
    k: list[Any] | None
    v: list[Any] | None
    logits: Any
    votes: list[Any] | None = None
    votes_at: int = 0


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
    asked_pages: int = 0  # full pages lookups asked for (this process)
    found_pages: int = 0  # of them, found stored
    write_errors: list[str] = field(default_factory=list)
    # The page table's (its figures and per-page eviction wait until it can be written).
    table_errors: list[str] = field(default_factory=list)


class PrefixLayout:
    """One model's layout of page records (the full-attention layers' geometry, the codec,
    the key, the folder) and what reads, checks and builds them; no threads, no index."""

    stats: PrefixStats
    tails: bool
    _closed: bool

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

    def window_path(self, h: bytes) -> Path:
        """The window file of the depth whose last page has chain hash `h`."""
        return self.folder / f"{h.hex()}.kvw"

    def path(self, h: bytes) -> Path:
        """The run file that starts with page `h` (whether or not it exists)."""
        return self.folder / f"{h.hex()}.kvp"

    def run_head_bytes(self, pages: int) -> int:
        return _RUN.size + 32 * pages + _CRC.size

    def _run_info(self, path: Path) -> _Run | None:
        """The run header of `path` if it is a run of this layout that verifies, else None.
        A link in the folder is not ours: it is removed, never followed."""
        h = read_run_head(path, remove_link=True)
        if h is None or (h.ptok, h.layers, h.pbytes, h.key) != (
                self.P, self.n_layers, self.page_bytes, self.key):
            return None
        present = min(h.n, (h.size - h.head) // self.page_bytes)
        return _Run(path, h.ino, h.first, h.parent, h.hashes, present, h.head)

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

    def _fits(self, store: Any) -> bool:
        """Whether a paged store's pages are this cache's records: page size, shape, dtype,
        bits and (quantized) group."""
        c = store.codec
        return ((store.P, store.kv_heads, store.head_dim, store.n_layers, c.bits, c.dtype)
                == (self.P, self.kv_heads, self.head_dim, self.n_layers, self.codec.bits,
                    self.codec.dtype)
                and (not c.quantized or c.group == self.codec.group))

    def _header_digest(self, head: bytes, h: bytes, depth: int,
                       prompt: Sequence[int] | np.ndarray) -> tuple[int, int] | None:
        """The digests a page header promises (layer records, summaries), if the header
        checks (CRC, magic, layout, its hash, depth, tokens); None otherwise. `prompt` may be
        the ids as a "<u4" array already (a restore checks a thousand headers)."""
        P = self.P
        body = head[:-_CRC.size]
        if crc32(body) != _CRC.unpack(head[-_CRC.size:])[0]:
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

    def _window_head(self, h: bytes, depth: int, counts: Sequence[int], digest: int) -> bytes:
        body = _WIN.pack(WINDOW_MAGIC, PREFIX_VERSION, self.P, depth, len(self.sliding), h,
                         digest) + struct.pack(f"<{len(counts)}I", *counts)
        return body + _CRC.pack(crc32(body))

    def _parse_window(self, data: bytes, h: bytes, depth: int
                      ) -> list[tuple[Any, Any]] | None:
        m = len(self.sliding)
        head_size = _WIN.size + 4 * m + _CRC.size
        if len(data) < head_size:
            return None
        body = data[:head_size - _CRC.size]
        if crc32(body) != _CRC.unpack_from(data, head_size - _CRC.size)[0]:
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

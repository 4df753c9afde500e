"""How the KV cache is kept, and the shape of what it keeps: `KVSettings` and `KVGeometry`.

Contract: `KVSettings` (mode, budgets, page size, bits) is validated by `validate()` with one
line naming the bad value; `settings_from_env(**overrides)` reads STRATA_KV_*. `store_root(home)`
is the one page store's folder: stored runs (engine.kv.prefix) at its top, live sessions' SSD
tiers in its `sessions` folder (engine.kv.store); the first call renames the prefix folder
of earlier versions to it. `KVGeometry` is
all the KV layer knows of a model: layers, KV heads, head dim and the dtype keys and values are
computed in; the runtime derives it from the loaded model, so kv never sees a LoadedModel.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.errors import StrataError
from engine.platform import default_home, pid_alive

STORE_DIR = "pages"
SESSIONS_DIR = "sessions"
LEGACY_DIRS = ("prefix", "kv")  # earlier versions: stored runs, sessions' tiers
SESSION_NAME = re.compile(r"^(\d+)-[0-9a-f]{8}$")  # a session folder's default name: pid-hex


def store_root(home: Path | None = None) -> Path:
    """The page store under `home` (None: Strata's home). One-time migration: the stored
    runs of earlier versions' `prefix` folder move here by a rename (no copy)."""
    home = Path(home) if home is not None else default_home()
    root = home / STORE_DIR
    old = home / LEGACY_DIRS[0]
    if not root.exists() and old.is_dir():
        try:
            old.rename(root)
        except OSError:
            pass  # another process moved it first, or a read-only home: the runs are rebuilt
    kv = home / LEGACY_DIRS[1]
    if kv.is_dir():  # earlier versions' session tiers: only dead ones are left to sweep
        sweep_dead_sessions(kv)
        with contextlib.suppress(OSError):
            kv.rmdir()  # empty now, unless a session of an older process still runs
    return root


def sweep_dead_sessions(root: Path) -> None:
    """Remove the page files of sessions whose process died without closing (kill -9, crash):
    nothing reads them again (named sessions, kept on purpose, are left alone)."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return
    for e in entries:
        m = SESSION_NAME.match(e.name)
        if m and e.is_dir(follow_symlinks=False):
            pid = int(m.group(1))
            if pid != os.getpid() and not pid_alive(pid):
                shutil.rmtree(e.path, ignore_errors=True)


class KVUnpageable(StrataError):
    """The paged KV cache cannot hold this model (its geometry's `unpaged` line)."""


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one model's KV. `kv_heads` heads of `head_dim` in `dtype` per layer that
    pages (full attention); `windows` gives each layer's kind: 0 for full attention, W > 0 for
    a sliding-window layer that attends to its last W positions (kept in RAM, never paged);
    empty means every layer is full attention. `shapes` is each layer's (kv_heads, key dim,
    value dim), where they are known (empty: all `kv_heads`, `head_dim`, `head_dim`).
    `unpaged` is the one line saying why the paged cache cannot hold this model (recurrent
    or hybrid layers, attention outside the hooked function, key and value dims that differ),
    None if it can; `no_prefix` the same for the SSD prefix cache."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float32", "float16" or "bfloat16": the compute dtype
    windows: tuple[int, ...] = ()
    shapes: tuple[tuple[int, int, int], ...] = ()
    unpaged: str | None = None
    no_prefix: str | None = None
    # The model's plain RoPE and trained length, for sparse mode's remapping past it
    # (engine/kv/remap.py); rope_dims 0 when the config scales its own positions (llama3,
    # YaRN, linear...) or the RoPE is not MLX's plain one: never remapped.
    rope_dims: int = 0
    rope_traditional: bool = False
    rope_base: float = 10000.0
    rope_scale: float = 1.0
    trained_context: int = 0

    @property
    def width(self) -> int:
        return 4 if self.dtype == "float32" else 2

    def window(self, layer: int) -> int:
        """The sliding window of `layer`, 0 if it attends to the whole context."""
        return self.windows[layer] if self.windows else 0

    def shape(self, layer: int) -> tuple[int, int, int]:
        """(kv_heads, key dim, value dim) of `layer`."""
        return self.shapes[layer] if self.shapes else (self.kv_heads, self.head_dim,
                                                       self.head_dim)

    @property
    def paged_layers(self) -> list[int]:
        """The layers whose KV grows with the context (full attention): those that page."""
        return [i for i in range(self.layers) if self.window(i) == 0]

    @property
    def window_layers(self) -> list[int]:
        return [i for i in range(self.layers) if self.window(i) > 0]

    def bytes_per_token(self) -> int:
        """KV bytes one more token of context costs: full-attention layers only (a sliding
        layer's cost stops growing at its window)."""
        return sum(self._layer_token_bytes(i) for i in self.paged_layers)

    def kv_bytes(self, context: int) -> int:
        """KV bytes at `context` tokens: each full layer holds the context, each sliding layer
        at most its window."""
        total = 0
        for i in range(self.layers):
            w = self.window(i)
            total += self._layer_token_bytes(i) * (min(w, context) if w else context)
        return total

    def _layer_token_bytes(self, layer: int) -> int:
        heads, dk, dv = self.shape(layer)
        return heads * (dk + dv) * self.width


MODES = ("mlx", "exact", "sparse")
# The page store in exact mode is the default KV cache: up to CONTIG_MAX positions a layer
# its RAM tier is one contiguous buffer on which attention runs mlx-lm's ops (engine.kv.cache;
# no second copy of the KV), past it pages, and it keeps prefixes across restarts. 'mlx'
# (mlx-lm's KVCache) stays the benchmarks' peer and the fallback for models the store cannot
# page (KVGeometry.unpaged).
DEFAULT_MODE = "exact"
BITS = (16, 8, 4)  # KV precision: 16 keeps the compute dtype, 8 and 4 quantize pages
GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts
# Group size by bits when not set (docs/benchmarks.md, KV bits): at 8 bits the group hardly
# changes KL on the starter model, so the larger one (fewer scale bytes); at 4 bits group 32
# cuts KL about in half for 20% more bytes than group 64.
DEFAULT_GROUP = {16: 64, 8: 64, 4: 32}


@dataclass(frozen=True)
class KVSettings:
    """How the KV cache is kept (mode: DEFAULT_MODE unless set). mode 'mlx' is mlx-lm's own
    in-memory KVCache.

    ram_mb: RAM tier budget (None: a quarter of system memory). ssd_mb: SSD tier budget.
    budget_tokens: sparse mode's attention budget per query (sinks and window included).
    bits: 16 keeps the compute dtype (no KV quantization); 8 and 4 quantize every full page
    group-wise along head_dim, `group_size` values per scale and bias (None: by bits,
    DEFAULT_GROUP); the partial page at the end stays as computed until it fills. Paged
    modes only.
    """

    mode: str = DEFAULT_MODE
    page_tokens: int = 128
    ram_mb: int | None = None
    ssd: bool = True
    ssd_dir: Path | None = None
    ssd_mb: int = 64 * 1024
    bits: int = 16
    group_size: int | None = None
    budget_tokens: int = 2048
    sink_tokens: int = 128
    window_tokens: int = 512
    prefetch_depth: int = 4
    writer_queue: int = 64
    keep_files: bool = False

    def validate(self) -> KVSettings:
        if self.mode not in MODES:
            raise StrataError(f"KV mode {self.mode!r} is unknown: use one of {', '.join(MODES)}")
        if self.page_tokens < 8 or self.page_tokens & (self.page_tokens - 1):
            raise StrataError(f"KV page size {self.page_tokens} must be a power of two >= 8")
        if self.bits not in BITS:
            raise StrataError(f"KV bits {self.bits} are not supported: use 16, 8 or 4")
        if self.bits != 16 and self.mode == "mlx":
            raise StrataError(f"KV bits {self.bits} need the paged KV cache (KV mode exact "
                              "or sparse, --kv-mode): mode 'mlx' is 16-bit only")
        if self.group_size is not None and self.group_size not in GROUP_SIZES:
            raise StrataError(f"KV quantization group {self.group_size} is not supported: "
                              f"use {', '.join(map(str, GROUP_SIZES))}")
        if self.ram_mb is not None and self.ram_mb < 1:
            raise StrataError(f"KV RAM budget {self.ram_mb} MB is too small")
        if self.budget_tokens < self.sink_tokens + self.window_tokens + self.page_tokens:
            least = self.sink_tokens + self.window_tokens + self.page_tokens
            raise StrataError(f"KV budget of {self.budget_tokens} tokens is below sinks + "
                              f"window + one page ({least})")
        return self

    def group(self) -> int:
        """The quantization group size in effect."""
        return self.group_size or DEFAULT_GROUP.get(self.bits, 64)

    def with_(self, **kw: Any) -> KVSettings:
        return replace(self, **kw)

    def ram_bytes(self) -> int:
        if self.ram_mb is not None:
            return self.ram_mb << 20
        import psutil  # third-party; only a default budget needs the machine's memory

        return max(512 << 20, int(psutil.virtual_memory().total) // 4)

    def folder(self) -> Path:
        if self.ssd_dir is not None:
            return Path(self.ssd_dir)
        return store_root() / SESSIONS_DIR


def settings_from_env(**overrides: Any) -> KVSettings:
    """KVSettings from STRATA_KV_MODE / STRATA_KV_RAM_MB / STRATA_KV_BUDGET plus overrides."""
    env: dict[str, Any] = {}
    if os.environ.get("STRATA_KV_MODE"):
        env["mode"] = os.environ["STRATA_KV_MODE"]
    if os.environ.get("STRATA_KV_RAM_MB"):
        env["ram_mb"] = int(os.environ["STRATA_KV_RAM_MB"])
    if os.environ.get("STRATA_KV_BUDGET"):
        env["budget_tokens"] = int(os.environ["STRATA_KV_BUDGET"])
    env.update({k: v for k, v in overrides.items() if v is not None})
    return KVSettings(**env).validate()

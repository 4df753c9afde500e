"""One owner of the loaded model: its KV settings and prefix cache, its prompt caches with
their LRU, the prewarm of a system prompt, and the memory figures the panel shows.

Contract: engine thread only (MLX state belongs to the thread that made it). `get(name)`
makes `name` the loaded model (one at a time: two may not fit in memory), closing the old one
with every cache of it, and gives it the pool's `PoolSettings`; `on_loading(name)` and
`on_loaded(info)` hear of each load. Prompt caches come two ways, under one owner:
`session(key)` is a chat's own ChatSession (the `sessions` most recently used stay; older
ones prefill again), and `cache_for(lm, prompt)` picks among `caches` prompt caches by shared
prefix (the server's requests). `configure(settings)` applies new settings: KV settings shape
caches made from then on, so every session and cache is dropped; the prefix budget applies at
once. `prewarm(key, system)` prefills the chat template's preamble and a system prompt into a
chat's session (restored from the prefix cache where stored). `memory()` is the panel's
MemorySnapshot (KV in RAM counts each layer as it is held: a sliding-window layer its window,
a paged layer its resident pages). A model the paged KV cache cannot hold runs in mlx-lm's
cache: its one line is logged as a warning (once, by generate), comes with `on_loaded`
("kv_notice") and is the reason the memory figures give for no SSD tier. The `strata`
command, the server host and the window's worker all use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.errors import Cancelled, StrataError
from engine.kv import KVSettings, shared_bytes, ssd_bytes
from engine.kv import settings_from_env as kv_settings_from_env
from engine.kv.prefix import PrefixCache, PrefixSettings, clear_folder, prefix_folder_bytes
from engine.kv.prefix import settings_from_env as prefix_settings_from_env
from engine.kv.settings import DEFAULT_MODE, SESSIONS_DIR, store_root
from engine.library import Library, Manifest
from engine.platform import (
    MemorySnapshot,
    memory_snapshot,
    parameter_bytes,
    release_freed_memory,
)
from engine.runtime.generate import ChatSession, LoadedModel, PromptCache, generate
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import Drafter, DraftModels
from engine.telemetry import CancelFlag, GenerationEvent, Timeline

log = logging.getLogger(__name__)

# A cache is reused for a prompt that shares at least this many tokens with it (or extends
# it); below that, a fresh cache is taken so one request cannot trim another's warm prefix.
MIN_SHARED = 32
SESSIONS = 8  # chats whose KV stays in RAM; older ones prefill again when reopened
CACHES = 4  # the server's prompt caches per model
STORE_SUMMARY_S = 5.0  # how stale the panel's stored-page counts may be


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids `a` and `b` share."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


@dataclass(frozen=True)
class PoolSettings:
    """How the pool's models keep their KV. kv None: mlx-lm's in-memory KVCache. prefix_mb
    None: the environment's budget (STRATA_PREFIX_MB); prefix_dir None: STRATA_PREFIX_DIR, else
    the page store under the library's home (engine.kv.settings.store_root)."""

    kv: KVSettings | None = None
    prefix_cache: bool = True
    prefix_mb: float | None = None
    prefix_dir: Path | None = None
    draft: str = "auto"  # speculative decoding: auto, off, lookup or a draft model's name


def settings_from_options(options: Mapping[str, Any], home: Path) -> PoolSettings:
    """The window's engine settings (kv_mode, kv_ram_mb, kv_bits, kv_budget_tokens,
    prefix_cache, prefix_mb; missing keys: defaults and STRATA_KV_*) as PoolSettings, the
    paged KV's session files in the page store under `home` (engine.kv.settings.store_root).
    Raises StrataError or ValueError on bad values."""
    ram = int(options.get("kv_ram_mb") or 0)
    mode = str(options.get("kv_mode") or DEFAULT_MODE)
    # KV bits apply to the paged cache only; mlx-lm's in-memory cache stays 16-bit.
    bits = int(options.get("kv_bits") or 16) if mode != "mlx" else 16
    kv = kv_settings_from_env(mode=mode, bits=bits, ram_mb=ram if ram > 0 else None,
                              budget_tokens=int(options.get("kv_budget_tokens") or 2048),
                              ssd_dir=store_root(home) / SESSIONS_DIR)
    mb = options.get("prefix_mb")
    return PoolSettings(kv=kv, prefix_cache=bool(options.get("prefix_cache", True)),
                        prefix_mb=None if mb is None else max(0.0, float(mb)),
                        draft=str(options.get("draft") or "auto"))


class ModelPool:
    """The loaded model and every prompt cache of it (see the module docstring)."""

    def __init__(self, library: Library | None = None, settings: PoolSettings | None = None,
                 sessions: int = SESSIONS, caches: int = CACHES) -> None:
        self.library = library or Library()
        self.settings = settings or PoolSettings()
        self.prefix_settings()  # a bad STRATA_PREFIX_* value fails here, in one line
        self.max_sessions = max(1, sessions)
        self.max_caches = max(1, caches)
        self.lm: LoadedModel | None = None
        self.sessions: OrderedDict[int, ChatSession] = OrderedDict()  # least recent first
        self.caches: list[PromptCache] = []  # the server's, least recently used first
        self.weights_bytes: int | None = None
        self.on_loading: Callable[[str], None] | None = None
        self.on_loaded: Callable[[dict[str, Any]], None] | None = None
        self._prefix_reason = ("no model loaded" if self.settings.prefix_cache
                               else "prefix cache off in the settings")
        # The draft setting's model, loaded once (engine.runtime.speculative).
        self.drafts = DraftModels(lambda name: LoadedModel.load(name, library=self.library))
        self.cluster: Any = None  # the loaded model split across Macs (engine.runtime.cluster)
        self._store_summary: tuple[float, int | None, int | None] = (-STORE_SUMMARY_S, None, None)

    # -- settings -------------------------------------------------------------------------
    def prefix_settings(self) -> PrefixSettings:
        """Where the prefix cache lives and its budget, under these settings."""
        s = self.settings
        folder = s.prefix_dir
        if folder is None and not os.environ.get("STRATA_PREFIX_DIR"):
            folder = store_root(Path(self.library.home))
        return prefix_settings_from_env(folder=folder, budget_mb=s.prefix_mb)

    def configure(self, settings: PoolSettings) -> None:
        """New settings, for the loaded model and every later one. Caches made under the old
        KV settings go (their next prompt restores or prefills again); a change of the draft
        setting alone keeps them."""
        old, self.settings = self.settings, settings
        try:
            self.prefix_settings()
        except StrataError:
            self.settings = old
            raise
        self._prefix_reason = ("no model loaded" if settings.prefix_cache
                               else "prefix cache off in the settings")
        if self.lm is not None:
            if replace(old, draft=settings.draft) != settings:  # only the drafts: KV stays
                self.forget()
            self._apply(self.lm)

    def _apply(self, lm: LoadedModel) -> None:
        """Give `lm` the KV settings and the prefix cache (or take it away)."""
        split = self.cluster is not None and lm is self.cluster.lm
        if not split:  # split: the ranks keep the KV settings they started with
            lm.kv_settings = self.settings.kv
        if not self.settings.prefix_cache:
            lm.disable_prefix_cache()
            self._prefix_reason = "prefix cache off in the settings"
            return
        try:
            wanted = self.prefix_settings()
            pc = lm.prefix_cache
            if pc is None or not lm.prefix_cache_fits():
                # None yet, or keyed for other KV settings (bits, group, page size).
                lm.enable_prefix_cache(wanted)
            elif wanted.budget_mb != pc.settings.budget_mb:
                pc.set_budget(wanted.budget_mb)  # evicts in the background
        except StrataError as exc:  # an unwritable folder: the prefix cache is optional
            log.warning("prefix cache off: %s", exc)
            self._prefix_reason = f"prefix cache unavailable: {exc}"

    # -- the model ------------------------------------------------------------------------
    def get(self, name: str, timeline: Timeline | None = None) -> LoadedModel:
        """The model `name` (a library name or alias, or an MLX folder), loaded unless it is
        the loaded one."""
        folder = Path(name)
        if folder.is_dir() and (folder / "config.json").is_file():
            manifest: Manifest = {"name": folder.name, "path": str(folder)}
            source = str(folder)
        else:
            manifest = self.library.get(name)
            source = manifest["name"]
        if self.lm is not None and self.lm.manifest["name"] == manifest["name"]:
            return self.lm
        if self.on_loading is not None:
            self.on_loading(manifest["name"])
        self.unload()
        timeline = timeline or Timeline()
        lm = LoadedModel.load(source, library=self.library, timeline=timeline)
        self._apply(lm)
        self.lm = lm
        self.weights_bytes = parameter_bytes(lm.model) + lm.packed.nbytes  # codes too
        if self.on_loaded is not None:
            self.on_loaded({"name": manifest["name"], "path": manifest["path"],
                            "weights_bytes": self.weights_bytes, "profile": lm.profile.name,
                            "phases": timeline.durations(), "kv_notice": lm.kv_notice})
        return lm

    def load_across(self, name: str, waiters: Sequence[str], key: str | None = None
                    ) -> LoadedModel:
        """`name` split across this Mac (rank 0) and the Macs waiting at `waiters` ("host:port",
        engine.runtime.cluster_find), in the paged KV mode if one is set, as the loaded model
        until the next load or unload. `key`: the server's key, for Macs off loopback (default
        $STRATA_API_KEY). No drafts on a split model; its prefix cache keeps each Mac's own
        heads or layers in that Mac's page store (engine.runtime.cluster_split)."""
        # Start-up: the cluster's transport loads when a model is split, not with the pool.
        from engine.runtime.cluster_find import start_invited

        manifest = self.library.get(name)
        if self.on_loading is not None:
            self.on_loading(manifest["name"])
        self.unload()
        kv = self.settings.kv if self.settings.kv and self.settings.kv.mode != "mlx" else None
        timeline = Timeline()
        with timeline.phase("ranks and weights"):
            cluster = start_invited(manifest["name"], list(waiters), self.library, kv=kv,
                                    key=key)
        cluster.watch()
        self.cluster, self.lm = cluster, cluster.lm
        self._apply(cluster.lm)
        ranks = list(cluster.ranks)
        self.weights_bytes = (int(ranks[0]["weights_bytes"]) if ranks
                              else parameter_bytes(cluster.lm.model))
        if self.on_loaded is not None:
            self.on_loaded({"name": manifest["name"], "path": manifest["path"],
                            "weights_bytes": self.weights_bytes, "profile": cluster.lm.profile.name,
                            "phases": timeline.durations(), "kv_notice": cluster.lm.kv_notice,
                            "ranks": ranks})
        return cluster.lm

    def unload(self) -> None:
        """Forget the loaded model: caches closed, pages queued for the prefix cache written,
        a split model's ranks stopped, freed memory given back to the OS."""
        self.forget()
        lm, self.lm, self.weights_bytes = self.lm, None, None
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            cluster.close()
        if lm is not None:
            lm.disable_prefix_cache()  # flushes pages still queued for the disk
        del lm
        release_freed_memory()

    def close(self) -> None:
        self.unload()

    # -- prompt caches --------------------------------------------------------------------
    def session(self, key: int) -> ChatSession:
        """Chat `key`'s session on the loaded model (a new one if none), most recent last."""
        lm = self.lm
        if lm is None:
            raise StrataError("no model is loaded")
        session = self.sessions.pop(key, None)
        if session is None or session.lm is not lm:
            if session is not None:
                session.cache.close()
            session = ChatSession(lm)
        self.sessions[key] = session
        while len(self.sessions) > self.max_sessions:
            self.forget(next(iter(self.sessions)))  # the least recently used
        return session

    def reply(self, key: int, model: str, text: str,
              history: Sequence[Mapping[str, str]] = (), system: str = "",
              params: SamplingParams | None = None, max_tokens: int = 512,
              cancel: CancelFlag | None = None, timeline: Timeline | None = None
              ) -> Iterator[GenerationEvent]:
        """Chat `key`'s reply to `text` on `model` (loaded if it is not), after `system` and
        the earlier turns `history`: the caller's record of the chat is the truth, and the
        session's KV keeps whatever prefix of it it already holds."""
        self.get(model)
        session = self.session(key)
        session.messages = ([{"role": "system", "content": system}] if system else [])
        session.messages += [dict(m) for m in history]
        cluster = self.cluster
        if cluster is None:
            drafter = self.drafter(session.lm)
            yield from session.send(text, params, max_tokens, cancel=cancel, timeline=timeline,
                                    drafter=drafter)
            return
        # A split model's other ranks follow one token a step: no drafts; a rank lost
        # mid-reply is the cluster's one line (which rank, after how many steps).
        try:
            yield from session.send(text, params, max_tokens, cancel=cancel, timeline=timeline,
                                    drafter="off")
        except RuntimeError as exc:
            raise cluster.lost(exc) from exc

    def drafter(self, lm: LoadedModel) -> str | Drafter:
        """What `generate(drafter=...)` takes for `lm` under the draft setting: a split model
        never drafts (its other ranks follow one token a step)."""
        if self.cluster is not None and lm is self.lm:
            return "off"
        return self.drafts.drafter(lm, self.settings.draft)

    def forget(self, key: int | None = None) -> None:
        """Drop chat `key`'s session (None: every session and every server cache), with what
        its KV holds (a paged cache's threads and files; the memory goes back to the OS)."""
        keys = list(self.sessions) if key is None else [key]
        for k in keys:
            session = self.sessions.pop(k, None)
            if session is not None:
                session.cache.close()
        if key is None:
            for pc in self.caches:
                pc.close()
            self.caches = []
        release_freed_memory()

    def cache_for(self, lm: LoadedModel, prompt: Sequence[int]) -> PromptCache:
        """The server's prompt cache for `prompt`: the one sharing the longest prefix with it
        (MIN_SHARED tokens at least), else a new one (or the least recently used, trimmed)."""
        if lm is not self.lm:
            raise StrataError(f"{lm.manifest['name']} is not the loaded model")
        best, best_len = None, -1
        for pc in self.caches:
            n = shared_prefix(pc.tokens, prompt)
            if n > best_len:
                best, best_len = pc, n
        if best is None or (best_len < MIN_SHARED and best_len < len(best.tokens)):
            if len(self.caches) < self.max_caches:
                best = lm.new_cache()
                self.caches.append(best)
            else:
                best = self.caches[0]  # the least recently used (reuse() trims it)
        self.caches.remove(best)
        self.caches.append(best)
        return best

    def discard(self, cache: PromptCache) -> None:
        """Drop a server cache whose KV may no longer match its tokens."""
        if cache in self.caches:
            self.caches.remove(cache)
        cache.close()

    def prompt_caches(self) -> list[PromptCache]:
        """Every prompt cache the pool holds: the chats' and the server's."""
        return [s.cache for s in self.sessions.values()] + list(self.caches)

    # -- prewarm --------------------------------------------------------------------------
    def prewarm(self, key: int, model: str, system: str,
                cancel: CancelFlag | None = None) -> dict[str, Any] | None:
        """Prefill the chat template's preamble and `system` into chat `key`'s session (or
        restore them from the prefix cache), if `model` is the loaded one; what it did, or
        None when there was nothing to do. Raises Cancelled if `cancel` stops it."""
        lm = self.lm
        if lm is None or lm.manifest["name"] != model or not system.strip():
            return None
        # What every first message of this chat starts with: the tokens two different user
        # messages share after the system prompt (preamble, system prompt, user header).
        a, b = ({"role": "user", "content": c} for c in ("a", "b"))
        sys_msg = {"role": "system", "content": system}
        ids_a = lm.tokenizer.encode_chat([sys_msg, a])
        prefix = ids_a[:shared_prefix(ids_a, lm.tokenizer.encode_chat([sys_msg, b]))]
        if len(prefix) < 2:
            return None
        session = self.session(key)
        held = shared_prefix(session.cache.tokens, prefix)
        info: dict[str, Any] = {"model": model, "tokens": len(prefix), "cached": held,
                                "prefilled": 0, "seconds": 0.0, "phases": {}}
        if held < len(prefix) - 1:
            timeline = Timeline()
            t0 = time.perf_counter()
            last = None
            for ev in generate(lm, prefix, SamplingParams(temperature=0.0), max_tokens=1,
                               cancel=cancel, prompt_cache=session.cache, timeline=timeline):
                last = ev
            if last is not None and last.finish_reason == "cancelled":
                session.cache.clear()
                raise Cancelled("prewarm cancelled")
            cached = last.cached_tokens if last is not None else 0
            info.update(cached=cached, prefilled=len(prefix) - cached,
                        seconds=time.perf_counter() - t0, phases=timeline.durations())
        return info

    # -- the prefix cache on disk ---------------------------------------------------------
    def clear_prefix(self) -> tuple[int, int]:
        """Remove every stored prefix from the disk (queued runs are written, then go too);
        the files and bytes removed."""
        if self.lm is not None and self.lm.prefix_cache is not None:
            return self.lm.prefix_cache.clear()
        return clear_folder(self.prefix_settings().root())

    # -- figures --------------------------------------------------------------------------
    def memory(self) -> MemorySnapshot:
        """Where the bytes are: weights, KV in RAM and on the SSD, the prefix cache on disk;
        a figure that does not exist now comes with the reason."""
        caches = self.prompt_caches()
        kv = sum(int(pc.nbytes) for pc in caches) if self.lm is not None else None
        kv_ssd, kv_reason, shared = None, "paged KV off", None
        settings = self.settings.kv
        if self.lm is not None and self.lm.kv_notice is not None:
            kv_reason = self.lm.kv_notice
        elif settings is not None and settings.mode != "mlx":
            if not settings.ssd:
                kv_reason = "SSD tier off"
            else:
                kv_ssd = ssd_bytes(c for pc in caches for c in pc.cache)
            shared = shared_bytes(c for pc in caches for c in pc.cache)
        prefix, prefix_reason = None, self._prefix_reason
        hits = lookups = None
        lm = self.lm
        if lm is not None and lm.prefix_cache is not None:
            prefix = lm.prefix_cache.disk_bytes()
            hits, lookups = lm.prefix_cache.stats.hits, lm.prefix_cache.stats.lookups
        elif lm is None and self.settings.prefix_cache:
            try:
                prefix = prefix_folder_bytes(self.prefix_settings())  # earlier runs' pages
            except StrataError as exc:  # a bad STRATA_PREFIX_* value
                prefix_reason = f"prefix cache unavailable: {exc}"
        budget = None
        if prefix is not None:
            with contextlib.suppress(StrataError):
                budget = int(self.prefix_settings().budget_mb * (1 << 20))
        snap = memory_snapshot(self.weights_bytes, kv, kv_ssd, prefix, kv_reason,
                               prefix_reason, shared, hits, lookups, budget)
        if lm is not None and lm.prefix_cache is not None:
            pages, shared_pages = self._store_pages(lm.prefix_cache)
            st = lm.prefix_cache.stats
            snap = replace(snap, store_pages=pages, store_shared_pages=shared_pages,
                                       store_asked_pages=st.asked_pages,
                                       store_found_pages=st.found_pages)
        if self.cluster is not None:  # a split model: a row per Mac (its weights and KV)
            return self.cluster.snapshot(snap, kv)
        return snap

    def _store_pages(self, prefix: PrefixCache) -> tuple[int | None, int | None]:
        """(stored pages, shared pages) from the page table, read at most every
        STORE_SUMMARY_S: the panel asks every second and a summary walks every chain."""
        now = time.monotonic()
        if now - self._store_summary[0] >= STORE_SUMMARY_S:
            try:
                s = prefix.table.summary()
                self._store_summary = (now, int(s["pages"]), int(s["shared_pages"]))
            except (OSError, sqlite3.Error):  # a store being swept or a full disk: no figure
                self._store_summary = (now, None, None)
        return self._store_summary[1], self._store_summary[2]

    def status(self) -> dict[str, Any]:
        """The loaded model and the server's prompt caches (most recent first)."""
        return {
            "model": self.lm.manifest["name"] if self.lm is not None else None,
            "prompt_caches": [{"tokens": len(pc.tokens), "bytes": pc.nbytes}
                              for pc in reversed(self.caches)],
        }

"""Load a library model and generate from it: the decode loop, prompt reuse, chat sessions.

Contract: `LoadedModel.load(name)` maps the weights (read ahead into the page cache in
the background while the tokenizer loads) and applies the backend's compute profile;
`generate(lm, prompt_ids, ...)` yields `GenerationEvent`s (text deltas that never
split a UTF-8 character) and stops at EOS, a stop string, max_tokens or the cancel flag,
checked between steps. A `PromptCache` keeps the KV of the tokens it has seen, so a follow-up
prompt that shares a prefix prefills only what is new. With `lm.enable_prefix_cache()` the
full pages of every prompt also go to the prefix cache on the SSD (engine.kv.prefix), and a
later prompt (in this process or after a restart) restores its longest stored prefix instead
of prefilling it; restored tokens count as `cached_tokens`. In every KV mode: mlx-lm's cache
takes the pages into its arrays, the paged modes (exact, sparse; 16, 8 or 4 bits) commit them
to the store as its own pages and store theirs from it (engine.kv.prefix, paged restore).
Every attention layout mlx-lm has: sliding-window layers keep their window in RAM while
full-attention layers page, and a
model the paged cache cannot hold (recurrent or hybrid layers, ...) runs in mlx-lm's cache
with its one line in `LoadedModel.kv_notice` (logged once as a warning). All MLX work happens
on the calling thread: the thread that loads a model must be the one that generates with it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.errors import StrataError
from engine.kv import (
    QUESTION_L,
    SPARSE_CHUNK_L,
    SPARSE_PREFILL_PAST,
    KVGeometry,
    KVSettings,
    LayerCache,
    ask,
    close_caches,
    geometry_of,
    make_paged_cache,
    question_steps,
    trimmable,
)
from engine.kv.attention import VOTE_QUERIES
from engine.kv.codec import codec_for
from engine.kv.prefix import PrefixCache, PrefixSettings, Window, model_key
from engine.kv.prefix import settings_from_env as prefix_settings_from_env
from engine.kv.store import MappedPageCorrupt
from engine.library import Library, Manifest
from engine.platform import (
    ComputeProfile,
    compute_profile,
    keep_freed_memory,
    release_freed_memory,
)
from engine.runtime.fit import chosen_context
from engine.runtime.model import (
    cache_module,
    compile_one_row_ops,
    cpu_swiglu,
    ensure_mlx_lm,
    head_on_last_row,
    last_row_head,
    load_weights_into_model,
    model_identity,
    read_config,
    weight_files,
)
from engine.runtime.packed import PackedWeights, pack_weights
from engine.runtime.readahead import read_ahead
from engine.runtime.sampling import LogitsProcessor, Sampler, SamplingParams
from engine.runtime.speculative import Drafter, Speculator, for_reply
from engine.runtime.tokenizer import StreamingDetokenizer, Tokenizer
from engine.telemetry import GenerationEvent, Timeline

PREFILL_STEP = 512
# A plain decode step is queued before the token before it goes out only while building a
# step takes less than this share of the time between two tokens (see `_decode`).
PIPELINE_BUILD_SHARE = 0.5
# Sparse mode past SPARSE_PREFILL_PAST tokens (a long restored context): the new tokens are
# prefilled SPARSE_CHUNK_L at a time, each chunk selecting its pages once as decoding does
# instead of reading every page (engine.kv.attention). The last chunk there also gives the
# first token's logits: a separate step for the prompt's last token cost a second selection
# and a second set of cold page reads (~1-1.5 s at 128k, docs/benchmarks.md).

log = logging.getLogger(__name__)


class LoadedModel:
    """A model ready to generate: mlx-lm module, config, tokenizer, manifest, profile."""

    def __init__(self, model: Any, config: dict[str, Any], tokenizer: Tokenizer,
                 manifest: Manifest, profile: ComputeProfile, timeline: Timeline) -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.manifest = manifest
        self.profile = profile
        self.timeline = timeline
        extra = config.get("eos_token_id")
        extra_ids = extra if isinstance(extra, list) else ([extra] if extra is not None else [])
        self.eos_ids = tokenizer.eos_ids(extra_ids)
        # The context chosen at import (or STRATA_CONTEXT), else the trained one.
        folder = manifest.get("path")
        self.context_length = chosen_context(config, Path(folder) if folder else None)
        # None or mode 'mlx': mlx-lm's KVCache; otherwise engine.kv's paged cache.
        self.kv_settings: KVSettings | None = None
        # The SSD prefix cache; None: off.
        self.prefix_cache: PrefixCache | None = None
        # Free heap memory goes back to the OS once the first reply is done.
        self.release_pending = True
        self._geometry: KVGeometry | None = None
        self._noticed: str | None = None
        # Whether `last_row_head` cuts this model's output head to the last position.
        self.head_last_row = False
        self.packed = PackedWeights()  # weights whose codes decode steps read (load fills it)

    @property
    def paged(self) -> bool:
        """Whether prompt caches are engine.kv's paged caches (else mlx-lm's): a paged mode
        is set and the model's layers can be paged."""
        return (self.kv_settings is not None and self.kv_settings.mode != "mlx"
                and self.kv_geometry.unpaged is None)

    @property
    def kv_notice(self) -> str | None:
        """Why a paged KV mode that is set does not apply to this model (one line), or None."""
        if self.kv_settings is None or self.kv_settings.mode == "mlx":
            return None
        return self.kv_geometry.unpaged

    @property
    def kv_geometry(self) -> KVGeometry:
        """The KV layer's view of this model: each layer's kind (full attention, sliding
        window), KV heads and head dims, compute dtype; read once, from mlx-lm's caches."""
        if self._geometry is None:
            self._geometry = geometry_of(self.model, self.profile.dtype,
                                         cache_module().make_prompt_cache(self.model))
        return self._geometry

    def kv_encoding(self) -> tuple[int, int]:
        """(bits, group) of the pages prompt caches hold: the paged store's codec in a paged
        mode (the group it really uses), (16, 64) in mlx-lm's cache."""
        s = self.kv_settings
        if s is None or not self.paged or s.bits == 16:
            return 16, 64
        g = self.kv_geometry
        return s.bits, codec_for(s.bits, s.group(), g.dtype, g.head_dim).group

    def prefix_key(self) -> bytes:
        """The key of this model's pages in the prefix cache (KV bits and group included)."""
        bits, group = self.kv_encoding()
        return model_key(model_identity(self.manifest, self.config, self.profile, bits, group))

    def new_prefix_cache(self, settings: PrefixSettings | None = None) -> PrefixCache:
        """A prefix cache for this model (settings None: the environment's), not installed;
        PrefixCacheError (one line) for a model whose caches it cannot hold. In a paged mode
        its pages are the paged store's (page size, bits, group), so that prompt caches
        restore into and store from the store's pages."""
        s = settings or prefix_settings_from_env()
        if self.paged and self.kv_settings is not None:
            s = replace(s, page_tokens=self.kv_settings.page_tokens)
        bits, group = self.kv_encoding()
        pc = PrefixCache.for_geometry(self.kv_geometry, self.prefix_key(), s, bits, group)
        pc.label(f"{self.manifest['name']} ({bits}-bit KV)" if bits != 16
                 else str(self.manifest["name"]))
        return pc

    def prefix_cache_fits(self) -> bool:
        """Whether the installed prefix cache is the one these KV settings need (key, page
        size); False when there is none."""
        pc = self.prefix_cache
        if pc is None:
            return False
        want = self.kv_settings.page_tokens if self.paged and self.kv_settings else pc.P
        return pc.key == self.prefix_key() and pc.P == want

    def enable_prefix_cache(self, settings: PrefixSettings | None = None) -> PrefixCache:
        """Turn on the SSD prefix cache for this model (settings: PrefixSettings or None for
        the environment's); returns it. Call after setting `kv_settings` (its bits key it)."""
        if self.prefix_cache is not None:
            self.prefix_cache.close()
        self.prefix_cache = self.new_prefix_cache(settings)
        return self.prefix_cache

    def disable_prefix_cache(self) -> None:
        """Turn the prefix cache off; pages still queued for the disk are written first."""
        if self.prefix_cache is not None:
            self.prefix_cache.close()
            self.prefix_cache = None

    @classmethod
    def load(cls, name: str | Path, library: Library | None = None,
             profile: ComputeProfile | None = None, timeline: Timeline | None = None,
             warm_up: bool = True) -> LoadedModel:
        """Load by library name or alias, or from an MLX folder path."""
        ensure_mlx_lm()  # an mlx or mlx-lm of another minor version stops here, in one line
        timeline = timeline or Timeline()
        path = Path(name)
        if path.is_dir() and (path / "config.json").is_file():
            manifest: Manifest = {"name": path.name, "path": str(path)}
        else:
            library = library or Library()
            manifest = library.get(str(name))
            path = Path(manifest["path"])
        # What the load frees (staging, dequantization) serves the first restore and prefill
        # instead of going back to the OS (engine.platform); released after the first reply.
        keep_freed_memory()
        # The weight files stream into the page cache while the tokenizer loads.
        read_ahead(weight_files(path))
        profile = profile or compute_profile()
        with timeline.phase("tokenizer"):
            tokenizer = Tokenizer.load(path)
        with timeline.phase("weights"):
            # Past the trained length the chosen context extends RoPE (YaRN, engine.runtime.model).
            model, config = load_weights_into_model(
                path, profile, context=chosen_context(read_config(path), path), keep_codes=True)
            # A decode step's products read the quantized codes (engine.runtime.packed).
            packed_weights = pack_weights(model)
        lm = cls(model, config, tokenizer, manifest, profile, timeline)
        lm.packed = packed_weights
        lm.head_last_row = head_on_last_row(model, config)
        cpu_swiglu(config)
        compile_one_row_ops(model)
        if warm_up:
            with timeline.phase("warm-up"):
                lm.warm_up()
        return lm

    def warm_up(self) -> None:
        """One short forward pass, so the first real token pays no first-call costs."""
        cache = self.new_cache()
        out = self.model(mx.array([[self.tokenizer.bos_id or 0] * 4]), cache=cache.cache)
        mx.eval(out)

    def new_cache(self) -> PromptCache:
        return PromptCache(self)


@dataclass
class PromptCache:
    """KV cache plus the token ids whose keys and values it holds, in order."""

    lm: LoadedModel
    cache: list[LayerCache] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.cache:
            self.cache = _make_cache(self.lm)

    def reuse(self, prompt: Sequence[int]) -> int:
        """Trim to the longest prefix shared with `prompt` (at least one token left to run)."""
        common = 0
        limit = min(len(self.tokens), len(prompt) - 1)
        while common < limit and self.tokens[common] == prompt[common]:
            common += 1
        drop = len(self.tokens) - common
        if drop:
            if not all(trimmable(c, drop) for c in self.cache):
                self.clear()
                return 0
            for c in self.cache:
                c.trim(drop)
            del self.tokens[common:]
        return common

    def resync(self) -> None:
        """After a reply that failed mid-step (a sampler that raised once the step's KV was
        fed): drop cached positions past the tokens it records, or everything if a cache
        cannot trim them."""
        extra = max((int(getattr(c, "offset", 0)) for c in self.cache), default=0) - len(
            self.tokens)
        if extra > 0:
            if all(trimmable(c, extra) for c in self.cache):
                for c in self.cache:
                    c.trim(extra)
            else:
                self.clear()

    def clear(self) -> None:
        self.close()
        self.cache = _make_cache(self.lm)
        self.tokens = []

    def close(self) -> None:
        """Release a paged cache's threads and session files (mlx-lm caches: nothing)."""
        close_caches(self.cache)

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.cache)


def _make_cache(lm: LoadedModel) -> list[LayerCache]:
    if lm.kv_settings is not None and lm.paged:
        return [*make_paged_cache(lm.model, lm.kv_settings, lm.kv_geometry)]
    notice = lm.kv_notice
    if notice is not None and lm._noticed != notice:
        lm._noticed = notice  # once per model and reason, not per prompt cache
        log.warning("%s", notice)
    return list(cache_module().make_prompt_cache(lm.model))


def _forward(lm: LoadedModel, x: Any, cache: list[LayerCache], pc: PromptCache,
             repair: Callable[[int], None] | None) -> Any:
    """model(x) over the cache; a mapped prefix page that fails its check when first read
    (MappedPageCorrupt) is dropped with every position after it, those positions computed
    again from `pc.tokens`, and the step retried: a damaged stored page costs a recompute,
    never a wrong answer or a failed reply. `repair(page)` tells the prefix cache."""
    while True:
        try:
            return lm.model(x, cache=cache)
        except MappedPageCorrupt as exc:
            if repair is None:
                raise
            start = exc.page * cache_page(cache)
            log.warning("%s: recomputing from token %d", exc, start)
            repair(exc.page)
            for c in cache:
                c.trim(c.offset - start)
            redo = pc.tokens[start:]
            del pc.tokens[start:]
            for i in range(0, len(redo), PREFILL_STEP):
                chunk = redo[i:i + PREFILL_STEP]
                _forward(lm, mx.array(chunk)[None], cache, pc, repair)
                mx.eval([c.state for c in cache])
                pc.tokens.extend(chunk)


def cache_page(cache: Sequence[Any]) -> int:
    """The page size of a paged cache list (the first paged layer's store)."""
    return next(c.store.P for c in cache if hasattr(c, "store"))


def _stop_split(text: str, stops: Sequence[str]) -> tuple[str, str, bool]:
    """(emit now, hold back, stopped): cut at a stop string or hold a possible prefix of one."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], "", True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold], text[len(text) - hold :], False


def generate(
    lm: LoadedModel,
    prompt: Sequence[int],
    params: SamplingParams | None = None,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    cancel: Callable[[], bool] | None = None,
    prompt_cache: PromptCache | None = None,
    timeline: Timeline | None = None,
    prefix_cache: bool | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    drafter: str | Drafter = "auto",
) -> Iterator[GenerationEvent]:
    """Stream a completion of `prompt` (token ids). See the module docstring.

    prefix_cache: None uses the model's SSD prefix cache if enabled; False skips it; True
    enables it first if needed. logits_processors: `(tokens so far, logits) -> logits`
    before sampling (a grammar's mask); they see every token up to the one being sampled, so
    decode is not pipelined while they run. drafter: speculative decoding
    (engine.runtime.speculative): "auto" (prompt lookup when it pays), "off", "lookup"
    (always), or a Drafter such as a ModelDrafter.
    """
    own = prompt_cache is None
    pc = prompt_cache or lm.new_cache()
    if prefix_cache and not lm.prefix_cache_fits() and lm.kv_geometry.no_prefix is None:
        old = lm.prefix_cache
        lm.enable_prefix_cache(None if old is None else old.settings)
    prefix = lm.prefix_cache if prefix_cache is not False else None
    try:
        yield from _generate(lm, prompt, params, max_tokens, stop, cancel, pc, timeline, prefix,
                             logits_processors, drafter)
    except Exception:
        if not own:
            pc.resync()  # the caller's cache stays in step with its tokens for the next reply
        raise
    finally:
        if own:
            pc.close()  # a paged cache's threads and files go with the reply
        if lm.release_pending:
            lm.release_pending = False
            release_freed_memory()  # what the load freed and this reply did not reuse


def _generate(
    lm: LoadedModel,
    prompt: Sequence[int],
    params: SamplingParams | None = None,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    cancel: Callable[[], bool] | None = None,
    prompt_cache: PromptCache | None = None,
    timeline: Timeline | None = None,
    prefix: PrefixCache | None = None,
    logits_processors: Sequence[LogitsProcessor] = (),
    drafter: str | Drafter = "auto",
) -> Iterator[GenerationEvent]:
    params = params or SamplingParams()
    if not prompt:
        raise StrataError("empty prompt: nothing to generate from")
    paged = lm.paged  # pages lift the in-memory length guard
    if not paged and len(prompt) + max_tokens > lm.context_length * 4:
        raise StrataError(f"prompt of {len(prompt)} tokens is too long for {lm.manifest['name']} "
                          f"(context {lm.context_length})")
    cancel = cancel or (lambda: False)
    timeline = timeline or Timeline()
    pc = prompt_cache or lm.new_cache()
    cache = None
    sampler = Sampler(params, logits_processors)
    # The next step is queued before this token is known: only when sampling needs no history.
    pipelined = params.repetition_penalty == 1.0 and not logits_processors
    mx.reset_peak_memory()
    start = time.perf_counter()

    if prefix is not None and not lm.prefix_cache_fits():
        prefix = None  # keyed for other KV settings (set since): never mix their pages
    plan = None
    with timeline.phase("cache lookup"):
        cached = pc.reuse(prompt)
        if prefix is not None:
            plan = prefix.lookup(prompt)
    # Pages to restore, or every full page held already and the stored tail to try.
    if prefix is not None and plan is not None and (
            plan.hit_tokens > cached or (prefix.tails and cached == plan.hit_tokens
                                         == len(plan.hashes) * plan.page_tokens)):
        with timeline.phase("cache restore"):
            restored = prefix.restore(pc.cache, prompt, plan, cached)
        if restored != cached:
            cached = restored
            pc.tokens[:] = list(prompt[:cached])
    cache = pc.cache
    todo = list(prompt[cached:])
    history = list(prompt)
    detok = StreamingDetokenizer(lm.tokenizer)
    stats = dict(prompt_tokens=len(prompt), cached_tokens=cached)
    repair = None
    if prefix is not None and plan is not None and paged and not prefix.has_windows:
        def repair(page: int) -> None:
            assert prefix is not None and plan is not None
            prefix.damaged(plan, page)
            stats["cached_tokens"] = min(stats["cached_tokens"], page * prefix.P)

    def event(text: str, token: int | None, n: int, t_first: float, prefill_s: float,
              reason: str | None = None) -> GenerationEvent:
        now = time.perf_counter()
        return GenerationEvent(
            text=text, token=token, generated_tokens=n, ttft_s=t_first - start,
            prefill_tps=(len(prompt) - cached) / prefill_s if prefill_s > 0 else 0.0,
            decode_tps=(n - 1) / (now - t_first) if n > 1 and now > t_first else 0.0,
            peak_memory_bytes=int(mx.get_peak_memory()), finish_reason=reason, **stats)

    # A model with sliding-window layers stores their window at the prompt's last full page
    # with the pages: a chunk ends there, and the window is copied out as it stands.
    snap_at = None
    window: list[Window | None] = [None]
    if prefix is not None and plan is not None and prefix.has_windows and plan.hashes:
        snap_at = len(plan.hashes) * plan.page_tokens

    def snapshot() -> None:
        if snap_at is not None and len(pc.tokens) == snap_at and window[0] is None:
            assert prefix is not None
            window[0] = prefix.snapshot(cache)

    t_prefill = time.perf_counter()
    snapshot()
    sparse = lm.kv_settings is not None and lm.kv_settings.mode == "sparse"
    # With the head on one row, the prompt's last chunk gives the logits itself, where mlx-lm
    # prefills all but the last token and then runs it alone (one more pass over the
    # weights). Sparse mode keeps that split short of SPARSE_PREFILL_PAST: its last chunk
    # records the question's votes and the last token selects as a decode step does.
    whole_last = lm.head_last_row and not (paged and sparse)
    # Past the trained length (sparse, remapped) the question's tokens go as one chunk (or
    # decode-style steps) from `steps_at` on, choosing far blocks (engine.kv.question_steps).
    store = next((c.store for c in cache if hasattr(c, "store")), None) if paged else None
    steps_at = len(prompt) - (question_steps(store, len(prompt)) if sparse and store else 0)
    while len(todo) > 1:
        step = PREFILL_STEP
        done = len(pc.tokens)
        far = paged and sparse and (done > SPARSE_PREFILL_PAST or done >= steps_at)
        if far:
            step = QUESTION_L if done >= steps_at else SPARSE_CHUNK_L
        if ((far or whole_last) and len(todo) <= step
                and not done < steps_at < done + len(todo)  # the question goes alone
                and (snap_at is None or not done < snap_at < done + len(todo))):
            break  # one chunk left: it gives the logits (below)
        n = min(step, len(todo) - 1)
        if paged and sparse and step == PREFILL_STEP and 0 < len(todo) - 1 - n < VOTE_QUERIES:
            # The question's votes come from the last chunk's VOTE_QUERIES queries (sparse
            # mode): a shorter last chunk would record fewer than a restored prompt's does.
            n = len(todo) - 1 - VOTE_QUERIES
        if snap_at is not None and done < snap_at < done + n:
            n = snap_at - done
        if done < steps_at < done + n:
            n = steps_at - done
        _forward(lm, mx.array(todo[:n])[None], cache, pc, repair)
        mx.eval([c.state for c in cache])
        pc.tokens.extend(todo[:n])
        todo = todo[n:]
        snapshot()
        if cancel():
            timeline.add("prefill", t_prefill)
            yield event("", None, 0, time.perf_counter(), 0.0, "cancelled")
            return
    if todo:
        with last_row_head():  # only the last position's logits are sampled from
            # (past the trained length the question's chunk reads twice: engine.kv.ask)
            logits = ask(lambda x: _forward(lm, x, cache, pc, repair), cache,
                         mx.array(todo)[None])[:, -1, :]
        pc.tokens.extend(todo)
    else:
        assert plan is not None and plan.logits is not None  # the whole prompt was stored
        logits = plan.logits
    tail = None
    if prefix is not None and plan is not None:
        tail = prefix.tail_snapshot(cache, prompt, plan, logits)
    y = sampler(logits, history)
    mx.eval(y)
    timeline.add("prefill", t_prefill)
    t_first_decode = time.perf_counter()
    prefill_s = t_first_decode - t_prefill

    saved = [plan is None]

    def save_prefix() -> None:
        # After the first token is out: copying new pages for the SSD never delays it.
        if not saved[0] and prefix is not None and plan is not None:
            saved[0] = True
            prefix.store(pc.cache, prompt, plan, window[0], tail)

    spec = for_reply(lm, drafter, params, logits_processors, sampler, pc,
                     lambda x: _forward(lm, x, cache, pc, repair), stats)
    try:
        yield from _decode(lm, cache, pc, sampler, y, history, detok, stop, cancel,
                           max_tokens, pipelined, event, timeline, t_first_decode, prefill_s,
                           save_prefix, repair, spec)
    finally:
        save_prefix()


def _decode(lm: LoadedModel, cache: list[LayerCache], pc: PromptCache, sampler: Sampler,
            y: Any, history: list[int], detok: StreamingDetokenizer, stop: Sequence[str],
            cancel: Callable[[], bool], max_tokens: int, pipelined: bool,
            event: Callable[..., GenerationEvent], timeline: Timeline, t_first_decode: float,
            prefill_s: float, after_first: Callable[[], None],
            repair: Callable[[int], None] | None = None, spec: Speculator | None = None
            ) -> Iterator[GenerationEvent]:
    """The decode loop: one event per token; `after_first` runs once the first is out.
    With `spec`, a step may verify drafts: the accepted ones (`ahead`) are in the cache."""
    pending = ""
    ahead: list[int] = []
    n = 0
    t_first = 0.0
    # Seconds the last plain step took to build (its graph, and what that waited on), and
    # between the last two tokens: their ratio decides the pipelining.
    built = interval = 0.0
    # When the step whose token comes next was built, if it was a plain step built with
    # nothing queued before it (0 otherwise): timed to its token for the speculator.
    t_plain = 0.0
    last_out = time.perf_counter()
    reason: str | None = None
    while True:
        if n and cancel():  # checked before each new token, so nothing runs past a Stop
            reason = "cancelled"
            break
        drafted = fed = bool(ahead)
        # The drafter's choice for the first token is made after it is out: its first call
        # takes in the whole prompt.
        plain = spec is None or drafted or (n > 0 and spec.rest(history))
        # The first token goes out before the next step is queued: building that step reads
        # pages (a restored context's, cold), which must not delay it. So does every token
        # while building a step takes most of a token's time: the paged attention evaluates
        # each layer past a few hundred tokens, so the step is computed as it is built;
        # queued first, it would hold this token back a whole step and overlap nothing (at
        # 128k restored tokens a reply's second token came 4-8 s after its first, two
        # steps; docs/benchmarks.md).
        if (not fed and plain and pipelined and 1 < n and n + 1 < max_tokens
                and built < PIPELINE_BUILD_SHARE * interval):
            t_build = time.perf_counter()
            next_y = sampler(_forward(lm, y[None], cache, pc, repair)[:, -1, :], history)
            built = time.perf_counter() - t_build
            mx.async_eval(next_y)
            fed = True
        tok = ahead.pop(0) if drafted else int(y.item())
        if fed and not drafted:
            pc.tokens.append(tok)
        n += 1
        now = time.perf_counter()
        if t_plain and spec is not None and not fed:
            # Nothing was queued behind it: build to token is the step's cost at this depth,
            # which spares the speculator timing two of its own (`Speculator.calibrate`).
            spec.plain_timed(now - t_plain)
        t_plain = 0.0
        interval, last_out = now - last_out, now
        if n == 1:
            t_first = now
            timeline.add("first decode", t_first_decode, t_first)
        if tok in lm.eos_ids:
            reason = "stop"
            break
        history.append(tok)
        text, pending, stopped = _stop_split(pending + detok.add(tok), stop)
        if stopped:
            yield event(text, tok, n, t_first, prefill_s, "stop")
            return
        if n >= max_tokens:
            reason = "length"
            yield event(text, tok, n, t_first, prefill_s)
            break
        yield event(text, tok, n, t_first, prefill_s)
        if n == 1:
            after_first()
            if spec is not None and not drafted:
                plain = spec.rest(history[:-1])  # as before the token: history without it
        if not fed and spec is not None and not plain:
            ahead, next_y = spec.step(tok, history, max_tokens - n)
        elif not fed:
            t_build = t_plain = time.perf_counter()
            next_y = sampler(_forward(lm, mx.array([[tok]]), cache, pc, repair)[:, -1, :],
                             history)
            built = time.perf_counter() - t_build
            pc.tokens.append(tok)
            mx.async_eval(next_y)
        if not drafted:
            y = next_y
    tail, _, _ = _stop_split(pending + detok.flush(), stop)
    yield event(tail, None, n, t_first, prefill_s, reason)


class ChatSession:
    """A multi-turn chat over one model: messages in, streamed replies out, KV reused."""

    def __init__(self, lm: LoadedModel, system: str | None = None) -> None:
        self.lm = lm
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.cache = lm.new_cache()

    def send(self, text: str, params: SamplingParams | None = None, max_tokens: int = 512,
             cancel: Callable[[], bool] | None = None, timeline: Timeline | None = None,
             drafter: str | Drafter = "auto") -> Iterator[GenerationEvent]:
        """Append the user's message, stream the reply, and record it when done."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.lm.tokenizer.encode_chat(self.messages)
        reply: list[str] = []
        try:
            for ev in generate(self.lm, prompt, params, max_tokens, cancel=cancel,
                               prompt_cache=self.cache, timeline=timeline, drafter=drafter):
                reply.append(ev.text)
                yield ev
        finally:
            self.messages.append({"role": "assistant", "content": "".join(reply)})

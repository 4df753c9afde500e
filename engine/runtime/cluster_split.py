"""A model split across the ranks of an MLX distributed group: its share loaded, its steps run.

Contract: `choose_split(config, ranks)` picks tensor parallelism (mlx-lm's own
`Model.shard(group)`) where the architecture has it and the heads, KV heads and MLP width
divide by the ranks, pipeline parallelism otherwise (contiguous layer ranges, ours; the
transport is MLX's `send`/`recv`). `load_share(folder, plan, group, profile)` builds the model,
applies the compute profile lazily and keeps (evaluates) only this rank's share. On rank 0
`SplitModel` has the model's call signature, `model(x, cache=cache)` -> logits, and drives the
other ranks step by step: each call first broadcasts a small int32 header (op, cache id, cache
offset, tokens, cache kind, caches freed) with `all_sum`, so every rank runs the same forward
calls on the same cache; `Follower.serve()` is that loop on the other ranks. Caches come from
`SplitModel.make_cache()` (mlx-lm's `make_prompt_cache` asks for it) or are engine.kv's paged
caches over rank 0's share; each is tagged with an id the followers key their own caches by
(a paged one on rank 0 makes a paged one, over the rank's own heads or layers, on every rank);
a trim on rank 0 reaches them as a lower offset. A broken group (a rank died) raises from MLX
as RuntimeError; `SplitModel.broken` then says why. `step_bytes` counts what a rank sends.

The prefix cache on a split model (`ClusterPrefixCache` on rank 0, `Follower`'s own on the
others): every rank keeps the pages of its own heads or layers in its own page store, keyed by
the model and the split (`split_identity`: kind, ranks, this rank, its layers or head slice).
Three more steps, in line with the forward steps: a lookup (the prompt's tokens sent as an
all_sum; every rank looks up its own store; the restore length is the minimum over the ranks,
an all_min), a restore (every rank restores exactly that many tokens into its cache of that id;
the tokens each really restored go through a second all_min and a rank past it trims back, so a
rank whose page fails its check leaves every rank at the length all of them hold), a store
(every rank queues its own new pages). Stored tails are off on a split model: pages only.
"""

from __future__ import annotations

import importlib
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.errors import StrataError
from engine.kv import KVSettings, close_caches, geometry_of, make_paged_cache
from engine.kv.codec import codec_for
from engine.kv.prefix import Plan, PrefixCache, model_key, settings_from_env
from engine.library import Manifest
from engine.platform import ComputeProfile
from engine.runtime.model import (
    apply_profile,
    build_model,
    cache_module,
    cpu_swiglu,
    ensure_mlx_lm,
    model_identity,
    model_module,
    read_config,
    weight_files,
)


class ClusterError(StrataError):
    """A split model's group could not start, was refused, or lost a rank."""


# The step header: op, cache id, cache offset before the step, tokens, cache kind, then
# caches freed.
HEADER = 8
FREED_SLOTS = HEADER - 5
OP_STEP, OP_QUIT, OP_LOOKUP, OP_RESTORE, OP_STORE = 1, 2, 3, 4, 5
KIND_MLX, KIND_PAGED = 0, 1


@dataclass(frozen=True)
class SplitPlan:
    """How a model is split: 'tensor' (every rank holds a slice of every layer) or
    'pipeline' (rank r holds layers[r]: a [start, end) range); hidden size and layer count."""

    mode: str
    ranks: int
    layers: list[tuple[int, int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "ranks": self.ranks, "layers": [list(r) for r in self.layers]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitPlan:
        return cls(str(d["mode"]), int(d["ranks"]), [(int(a), int(b)) for a, b in d["layers"]])


def split_layers(n_layers: int, shares: list[float]) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per rank, sized by `shares` (free memory, or equal):
    largest remainders, at least one layer each."""
    if len(shares) > n_layers:
        raise ClusterError(f"{len(shares)} ranks for {n_layers} layers: at most one rank a layer")
    total = sum(shares) or 1.0
    exact = [n_layers * s / total for s in shares]
    counts = [max(1, int(e)) for e in exact]
    order = sorted(range(len(shares)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    i = 0
    while sum(counts) < n_layers:
        counts[order[i % len(order)]] += 1
        i += 1
    while sum(counts) > n_layers:
        j = max(range(len(counts)), key=lambda k: counts[k])
        counts[j] -= 1
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def tensor_parallel_reason(config: dict[str, Any], ranks: int) -> str | None:
    """Why `config` cannot be split by tensor parallelism over `ranks` (None: it can)."""
    module = model_module(str(config.get("model_type", "")))
    if not hasattr(module.Model, "shard"):
        return f"mlx-lm's {config.get('model_type')} has no tensor-parallel shard"
    heads = int(config.get("num_attention_heads") or 0)
    kv = int(config.get("num_key_value_heads") or heads)
    mlp = int(config.get("intermediate_size") or 0)
    for what, n in (("heads", heads), ("KV heads", kv), ("MLP width", mlp)):
        if not n or n % ranks:
            return f"{n} {what} do not divide by {ranks} ranks"
    return None


def choose_split(config: dict[str, Any], ranks: int, force: str | None = None,
                 shares: list[float] | None = None) -> SplitPlan:
    """Tensor parallelism where it applies, pipeline otherwise (`force`: 'tensor' or
    'pipeline'; a forced tensor split that cannot be is refused in one line)."""
    reason = tensor_parallel_reason(config, ranks)
    if force == "tensor" and reason:
        raise ClusterError(f"tensor parallelism over {ranks} ranks: {reason}")
    if force not in (None, "", "tensor", "pipeline"):
        raise ClusterError(f"unknown split {force!r}: use 'tensor' or 'pipeline'")
    if reason is None and force != "pipeline":
        return SplitPlan("tensor", ranks)
    n_layers = int(config.get("num_hidden_layers") or 0)
    return SplitPlan("pipeline", ranks, split_layers(n_layers, shares or [1.0] * ranks))


# -- loading a share ------------------------------------------------------------------------
def _check_pipeline_model(model: Any, folder: Path) -> None:
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm")):
        raise ClusterError(f"{folder.name}: pipeline split needs an embed/layers/norm model")
    if any(getattr(layer, "use_sliding", False) for layer in inner.layers):
        raise ClusterError(f"{folder.name}: pipeline split of sliding-window layers is not "
                           "supported yet")


def load_share(folder: Path, plan: SplitPlan, group: Any, profile: ComputeProfile
               ) -> tuple[Any, dict[str, Any]]:
    """This rank's share of the model in `folder`: (model, config). The weights are mapped,
    the profile applied lazily (dequantize, cast), then the split made, so that evaluating
    the parameters computes and keeps only this rank's part. Tensor: mlx-lm's shard. Pipeline:
    the model with only this rank's layers (rank 0 also keeps embedding, norm and head)."""
    config = read_config(folder)
    files = weight_files(folder)
    if not files:
        raise ClusterError(f"{folder}: no model*.safetensors weights")
    weights: dict[str, Any] = {}
    for f in files:
        try:
            loaded: Any = mx.load(str(f))
        except (RuntimeError, ValueError) as exc:
            raise ClusterError(f"{f}: unreadable weights ({exc})") from exc
        weights.update(loaded)
    model = build_model(config, weights)
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ClusterError(f"{folder}: weights do not match the config ({exc})") from exc
    del weights
    model.eval()
    apply_profile(model, profile)  # lazy: only what is kept below is ever computed
    cpu_swiglu(config)  # the arithmetic of a one-process load (engine.runtime.model)
    if plan.mode == "tensor":
        model.shard(group)
    else:
        _check_pipeline_model(model, folder)
        start, end = plan.layers[group.rank()]
        model.model.layers = model.model.layers[start:end]
        if group.rank() != 0:  # embedding, final norm and head live on rank 0
            for name in ("embed_tokens", "norm"):
                model.model.pop(name, None)
            model.pop("lm_head", None)
    mx.eval(model.parameters())
    return model, config


def share_bytes(model: Any) -> int:
    """Bytes of the parameters this rank holds."""
    from mlx.utils import tree_flatten  # mlx's own helper, only needed here

    flat: Any = tree_flatten(model.parameters())
    return sum(int(a.nbytes) for _, a in flat)


# -- the prefix cache on a split model -----------------------------------------------------
def split_identity(identity: dict[str, Any], plan: SplitPlan, rank: int) -> dict[str, Any]:
    """`identity` (engine.runtime.model.model_identity) with the split named: its kind, the
    ranks, this rank and what it holds (pipeline: its layer range; tensor: its slice of the
    heads), so a rank never restores pages stored by another split or another rank."""
    part: dict[str, Any] = {"mode": plan.mode, "ranks": plan.ranks, "rank": rank}
    if plan.mode == "pipeline":
        part["layers"] = list(plan.layers[rank])
    else:
        part["heads"] = [rank, plan.ranks]  # slice `rank` of `ranks` equal slices
    return {**identity, "split": part}


def kv_encoding(kv: KVSettings | None, geometry: Any) -> tuple[int, int]:
    """(bits, group) of the pages a paged cache over `geometry` holds ((16, 64) otherwise), as
    LoadedModel.kv_encoding says for rank 0."""
    if kv is None or kv.mode == "mlx" or geometry.unpaged is not None or kv.bits == 16:
        return 16, 64
    return kv.bits, codec_for(kv.bits, kv.group(), geometry.dtype, geometry.head_dim).group


def _ints(a: Any) -> list[int]:
    """A 1-d MLX integer array as Python ints."""
    row: list[Any] = list(a.tolist())
    return [int(v) for v in row]


def _kind(cache: list[Any]) -> int:
    return KIND_PAGED if hasattr(cache[0], "store") else KIND_MLX


def _verified(prefix: PrefixCache, caches: list[Any], start: int, end: int) -> int:
    """A paged cache's pages start..end (tokens) as restored: mapped pages are checked when
    first read, and a follower cannot recompute one alone, so they are read now; returns the
    tokens that verify (the first damaged page is cut from the store)."""
    full = [caches[i] for i in prefix.full]
    if not full or not hasattr(full[0], "store"):
        return end
    for page in range(start // prefix.P, end // prefix.P):
        try:
            for c in full:
                c.store.page_np(c.layer, page)
        except StrataError:
            return page * prefix.P
    return end


class ClusterPrefixCache(PrefixCache):
    """Rank 0's prefix cache on a split model: its own store holds rank 0's heads or layers,
    and each lookup, restore and store runs on every rank (`split`, set by the runtime) so
    that every rank restores the same length. Tails are off (pages only)."""

    split: SplitModel | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tails = False

    def lookup(self, prompt: Sequence[int]) -> Plan:
        plan = super().lookup(prompt)
        if self.split is not None:
            plan.hit_pages = self.split.prefix_lookup(prompt, self.P, plan.hit_pages)
        return plan

    def restore(self, caches: list[Any], prompt: Sequence[int], plan: Plan, cached: int
                ) -> int:
        if self.split is None:
            return super().restore(caches, prompt, plan, cached)
        return self.split.prefix_restore(self, caches, prompt, plan, cached)

    def store(self, caches: list[Any], prompt: Sequence[int], plan: Plan,
              window: Any = None, tail: Any = None) -> int:
        if self.split is not None:
            self.split.prefix_store(caches, len(prompt))
        return super().store(caches, prompt, plan, window, None)


# -- steps ------------------------------------------------------------------------------------
def _attention_mask(h: Any, cache: Any) -> Any:
    ensure_mlx_lm()
    base = importlib.import_module("mlx_lm.models.base")
    return base.create_attention_mask(h, cache)


def _run_layers(layers: list[Any], h: Any, caches: list[Any] | None) -> Any:
    caches = caches if caches is not None else [None] * len(layers)
    mask = _attention_mask(h, caches[0] if caches else None)
    for layer, c in zip(layers, caches, strict=True):
        h = layer(h, mask, cache=c)
    return h


def _stage_caches(model: Any, plan: SplitPlan) -> list[Any]:
    if plan.mode == "tensor":
        return list(cache_module().make_prompt_cache(model))
    kv_cache = cache_module().KVCache
    return [kv_cache() for _ in model.model.layers]


def share_geometry(model: Any, plan: SplitPlan, dtype: str) -> Any:
    """The KV geometry of this rank's share (its KV heads, or its layers): read from one lazy
    step that is never evaluated, so no collective runs (engine.kv.geometry_of)."""
    return geometry_of(model, dtype, _stage_caches(model, plan))


def step_bytes(plan: SplitPlan, config: dict[str, Any], tokens: int, itemsize: int) -> int:
    """Bytes one rank sends for a step of `tokens` tokens, counted from the tensors: the
    header and, tensor: the token ids and two all_sums of the hidden state per layer; a ring
    all_sum of S bytes sends 2 (N - 1) / N * S from each rank (reduce-scatter, all-gather).
    Pipeline: one hidden state per stage."""
    n = plan.ranks
    hidden = int(config["hidden_size"]) * tokens * itemsize
    ring = 2 * (n - 1) / n
    header = ring * HEADER * 4
    if plan.mode == "tensor":
        layers = int(config["num_hidden_layers"])
        return int(header + ring * (tokens * 4 + 2 * layers * hidden))
    return int(header + hidden)


class SplitModel:
    """Rank 0's model: same call as an mlx-lm model, each call run on every rank."""

    def __init__(self, model: Any, config: dict[str, Any], plan: SplitPlan, group: Any) -> None:
        self.inner = model
        self.config = config
        self.plan = plan
        self.group = group
        self.steps = 0
        self.decode_steps = 0
        self._last = (0, 0)  # the last step's cache id and the offset it ended at
        self.sent_bytes = 0  # what rank 0 sent (step_bytes), every step so far
        self.broken: str | None = None
        # Asked before each step: why a rank is gone (None: all there).
        self.check: Callable[[], str | None] = lambda: None
        self._next_id = 0
        self._freed: list[int] = []

    def __getattr__(self, name: str) -> Any:
        # Attributes the runtime reads of an mlx-lm model (args, layers, ...) are the share's.
        if name in ("inner", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _tag(self, caches: list[Any]) -> int:
        """A new id for a cache list; the others free theirs once rank 0's is collected."""
        self._next_id += 1
        caches[0].cluster_id = self._next_id
        weakref.finalize(caches[0], self._freed.append, self._next_id)
        return self._next_id

    def make_cache(self) -> list[Any]:
        """This rank's caches (its heads, or its layers), tagged with an id for the others."""
        caches = _stage_caches(self.inner, self.plan)
        self._tag(caches)
        return caches

    def _header(self, op: int, cid: int = 0, offset: int = 0, n: int = 0,
                kind: int = KIND_MLX) -> None:
        freed = self._freed[:FREED_SLOTS]
        del self._freed[:len(freed)]
        row = [op, cid, offset, n, kind, *freed] + [0] * (FREED_SLOTS - len(freed))
        mx.eval(mx.distributed.all_sum(mx.array(row, dtype=mx.int32), group=self.group))

    def _ready(self) -> None:
        """Before a header: the last step's work done (a rank lost during it has failed its
        collectives, and a header posted after that would wait forever), no rank gone."""
        if self.broken:
            raise ClusterError(self.broken)
        mx.synchronize()
        gone = self.check()
        if gone:
            self.broken = gone
            raise ClusterError(gone)

    def _collective(self, op: int, cid: int = 0, offset: int = 0, n: int = 0,
                    kind: int = KIND_MLX) -> None:
        self._ready()
        try:
            self._header(op, cid, offset, n, kind)
        except RuntimeError as exc:
            self.broken = f"a rank of the cluster was lost ({exc})"
            raise ClusterError(self.broken) from exc

    def _cache_id(self, cache: list[Any]) -> int:
        cid = int(getattr(cache[0], "cluster_id", 0))
        if not cid and _kind(cache) == KIND_PAGED:
            cid = self._tag(cache)  # engine.kv's paged caches over rank 0's share
        if not cid:
            raise ClusterError("this cache was not made by the split model (make_cache)")
        return cid

    def _min(self, values: list[int]) -> list[int]:
        """The minimum over the ranks of each value (an all_min)."""
        got = mx.distributed.all_min(mx.array(values, dtype=mx.int32), group=self.group)
        mx.eval(got)
        return _ints(got)

    def prefix_lookup(self, prompt: Sequence[int], page_tokens: int, hit_pages: int) -> int:
        """Every rank looks the prompt up in its own store (pages of `page_tokens`); returns
        the full pages every rank holds (the minimum, rank 0's `hit_pages` included)."""
        self._collective(OP_LOOKUP, 0, 0, len(prompt), page_tokens)
        try:
            mx.eval(mx.distributed.all_sum(mx.array(list(prompt), dtype=mx.int32),
                                           group=self.group))
            return self._min([hit_pages])[0]
        except RuntimeError as exc:
            self.broken = f"a rank of the cluster was lost ({exc})"
            raise ClusterError(self.broken) from exc

    def prefix_restore(self, prefix: PrefixCache, caches: list[Any], prompt: Sequence[int],
                       plan: Plan, cached: int) -> int:
        """Every rank restores plan.hit_pages (the agreed length) into its cache of this id;
        then the tokens every rank really holds (a second minimum) are what all keep: a rank
        past it trims back. Returns that length."""
        cid, kind = self._cache_id(caches), _kind(caches)
        self._collective(OP_RESTORE, cid, cached, plan.hit_tokens, kind)
        got = PrefixCache.restore(prefix, caches, prompt, plan, cached)
        try:
            common = self._min([got])[0]
        except RuntimeError as exc:
            self.broken = f"a rank of the cluster was lost ({exc})"
            raise ClusterError(self.broken) from exc
        if got > common:
            for c in caches:
                c.trim(got - common)
        return common

    def prefix_store(self, caches: list[Any], n: int) -> None:
        """Every other rank stores its own new pages of the prompt it last looked up (`n`
        tokens) from its cache of this id. Nothing once the group is broken."""
        if self.broken:
            return
        cid = int(getattr(caches[0], "cluster_id", 0))
        if cid:
            self._collective(OP_STORE, cid, 0, n, _kind(caches))

    def __call__(self, x: Any, cache: list[Any] | None = None) -> Any:
        self._ready()
        if x.ndim != 2 or x.shape[0] != 1:
            raise ClusterError(f"a split model runs one sequence at a time (got {x.shape})")
        cid = offset = 0
        kind = KIND_MLX
        if cache is not None:
            kind = _kind(cache)
            cid = self._cache_id(cache)
            offset = int(cache[0].offset)
        n = int(x.shape[1])
        try:
            self._header(OP_STEP, cid, offset, n, kind)
        except RuntimeError as exc:
            self.broken = f"a rank of the cluster was lost ({exc})"
            raise ClusterError(self.broken) from exc
        self.steps += 1
        # Decode steps (one token each) since the last prompt chunk: what a lost rank cost.
        # A one-token step on another cache, or after a trim (a prompt all but its last token
        # cached), starts a reply as a prompt chunk does.
        going_on = n == 1 and (cid, offset) == self._last
        self.decode_steps = self.decode_steps + 1 if going_on else 0
        self._last = (cid, offset + n)
        x = x.astype(mx.int32)
        inner = self.inner.model
        if self.plan.mode == "tensor":
            x = mx.distributed.all_sum(x, group=self.group)  # the others' zeros: x everywhere
            out = inner(x, cache=cache)
        else:
            h = _run_layers(inner.layers, inner.embed_tokens(x), cache)
            sent = mx.distributed.send(h, 1, group=self.group)
            mx.async_eval(sent)  # queued before the recv below, on the same stream
            out = inner.norm(mx.distributed.recv_like(h, self.plan.ranks - 1, group=self.group))
        self.sent_bytes += step_bytes(self.plan, self.config, n, out.dtype.size)
        if cache is not None and kind == KIND_MLX and cache[-1].keys is not None:
            # A caller that evaluates only the cache (a prefill chunk) still runs the step's
            # last collectives, which the other ranks wait on (as mlx-lm's pipelines do).
            cache[-1].keys = mx.depends(cache[-1].keys, out)
        elif cache is not None:
            mx.async_eval(out)  # a paged cache's state is its pools: the same, by evaluating
        if getattr(self.inner.args, "tie_word_embeddings", False):
            return inner.embed_tokens.as_linear(out)
        return self.inner.lm_head(out)

    def quit(self) -> None:
        """Tell every rank to stop serving (nothing if the group is broken)."""
        if self.broken:
            return
        try:
            self._header(OP_QUIT)
        except RuntimeError as exc:
            self.broken = f"a rank of the cluster was lost ({exc})"
        else:
            self.broken = "the cluster was closed"


class Follower:
    """A rank > 0: runs every step rank 0 broadcasts, on its own caches, until told to quit.
    `kv`: the paged KV settings for the caches rank 0 makes paged (None: none are)."""

    def __init__(self, model: Any, config: dict[str, Any], plan: SplitPlan, group: Any,
                 dtype: Any, kv: KVSettings | None = None, manifest: Manifest | None = None,
                 profile: ComputeProfile | None = None) -> None:
        self.model = model
        self.config = config
        # The prefix cache of this rank's heads or layers (its own page store), by page size;
        # None: it cannot be had here (no manifest, or the store refused), so it finds none.
        self.manifest, self.profile = manifest, profile
        self.prefixes: dict[int, PrefixCache | None] = {}
        self._looked: tuple[list[int], Plan | None, PrefixCache | None] | None = None
        self.plan = plan
        self.group = group
        self.hidden = int(config["hidden_size"])
        self.dtype = dtype
        self.kv = kv
        self._geometry: Any = None
        self.caches: dict[int, list[Any]] = {}
        self.steps = 0

    def _new(self, kind: int) -> list[Any]:
        if kind != KIND_PAGED:
            return _stage_caches(self.model, self.plan)
        if self.kv is None:
            raise ClusterError(f"rank {self.group.rank()}: rank 0 made a paged KV cache but "
                               "sent no KV settings")
        return list(make_paged_cache(self.model, self.kv, self.geometry()))

    def geometry(self) -> Any:
        if self._geometry is None:
            name = {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(self.dtype, "float32")
            self._geometry = share_geometry(self.model, self.plan, name)
        return self._geometry

    def prefix(self, page_tokens: int) -> PrefixCache | None:
        """This rank's prefix cache for pages of `page_tokens` (its environment's page store:
        STRATA_PREFIX_DIR, else its STRATA_HOME's), keyed by the model and this rank's part."""
        if page_tokens not in self.prefixes:
            pc = None
            if self.manifest is not None and self.profile is not None:
                try:
                    geometry = self.geometry()
                    bits, group = kv_encoding(self.kv, geometry)
                    ident = model_identity(self.manifest, self.config, self.profile, bits,
                                           group)
                    key = model_key(split_identity(ident, self.plan, self.group.rank()))
                    settings = settings_from_env(page_tokens=page_tokens, tails=False)
                    pc = ClusterPrefixCache.for_geometry(geometry, key, settings, bits, group)
                except StrataError as exc:  # no store here: this rank holds nothing
                    print(f"strata: rank {self.group.rank()}: prefix cache off ({exc})",
                          file=sys.stderr, flush=True)
            self.prefixes[page_tokens] = pc
        return self.prefixes[page_tokens]

    def _lookup(self, n: int, page_tokens: int) -> None:
        got = mx.distributed.all_sum(mx.zeros((n,), dtype=mx.int32), group=self.group)
        mx.eval(got)
        prompt = _ints(got)
        pc = self.prefix(page_tokens)
        plan = pc.lookup(prompt) if pc is not None else None
        hit = self._min([plan.hit_pages if plan is not None else 0])
        if plan is not None:
            plan.hit_pages = min(plan.hit_pages, hit)
        self._looked = (prompt, plan, pc)

    def _min(self, values: list[int]) -> int:
        got = mx.distributed.all_min(mx.array(values, dtype=mx.int32), group=self.group)
        mx.eval(got)
        return _ints(got)[0]

    def _restore(self, cid: int, cached: int, tokens: int, kind: int) -> None:
        caches = self._caches(cid, cached, kind)
        assert caches is not None  # rank 0 restores into a cache of its own (an id)
        got = cached
        prompt, plan, pc = self._looked or ([], None, None)
        if plan is not None and pc is not None and tokens == plan.hit_tokens:
            got = pc.restore(caches, prompt, plan, cached)
            if got > cached:
                ok = _verified(pc, caches, (cached // pc.P) * pc.P, got)
                if ok < got:
                    pc.damaged(plan, ok // pc.P)
                    for c in caches:
                        c.trim(got - max(ok, cached))
                    got = max(ok, cached)
        common = self._min([got])
        if got > common:
            for c in caches:
                c.trim(got - common)

    def _store(self, cid: int, n: int) -> None:
        prompt, plan, pc = self._looked or ([], None, None)
        caches = self.caches.get(cid)
        if caches is not None and plan is not None and pc is not None and len(prompt) == n:
            pc.store(caches, prompt, plan)

    def _caches(self, cid: int, offset: int, kind: int) -> list[Any] | None:
        if cid == 0:
            return None
        caches = self.caches.get(cid)
        if caches is None:
            caches = self.caches[cid] = self._new(kind)
        have = int(caches[0].offset)
        if have > offset:
            for c in caches:
                c.trim(have - offset)
        elif have < offset:
            raise ClusterError(f"rank {self.group.rank()}: cache {cid} holds {have} tokens, "
                               f"rank 0 {offset}: out of step")
        return caches

    def kv_bytes(self) -> int:
        """Bytes this rank's caches hold (its heads or layers), read from another thread:
        the caches may change meanwhile, so a changed dict is read again."""
        for _ in range(5):
            try:
                return sum(int(getattr(c, "nbytes", 0)) for cs in list(self.caches.values())
                           for c in cs)
            except RuntimeError:  # the step loop added or freed a cache meanwhile
                continue
        return 0

    def prefix_bytes(self) -> int | None:
        """Bytes of this rank's page store folder (None: no prefix cache here yet), read from
        another thread (the memory panel's row)."""
        folders = {pc.folder: pc for pc in list(self.prefixes.values()) if pc is not None}
        if not folders:
            return None
        try:
            return sum(pc.disk_bytes() for pc in folders.values())
        except OSError:
            return None

    def close(self) -> None:
        """Release the paged caches' threads and session files."""
        for caches in self.caches.values():
            close_caches(caches)
        self.caches.clear()
        for pc in self.prefixes.values():
            if pc is not None:
                pc.close()  # queued pages written first (bounded by its flush_s)
        self.prefixes.clear()

    def serve(self) -> int:
        """Run steps until rank 0 says quit; returns the steps run. A lost rank raises
        RuntimeError from MLX."""
        g = self.group
        rank, size = g.rank(), g.size()
        zeros = mx.zeros((HEADER,), dtype=mx.int32)
        try:
            while True:
                hdr = mx.distributed.all_sum(zeros, group=g)
                mx.eval(hdr)
                row: list[Any] = list(hdr.tolist())  # type: ignore[arg-type]  # a 1-d array
                op, cid, offset, n, kind, *freed = (int(v) for v in row)
                for f in freed:
                    if f in self.caches:
                        close_caches(self.caches.pop(f))
                if op == OP_QUIT:
                    return self.steps
                if op == OP_LOOKUP:
                    self._lookup(n, kind)
                    continue
                if op == OP_RESTORE:
                    self._restore(cid, offset, n, kind)
                    continue
                if op == OP_STORE:
                    self._store(cid, n)
                    continue
                if op != OP_STEP:
                    raise ClusterError(f"rank {rank}: unknown step {op} from rank 0")
                caches = self._caches(cid, offset, kind)
                self.steps += 1
                if self.plan.mode == "tensor":
                    x = mx.distributed.all_sum(mx.zeros((1, n), dtype=mx.int32), group=g)
                    out = self.model.model(x, cache=caches)  # no head: rank 0 makes the logits
                else:
                    h = mx.distributed.recv((1, n, self.hidden), self.dtype, rank - 1, group=g)
                    h = _run_layers(self.model.model.layers, h, caches)
                    out = mx.distributed.send(h, (rank + 1) % size, group=g)
                mx.eval(out, [c.state for c in caches or []])
        finally:
            self.close()

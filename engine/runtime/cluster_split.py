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
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.errors import StrataError
from engine.kv import KVSettings, close_caches, geometry_of, make_paged_cache
from engine.platform import ComputeProfile
from engine.runtime.model import (
    apply_profile,
    build_model,
    cache_module,
    ensure_mlx_lm,
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
OP_STEP, OP_QUIT = 1, 2
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

    def __call__(self, x: Any, cache: list[Any] | None = None) -> Any:
        if self.broken:
            raise ClusterError(self.broken)
        # The last step's work done first: a rank lost during it has failed its collectives,
        # and a header posted after that would wait forever.
        mx.synchronize()
        gone = self.check()
        if gone:
            self.broken = gone
            raise ClusterError(gone)
        if x.ndim != 2 or x.shape[0] != 1:
            raise ClusterError(f"a split model runs one sequence at a time (got {x.shape})")
        cid = offset = 0
        kind = KIND_MLX
        if cache is not None:
            kind = KIND_PAGED if hasattr(cache[0], "store") else KIND_MLX
            cid = int(getattr(cache[0], "cluster_id", 0))
            if not cid and kind == KIND_PAGED:
                cid = self._tag(cache)  # engine.kv's paged caches over rank 0's share
            if not cid:
                raise ClusterError("this cache was not made by the split model (make_cache)")
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
                 dtype: Any, kv: KVSettings | None = None) -> None:
        self.model = model
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
        if self._geometry is None:
            name = {mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(self.dtype, "float32")
            self._geometry = share_geometry(self.model, self.plan, name)
        return list(make_paged_cache(self.model, self.kv, self._geometry))

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

    def close(self) -> None:
        """Release the paged caches' threads and session files."""
        for caches in self.caches.values():
            close_caches(caches)
        self.caches.clear()

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

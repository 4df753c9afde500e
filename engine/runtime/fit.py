"""Will it fit: the memory a model needs against what this machine lets Strata use.

Contract: `estimate(config, weights, profile, context=None, ...)` returns a `Fit` from a config
and the weights' sizes alone (no tensor is read): the weights as the compute profile holds them
(dequantized on Linux CPU's float32 profile, as stored otherwise), plus the KV cache at the
chosen context counted layer by layer (`kv_layers`: full-attention layers hold every token,
sliding-window layers at most their window; grouped-query heads, head dims and multi-latent
attention from the config; 8- or 4-bit KV pages with their scales), against `memory_limit()`:
what psutil says is available, capped by STRATA_MAX_MEMORY_MB and, on macOS, by the GPU's
wired-memory limit. A Fit that does not fit carries the largest context that would
(`max_context`, 0 when the weights alone are too much). `WeightSizes` describes the weights:
`from_arrays` (lazily loaded MLX arrays: shapes and dtypes only) or built by a source from
file headers. `check_memory` is the load's preflight: it raises LoadFailed, one line with the
numbers and the offer, for a model that would push the machine into swap.

Sliding layers are those the config declares (layer_types, gemma3's pattern, gpt-oss's and
gemma2's alternation, Mistral v0.1's window on every layer); for gemma2 and a llama-file model
without layer_types mlx-lm's in-memory cache still keeps every token, so there the figure is
what a cache that keeps the window holds (the paged one).

The chosen context (`chosen_context`): the caller's, else STRATA_CONTEXT, else a "context" in
the model folder's manifest.json, else the model's trained context (max_position_embeddings).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from engine.errors import LoadFailed
from engine.library.found import safetensors_items
from engine.platform import ComputeProfile
from engine.runtime import packed

DEFAULT_CONTEXT = 4096  # a config that names no trained context
CONTEXT_STEP = 256  # offered contexts are rounded down to it (mlx-lm's KVCache grows by it)
_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64", "F32", "F16", "BF16", "F64")


def dtype_width(dtype: str) -> int:
    """Bytes per value of a compute dtype ('float32' 4, 'float16'/'bfloat16' 2)."""
    return 4 if dtype == "float32" else 2


# -- the weights ---------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightSizes:
    """A model's weights by how they are stored: quantized (their parameters unpacked, and the
    bytes of codes, scales and biases), floats (cast to the compute dtype when held), other
    (integer tensors, held as stored)."""

    quant_params: int = 0
    quant_bytes: int = 0
    float_params: int = 0
    other_bytes: int = 0
    # What packed products keep beside the float32 copy (engine.runtime.packed): the 4- and
    # 8-bit affine codes as stored, their scales and biases as float32. None: not known
    # (sizes from elsewhere than headers), the quantized bytes stand in for it.
    packable_bytes: int | None = None

    @property
    def params(self) -> int:
        return self.quant_params + self.float_params

    def held_bytes(self, profile: ComputeProfile, stored_bytes: int | None = None) -> int:
        """Bytes once loaded in `profile`: dequantized, every parameter in its dtype (and the
        codes that decode steps read, `kept_bytes`); else the quantized tensors as stored and
        floats in the dtype. `stored_bytes` (an import
        option's size on disk, for weights about to be requantized) replaces the latter."""
        width = dtype_width(profile.dtype)
        if profile.dequantize:
            return self.params * width + self.other_bytes + self.kept_bytes(profile)
        if stored_bytes is not None:
            return int(stored_bytes)
        return self.quant_bytes + self.float_params * width + self.other_bytes

    def kept_bytes(self, profile: ComputeProfile) -> int:
        """The codes a load in `profile` keeps beside the dequantized weights, where decode
        steps read them (engine.runtime.packed); 0 elsewhere."""
        if not (profile.dequantize and packed.applies(profile.dtype)):
            return 0
        return self.quant_bytes if self.packable_bytes is None else self.packable_bytes

    @classmethod
    def from_arrays(cls, config: Mapping[str, Any], weights: Mapping[str, Any]) -> WeightSizes:
        """From (lazily loaded) MLX arrays or anything with .size, .nbytes and .dtype: a
        `.weight` with `.scales` beside it is quantized at its module's bits (the config's
        quantization entry for it, else the default)."""
        items = {k: (int(a.size), int(a.nbytes), str(a.dtype).removeprefix("mlx.core."))
                 for k, a in weights.items()}
        return cls.from_items(config, items)

    @classmethod
    def from_folder(cls, config: Mapping[str, Any], folder: Path) -> WeightSizes:
        """From a model folder's *.safetensors headers (no tensor is read); ImportFailed for a
        file without one."""
        return cls.from_items(config, safetensors_items(folder))

    @classmethod
    def from_items(cls, config: Mapping[str, Any],
                   items: Mapping[str, tuple[int, int, str]]) -> WeightSizes:
        """From name -> (elements, bytes, dtype name) as a safetensors header gives them."""
        quant = config.get("quantization") or {}
        qp = qb = fp = other = kept = 0
        for key, (size, nbytes, dtype) in items.items():
            module, _, leaf = key.rpartition(".")
            if f"{module}.scales" in items:
                q = quant.get(module)
                q = q if isinstance(q, dict) else quant
                bits, group = int(q.get("bits", 4)), int(q.get("group_size", 64))
                if leaf == "weight":
                    qp += size * 32 // bits
                qb += nbytes  # codes, scales and biases
                if (bits in (4, 8) and group % 32 == 0 and f"{module}.biases" in items
                        and q.get("mode", "affine") == "affine"):
                    kept += nbytes if leaf == "weight" else size * 4
            elif dtype in _FLOAT_DTYPES:
                fp += size
            else:
                other += nbytes
        return cls(qp, qb, fp, other, kept)


# -- the KV cache --------------------------------------------------------------------------
@dataclass(frozen=True)
class KVLayer:
    """What one layer's cache holds per token (values of keys and of values, all heads) and
    how many tokens at most (`window`; None: every token of the context)."""

    key_values: int
    value_values: int
    window: int | None = None


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal config's language model (gemma3's text_config), else the config."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def _windows(config: Mapping[str, Any], layers: int) -> list[int | None]:
    """Per layer, its sliding window or None (full attention), as the model file reads its
    config: explicit layer_types first, then each family's own rule."""
    window = config.get("sliding_window")
    window = int(window) if window else None
    mtype = str(config.get("model_type", ""))
    types = config.get("layer_types")
    if mtype == "gpt_oss" and not types:
        types = ["sliding_attention", "full_attention"] * (layers // 2)
    if isinstance(types, list) and len(types) == layers and window:
        return [window if t == "sliding_attention" else None for t in types]
    pattern = config.get("sliding_window_pattern")
    if mtype.startswith("gemma3") and not pattern:
        pattern = 6  # mlx-lm's gemma3_text default
    if pattern and window:  # gemma3, cohere2: every pattern-th layer is global
        p = int(pattern)
        return [None if (i + 1) % p == 0 else window for i in range(layers)]
    if mtype == "gemma2" and window:  # even layers slide, odd ones attend to everything
        return [window if i % 2 == 0 else None for i in range(layers)]
    if mtype == "mistral" and window:  # Mistral 7B v0.1: every layer slides
        return [window] * layers
    if mtype in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and window \
            and config.get("use_sliding_window"):
        start = int(config.get("max_window_layers") or 0)
        return [window if i >= start else None for i in range(layers)]
    return [None] * layers


def kv_layers(config: Mapping[str, Any]) -> list[KVLayer]:
    """The KV cache's layers for a config (see KVLayer), from the config alone."""
    c = _text_config(config)
    layers = int(c.get("num_hidden_layers") or 0)
    heads = int(c.get("num_attention_heads") or 1)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or int(c.get("hidden_size") or 0) // heads)
    mtype = str(c.get("model_type", ""))
    if mtype == "deepseek_v2":  # mlx-lm caches the up-projected keys and values, every head
        k = heads * (int(c.get("qk_nope_head_dim", 128)) + int(c.get("qk_rope_head_dim", 64)))
        v = heads * int(c.get("v_head_dim", 128))
    elif mtype == "deepseek_v3":  # the latent and the RoPE part of the key, shared by heads
        k, v = int(c.get("kv_lora_rank", 512)), int(c.get("qk_rope_head_dim", 64))
    else:
        k = v = kv_heads * head_dim
    return [KVLayer(k, v, w) for w in _windows(c, layers)]


def value_group(bits: int) -> int:
    """The paged KV cache's default quantization group at `bits`."""
    # The KV layer's table; it (and MLX with it) loads only when quantized KV is asked for.
    from engine.kv.settings import DEFAULT_GROUP

    return DEFAULT_GROUP.get(bits, 64)


def value_bytes(width: int, bits: int = 16, group: int | None = None) -> float:
    """Bytes per cached value: the compute dtype's width, or `bits` plus a scale and a bias
    (in the compute dtype) per `group` values."""
    if bits == 16:
        return float(width)
    return bits / 8 + 2 * width / (group or value_group(bits))


def kv_bytes(layers: list[KVLayer], context: int, width: int, bits: int = 16,
             group: int | None = None) -> int:
    """Bytes the cache holds at `context` tokens: each layer its window at most."""
    per = value_bytes(width, bits, group)
    total = 0.0
    for layer in layers:
        tokens = context if layer.window is None else min(context, layer.window)
        total += (layer.key_values + layer.value_values) * tokens * per
    return int(total)


# -- this machine --------------------------------------------------------------------------
def _sysctl_int(name: str) -> int | None:
    import subprocess  # here: only macOS asks sysctl, and this module is on the load's path

    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                             timeout=5, check=False).stdout.strip()
        return int(out) if out else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


@functools.cache
def _metal_limit() -> int | None:
    """The Metal GPU's wired-memory limit (macOS only; never called elsewhere): the user's
    iogpu.wired_limit_mb when set, else Metal's recommended working set."""
    mb = _sysctl_int("iogpu.wired_limit_mb")
    if mb:
        return mb << 20
    import mlx.core as mx  # heavy: the GPU is asked only on macOS

    with contextlib.suppress(Exception):  # no Metal device: no GPU limit to apply
        info_fn = getattr(mx, "device_info", None) or mx.metal.device_info
        size = info_fn().get("max_recommended_working_set_size")
        if size:
            return int(size)
    return None


def gpu_memory_limit() -> int | None:
    """Bytes the GPU may wire, where weights and KV must also fit: macOS with Metal only
    (None on Linux, and with STRATA_DEVICE=cpu)."""
    if sys.platform != "darwin" or os.environ.get("STRATA_DEVICE") == "cpu":
        return None
    return _metal_limit()


def memory_limit() -> tuple[int, str]:
    """(bytes Strata may use, what sets that bound): the system's available memory, capped by
    STRATA_MAX_MEMORY_MB and by the GPU's wired-memory limit."""
    available, what = int(psutil.virtual_memory().available), "free system memory"
    cap = os.environ.get("STRATA_MAX_MEMORY_MB")
    if cap:
        try:
            capped = int(float(cap) * 2**20)
        except ValueError as exc:
            raise LoadFailed(f"STRATA_MAX_MEMORY_MB={cap!r} is not a number of megabytes"
                             ) from exc
        if capped < available:
            available, what = capped, "STRATA_MAX_MEMORY_MB"
    gpu = gpu_memory_limit()
    if gpu is not None and gpu < available:
        available, what = gpu, "the GPU's wired-memory limit"
    return available, what


def memory_available() -> int:
    """Bytes Strata may use (memory_limit's figure)."""
    return memory_limit()[0]


# -- the estimate --------------------------------------------------------------------------
def trained_context(config: Mapping[str, Any]) -> int:
    c = _text_config(config)
    return int(c.get("max_position_embeddings") or DEFAULT_CONTEXT)


def chosen_context(config: Mapping[str, Any], folder: Path | None = None,
                   context: int | None = None) -> int:
    """The context a model runs at: `context`, else STRATA_CONTEXT, else the folder's
    manifest "context", else its trained context."""
    if context:
        return int(context)
    env = os.environ.get("STRATA_CONTEXT")
    if env:
        try:
            return max(1, int(env))
        except ValueError as exc:
            raise LoadFailed(f"STRATA_CONTEXT={env!r} is not a number of tokens") from exc
    if folder is not None:
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
            chosen = json.loads((folder / "manifest.json").read_text()).get("context")
            if chosen:
                return int(chosen)
    return trained_context(config)


@dataclass(frozen=True)
class Fit:
    """Weights plus KV at `context` against `available_bytes` (see the module docstring).
    `at(context)` is the same model and machine at another context."""

    weights_bytes: int
    context: int
    trained_context: int
    available_bytes: int
    limit: str  # what bounds available_bytes: memory_limit's name for it
    dtype: str  # the compute dtype weights and KV are held in
    layers: tuple[KVLayer, ...] = ()
    kv_bits: int = 16
    kv_group: int | None = None
    kv_ram_limit: int | None = None  # a paged KV cache's RAM budget (the rest on the SSD)
    packed_bytes: int = 0  # of weights_bytes, the codes decode steps read (WeightSizes.kept_bytes)

    @property
    def kv_bytes(self) -> int:
        kv = kv_bytes(list(self.layers), self.context, dtype_width(self.dtype), self.kv_bits,
                      self.kv_group)
        return kv if self.kv_ram_limit is None else min(kv, self.kv_ram_limit)

    @property
    def needed_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.available_bytes

    @property
    def max_context(self) -> int:
        """The largest context that fits, up to the larger of the chosen and the trained one
        (0: not even the weights)."""
        room, upper = self.available_bytes - self.weights_bytes, max(self.context,
                                                                     self.trained_context)
        if self.kv_ram_limit is not None and 0 <= self.kv_ram_limit <= room:
            return upper  # the pages past the RAM budget go to the SSD: any context fits
        return largest_context(list(self.layers), room, upper, dtype_width(self.dtype),
                               self.kv_bits, self.kv_group)

    def at(self, context: int) -> Fit:
        return replace(self, context=max(1, int(context)))

    def numbers(self) -> str:
        """'needs about 0.92 GB (weights 0.54 GB as float32, KV 0.38 GB for 8,192 tokens)'."""
        kv = f"KV {self.kv_bytes / 1e9:.2f} GB for {self.context:,} tokens"
        if self.kv_bits != 16:
            kv += f" at {self.kv_bits} bits"
        return (f"needs about {self.needed_bytes / 1e9:.2f} GB (weights "
                f"{self.weights_bytes / 1e9:.2f} GB as {self.dtype}, {kv})")

    def offer(self) -> str:
        """What would fit instead, in words (empty when this fits)."""
        if self.fits:
            return ""
        most = self.max_context
        if most <= 0:
            return ("the weights alone are more than that: close other programs or choose a "
                    "smaller model or quantization")
        return f"it would fit with a context of up to {most:,} tokens (STRATA_CONTEXT={most})"

    def refusal(self, name: str) -> str:
        """The one-line refusal naming `name` (empty when this fits)."""
        if self.fits:
            return ""
        return (f"{name}: {self.numbers()} but only {self.available_bytes / 1e9:.2f} GB is "
                f"available ({self.limit}); {self.offer()}")

    def summary(self) -> str:
        """One line for the import dialog and the library: the numbers and the verdict."""
        verdict = "fits" if self.fits else "does not fit"
        return (f"{verdict}: weights {self.weights_bytes / 1e9:.2f} GB + KV "
                f"{self.kv_bytes / 1e9:.2f} GB at {self.context:,} tokens = "
                f"{self.needed_bytes / 1e9:.2f} GB of {self.available_bytes / 1e9:.2f} GB "
                f"available ({self.limit})")


def largest_context(layers: list[KVLayer], room: int, upper: int, width: int,
                    bits: int = 16, group: int | None = None) -> int:
    """The largest context up to `upper` whose KV fits in `room` bytes (rounded down to a
    multiple of CONTEXT_STEP above it); 0 when none does."""
    if room < 0:
        return 0
    if kv_bytes(layers, upper, width, bits, group) <= room:
        return upper
    lo, hi = 0, upper  # kv(lo) fits, kv(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kv_bytes(layers, mid, width, bits, group) <= room:
            lo = mid
        else:
            hi = mid
    return lo - lo % CONTEXT_STEP if lo >= CONTEXT_STEP else lo


def estimate(config: Mapping[str, Any], weights: WeightSizes, profile: ComputeProfile,
             context: int | None = None, *, stored_bytes: int | None = None,
             kv_bits: int = 16, kv_group: int | None = None,
             kv_ram_limit: int | None = None, freed_bytes: int = 0) -> Fit:
    """Will this model fit at `context` (chosen_context's default)? See the module docstring.

    stored_bytes: the weights' size as an import option will store them (see held_bytes).
    kv_ram_limit: a paged KV cache's RAM budget when its pages go on to the SSD (the KV then
    needs at most that much memory). freed_bytes: memory the load frees before it starts (the
    model it replaces), added to what is available."""
    if kv_bits != 16 and kv_group is None:
        kv_group = value_group(kv_bits)
    available, limit = memory_limit()
    return Fit(weights.held_bytes(profile, stored_bytes), chosen_context(config, context=context),
               trained_context(config), available + max(0, freed_bytes), limit, profile.dtype,
               tuple(kv_layers(config)), kv_bits, kv_group, kv_ram_limit,
               weights.kept_bytes(profile))


def memory_needed(config: dict[str, Any], weights: dict[str, Any], profile: ComputeProfile
                  ) -> tuple[int, int]:
    """(weight bytes once loaded in this profile, KV bytes at the chosen context), from
    shapes only: nothing is read from disk."""
    fit = estimate(config, WeightSizes.from_arrays(config, weights), profile)
    return fit.weights_bytes, fit.kv_bytes


def check_memory(folder: Path, config: dict[str, Any], weights: dict[str, Any],
                 profile: ComputeProfile, *, context: int | None = None, kv_bits: int = 16,
                 kv_ram_limit: int | None = None) -> Fit:
    """Refuse, with the numbers and the largest context that would fit, a model that would
    push the machine into swap; the Fit otherwise."""
    fit = estimate(config, WeightSizes.from_arrays(config, weights), profile,
                   chosen_context(config, folder, context), kv_bits=kv_bits,
                   kv_ram_limit=kv_ram_limit)
    if not fit.fits:
        raise LoadFailed(fit.refusal(folder.name))
    return fit


# -- across several Macs ------------------------------------------------------------------
@dataclass(frozen=True)
class RankFit:
    """One Mac's part of a split model: its weights and KV against its available memory."""

    name: str
    weights_bytes: int
    kv_bytes: int
    available_bytes: int

    @property
    def fits(self) -> bool:
        return self.weights_bytes + self.kv_bytes <= self.available_bytes

    def numbers(self) -> str:
        return (f"{self.name} {(self.weights_bytes + self.kv_bytes) / 1e9:.2f} of "
                f"{self.available_bytes / 1e9:.2f} GB (weights {self.weights_bytes / 1e9:.2f}, "
                f"KV {self.kv_bytes / 1e9:.2f})")


@dataclass(frozen=True)
class ClusterFit:
    """A model split across Macs (`cluster_fit`): each rank's part, rank 0 (this Mac) first."""

    one: Fit  # the same model on this Mac alone
    mode: str  # 'tensor' or 'pipeline'
    ranks: tuple[RankFit, ...]

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    def summary(self) -> str:
        """'run across 3 Macs: this Mac 0.40 of 8.00 GB (...); mac-2 ...' or the refusal."""
        per = "; ".join(r.numbers() for r in self.ranks)
        n = len(self.ranks)
        if self.fits:
            return f"run across {n} Macs ({self.mode} split): {per}"
        short = ", ".join(r.name for r in self.ranks if not r.fits)
        return f"does not fit across {n} Macs either ({short} short): {per}"


def cluster_fit(one: Fit, config: Mapping[str, Any], available: list[tuple[str, int]],
                mode: str, layer_ranges: list[tuple[int, int]] | None = None,
                replicated_fraction: float | None = None) -> ClusterFit:
    """The model of `one` (this Mac's Fit) split across `available` ((name, bytes) per Mac,
    this one first) by `mode`: tensor, every rank holds the whole embedding (and head) plus
    1/N of each layer and the KV of 1/N of the KV heads; pipeline, rank r holds the layers
    `layer_ranges[r]` and their KV, rank 0 the embedding and head too. The embedding's share
    of the weights comes from the config (vocabulary x hidden, twice when the head is not
    tied) unless `replicated_fraction` says it."""
    text = _text_config(config)
    n = len(available)
    vocab, hidden = int(text.get("vocab_size") or 0), int(text.get("hidden_size") or 0)
    total_layers = int(text.get("num_hidden_layers") or 1)
    if replicated_fraction is None:
        heads_out = 1 if text.get("tie_word_embeddings", config.get("tie_word_embeddings")) else 2
        per_layer = 12 * hidden * hidden  # attention + MLP, when nothing better is known
        inter = int(text.get("intermediate_size") or 0)
        if inter:
            kvh = int(text.get("num_key_value_heads") or text.get("num_attention_heads") or 1)
            heads = int(text.get("num_attention_heads") or 1)
            hd = int(text.get("head_dim") or hidden // max(1, heads))
            per_layer = hidden * hd * (2 * heads + 2 * kvh) + 3 * hidden * inter
        emb = heads_out * vocab * hidden
        replicated_fraction = emb / max(1, emb + total_layers * per_layer)
    # A rank's split weights are not packed (engine.runtime.packed serves whole weights).
    held = one.weights_bytes - one.packed_bytes
    whole = int(held * replicated_fraction)
    layers_bytes = held - whole
    kv_all = one.kv_bytes
    ranks = []
    for r, (name, avail) in enumerate(available):
        if mode == "tensor":
            w, kv = whole + layers_bytes // n, kv_all // n
        else:
            ranges = layer_ranges or []
            a, b = ranges[r] if r < len(ranges) else (0, 0)
            share = (b - a) / total_layers
            w = int(layers_bytes * share) + (whole if r == 0 else 0)
            kv = (kv_bytes(list(one.layers)[a:b], one.context, dtype_width(one.dtype),
                           one.kv_bits, one.kv_group) if one.layers else int(kv_all * share))
            if one.kv_ram_limit is not None:
                kv = min(kv, one.kv_ram_limit)
        ranks.append(RankFit(name, w, kv, int(avail)))
    return ClusterFit(one, mode, tuple(ranks))

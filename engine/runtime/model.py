"""Build an mlx-lm model from an MLX-format folder without importing transformers.

Contract: `load_weights_into_model(folder, profile, context=None)` returns (model, config).
Architectures come from mlx-lm's own model files (never written here). With `context` past
the model's trained length (max_position_embeddings) and no RoPE scaling of its own, the
model is built with YaRN scaling by their ratio (`extend_rope`) and the returned config says
so (so stored KV keyed by the config separates); inside the trained length, or for a config
that scales already (Llama 3's llama3, YaRN, longrope, linear), the config is used as is.
`head_on_last_row(model, config)` lets a prompt's last chunk compute its output head on the last
position only, inside `last_row_head()`: the logits the reply samples from are the same, and
the head's other rows (a fifth of a small model's prefill arithmetic) are never computed.
`cpu_swiglu(config)` gives mlx-lm's SwiGLU models, on MLX's CPU backend, an exp MLX computes
faster there (`fast_swiglu`). `compile_one_row_ops(model)` gives its RoPE, RMSNorm and LayerNorm
modules, on MLX's CPU backend, one compiled graph for a decode step's single position, the
rotation's angles computed once a step for every layer (the same numbers; mx.fast's ops are
a dozen plain ops there).
Importing `mlx_lm` as a package pulls in transformers (about 0.65 s); we register a bare
package module instead so that only `mlx_lm.models.*` load. If the real `mlx_lm` is
already imported, it is used as is.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import os
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map, tree_unflatten

from engine.errors import LoadFailed
from engine.platform import ComputeProfile, check_versions
from engine.runtime import packed
from engine.runtime.fit import check_memory

_versions_checked = False


def _register_bare_mlx_lm() -> None:
    """Register a bare `mlx_lm` package module (unless mlx_lm is imported already), so that
    `import mlx_lm.models.X` does not run mlx_lm/__init__.py and transformers with it."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        raise LoadFailed("mlx-lm is not installed: reinstall Strata's dependencies")
    bare = types.ModuleType("mlx_lm")
    bare.__path__ = list(spec.submodule_search_locations)
    bare.__package__ = "mlx_lm"
    bare.__file__ = spec.origin
    sys.modules["mlx_lm"] = bare


def ensure_mlx_lm() -> None:
    """The bare mlx_lm package, and the mlx and mlx-lm versions checked (once): the bare
    package and the model modules' internals are what changes between their minor versions."""
    global _versions_checked
    _register_bare_mlx_lm()
    if not _versions_checked:
        check_versions({"mlx": str(getattr(mx, "__version__", None)),  # set by the extension
                        "mlx-lm": mlx_lm_version()})
        _versions_checked = True


def mlx_lm_version() -> str | None:
    """mlx-lm's version from its own `_version` module (also inside a frozen app, where no
    distribution metadata is bundled); None if it has none."""
    _register_bare_mlx_lm()
    try:
        return str(importlib.import_module("mlx_lm._version").__version__)
    except (ImportError, AttributeError):
        return None


def model_module(model_type: str) -> types.ModuleType:
    """mlx-lm's module for an architecture (llama, qwen2, ...)."""
    ensure_mlx_lm()
    # mlx-lm maps some names onto others (mistral -> llama).
    remap = {"mistral": "llama"}
    name = remap.get(model_type, model_type)
    try:
        return importlib.import_module(f"mlx_lm.models.{name}")
    except ImportError as exc:
        raise LoadFailed(f"architecture {model_type!r} is not supported by mlx-lm") from exc


def cache_module() -> types.ModuleType:
    ensure_mlx_lm()
    return importlib.import_module("mlx_lm.models.cache")


def weights_fingerprint(manifest: Mapping[str, Any]) -> str:
    """The manifest's fingerprint; a bare folder's: weight names, sizes and mtimes."""
    if manifest.get("fingerprint"):
        return str(manifest["fingerprint"])
    path = manifest.get("path")
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


def model_identity(manifest: Mapping[str, Any], config: Mapping[str, Any],
                   profile: ComputeProfile, kv_bits: int = 16, kv_group: int = 64
                   ) -> dict[str, Any]:
    """What must match for stored KV to be valid for a model: weights, the whole config
    (architecture, RoPE: theta, scaling, traditional; quantization), compute profile, KV
    dtype, bits and (8 and 4 bits) quantization group. engine.kv.prefix.model_key hashes it
    into the pages' key. The KV mode is not in it: 16-bit pages are the model's keys and
    values in the compute dtype whichever cache computed them (mlx-lm's, exact, sparse:
    they differ by float rounding at most, as prefill chunkings do), and quantized pages
    are the same bytes in exact and sparse mode (both prefill exactly)."""
    kv: list[Any] = [profile.dtype, kv_bits] + ([kv_group] if kv_bits != 16 else [])
    return {
        "weights": weights_fingerprint(manifest),
        "config": dict(config),
        "profile": [profile.name, profile.dtype, profile.dequantize],
        "kv": kv,
    }


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise LoadFailed(f"{path}: missing config.json") from exc
    except (OSError, ValueError) as exc:
        raise LoadFailed(f"{path}: unreadable config ({exc})") from exc
    return config


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("model*.safetensors"))


def build_model(config: dict[str, Any], weights: dict[str, Any] | None = None) -> Any:
    """An uninitialised mlx-lm model for a config, quantized layers in place where it says so.

    As in mlx-lm: a path named in config["quantization"] takes its own settings (group size,
    bits and "mode": affine, mxfp4, ...); any other quantizable layer (Linear, Embedding,
    mlx-lm's SwitchLinear for stacked experts) whose `.scales` are among `weights` takes the
    default ones.
    """
    module = model_module(config.get("model_type", ""))
    args = module.ModelArgs.from_dict(config)
    model = module.Model(args)
    quant = config.get("quantization")
    if quant:
        per_path = {k: v for k, v in quant.items() if isinstance(v, dict)}

        def predicate(path: str, mod: Any) -> bool | dict[str, Any]:
            if path in per_path:
                # A copy holding only what to_quantized takes (nn.quantize may pop keys).
                return {k: v for k, v in per_path[path].items() if k in _QUANT_KEYS}
            return (weights is not None and hasattr(mod, "to_quantized")
                    and f"{path}.scales" in weights)

        nn.quantize(
            model,
            group_size=quant.get("group_size", 64),
            bits=quant.get("bits", 4),
            mode=quant.get("mode", "affine"),
            class_predicate=predicate,
        )
    return model


# The settings a quantized module's to_quantized takes from a per-module config entry.
_QUANT_KEYS = ("group_size", "bits", "mode")


# Architectures whose mlx-lm module passes `rope_scaling` to rope_utils.initialize_rope over
# the whole head dim, so that a YaRN config added here is what their attention rotates by.
YARN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# YaRN's ramp (NTK-by-parts, Peng et al. 2023): dimensions turning more than BETA_FAST times
# over the trained window keep their frequency, fewer than BETA_SLOW times are interpolated.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def extend_rope(config: Mapping[str, Any], context: int | None) -> dict[str, Any]:
    """`config` for a model run at `context` tokens: past its trained length, with no RoPE
    scaling of its own, YaRN scaling by context / trained length (static: one set of
    frequencies for every position, so the keys cached at any point stay valid; the
    attention temperature 0.1 ln(s) + 1 applied to queries and keys); otherwise unchanged
    (a copy). The trained length stays in `max_position_embeddings`."""
    out = dict(config)
    trained = int(config.get("max_position_embeddings") or 0)
    if not context or not trained or context <= trained:
        return out
    if config.get("model_type") not in YARN_MODEL_TYPES:
        return out
    own = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if (own.get("type") or own.get("rope_type") or "default") != "default":
        return out  # the model's own scaling (llama3, yarn, longrope, linear, ...) stays
    out["rope_scaling"] = {"rope_type": "yarn", "factor": round(context / trained, 4),
                           "original_max_position_embeddings": trained,
                           "beta_fast": YARN_BETA_FAST, "beta_slow": YARN_BETA_SLOW}
    return out


def load_weights_into_model(folder: Path, profile: ComputeProfile, context: int | None = None,
                            keep_codes: bool = False) -> tuple[Any, dict[str, Any]]:
    """Load weights (memory-mapped by mx.load) and apply the compute profile; past the trained
    length, `context` extends RoPE (`extend_rope`). `keep_codes`: see `apply_profile`."""
    config = extend_rope(read_config(folder), context)
    files = weight_files(folder)
    if not files:
        raise LoadFailed(f"{folder}: no model*.safetensors weights")
    weights: dict[str, Any] = {}
    for f in files:
        try:
            loaded: Any = mx.load(str(f))
            weights.update(loaded)
        except (RuntimeError, ValueError) as exc:
            raise LoadFailed(f"{f}: unreadable weights ({exc})") from exc
    check_memory(folder, config, weights, profile)  # before any array is built
    model = build_model(config, weights)
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise LoadFailed(f"{folder}: weights do not match the config ({exc})") from exc
    model.eval()
    apply_profile(model, profile, keep_codes)
    mx.eval(model.parameters())
    return model, config


def apply_profile(model: Any, profile: ComputeProfile, keep_codes: bool = False) -> None:
    """Dequantize and/or cast parameters as the profile says, in place.

    Dequantizing covers QuantizedLinear, QuantizedEmbedding and mlx-lm's QuantizedSwitchLinear
    (stacked experts) in every mode MLX quantizes in (affine, mxfp4, nvfp4, ...).
    `keep_codes`: a dequantized float32 Linear or Embedding remembers its affine codes for
    `packed.pack_weights` (a model that decodes: LoadedModel.load); otherwise they are let go."""
    dtype = getattr(mx, profile.dtype)
    if profile.dequantize:
        switch = _switch_layers()
        replacements = []
        for path, mod in model.named_modules():
            new: nn.Module
            if isinstance(mod, switch.QuantizedSwitchLinear):
                w = _dense_weight(mod, dtype)
                experts, out_dims, in_dims = w.shape
                new = switch.SwitchLinear(in_dims, out_dims, experts, bias="bias" in mod)
            elif isinstance(mod, nn.QuantizedEmbedding):
                w = _dense_weight(mod, dtype)
                new = nn.Embedding(w.shape[0], w.shape[1])
            elif isinstance(mod, nn.QuantizedLinear):
                w = _dense_weight(mod, dtype)
                new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in mod)
            else:
                continue
            if "bias" in mod:
                new.bias = mod.bias.astype(dtype)
            new.weight = w
            if (keep_codes and dtype == mx.float32 and w.ndim == 2
                    and getattr(mod, "mode", "affine") == "affine"
                    and getattr(mod, "biases", None) is not None):
                # the codes a decode step's products can read instead (engine.runtime.packed)
                packed.remember(new, packed.PackSource(
                    mod.weight, mod.scales.astype(mx.float32), mod.biases.astype(mx.float32),
                    mod.bits, mod.group_size))
            replacements.append((path, new))
        if replacements:
            model.update_modules(_unflatten(replacements))
    # Cast float parameters (norms, unquantized weights); quantized weights stay uint32.
    params = model.parameters()
    model.update(
        tree_map(
            lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
            params,
        )
    )


def _switch_layers() -> types.ModuleType:
    ensure_mlx_lm()
    return importlib.import_module("mlx_lm.models.switch_layers")


def _dense_weight(mod: Any, dtype: Any) -> Any:
    """A quantized module's weight as floats of `dtype`, computed in float32.

    Affine scales and biases are floats (cast up so the products are float32); mxfp4/nvfp4
    scales are 8-bit codes that mx.dequantize reads as they are. nvfp4 switch layers may carry
    one global scale per expert, so those dequantize expert by expert."""
    mode = getattr(mod, "mode", "affine")
    scales = mod.scales
    biases = getattr(mod, "biases", None)
    if mode == "affine":
        scales = scales.astype(mx.float32)
        biases = None if biases is None else biases.astype(mx.float32)
    global_scale = getattr(mod, "global_scale", None)
    if global_scale is not None and mod.weight.ndim == 3:
        w = mx.stack([
            mx.dequantize(mod.weight[e], scales[e], None, group_size=mod.group_size,
                          bits=mod.bits, mode=mode, global_scale=global_scale[e],
                          dtype=mx.float32)
            for e in range(mod.weight.shape[0])])
    else:
        w = mx.dequantize(mod.weight, scales, biases, group_size=mod.group_size,
                          bits=mod.bits, mode=mode, global_scale=global_scale,
                          dtype=mx.float32)
    return w.astype(dtype)


def _unflatten(pairs: list[tuple[str, Any]]) -> Any:
    return tree_unflatten(pairs)


# Architectures whose Model.__call__ applies the output head once, to the backbone's final
# hidden states (`lm_head`, or the tied embedding's `as_linear`), with only elementwise
# scaling or soft-capping after it, as read in mlx-lm 0.32's model files. Not every model is
# so: gemma4_text also calls `as_linear` on its input embeddings.
LAST_ROW_HEAD_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3_text", "phi", "phi3", "smollm3", "starcoder2", "mixtral", "olmo2", "granite",
    "cohere", "gpt2", "deepseek_v2", "deepseek_v3"})

_head_state = threading.local()  # per thread: a server's other threads keep every row


@contextlib.contextmanager
def last_row_head() -> Iterator[None]:
    """On this thread, inside the block, a model prepared by `head_on_last_row` computes its
    output head on the last position only: logits of shape (batch, 1, vocab)."""
    before = getattr(_head_state, "on", False)
    _head_state.on = True
    try:
        yield
    finally:
        _head_state.on = before


def _head_input(x: Any) -> Any:
    if getattr(_head_state, "on", False) and x.ndim == 3 and x.shape[1] > 1:
        return x[:, -1:]
    return x


class _LastRowLinear:
    def __call__(self, x: Any) -> Any:
        return super().__call__(_head_input(x))  # type: ignore[misc]


class _LastRowEmbedding:
    def as_linear(self, x: Any) -> Any:
        return super().as_linear(_head_input(x))  # type: ignore[misc]


_head_classes: dict[tuple[type, type], type] = {}


def _subclass_with(mod: Any, mixin: type) -> None:
    # A subclass of the module's own class: its parameters, their names and isinstance
    # checks stay as they were; only what the mixin's __call__ does first changes
    # (`plain_class` gives back the class it was).
    cls = type(mod)
    if issubclass(cls, mixin):
        return
    key = (mixin, cls)
    if key not in _head_classes:
        _head_classes[key] = type(cls.__name__, (mixin, cls),
                                  {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                   "plain_class": cls})
    mod.__class__ = _head_classes[key]


def head_on_last_row(model: Any, config: Mapping[str, Any]) -> bool:
    """Prepare `model`'s output head for `last_row_head` (its `lm_head`, and the embedding
    a tied head multiplies by); False, and nothing changed, for an architecture not in
    LAST_ROW_HEAD_TYPES or a model without those modules, whose head keeps every row."""
    if config.get("model_type") not in LAST_ROW_HEAD_TYPES:
        return False
    inner = getattr(model, "model", None)
    heads = [m for m in (getattr(model, "lm_head", None),) if isinstance(m, nn.Module)]
    tied = [m for m in (getattr(inner, "embed_tokens", None), getattr(inner, "wte", None))
            if isinstance(m, nn.Module) and hasattr(m, "as_linear")]
    if not heads and not tied:
        return False
    for m in heads:
        _subclass_with(m, _LastRowLinear)
    for m in tied:
        _subclass_with(m, _LastRowEmbedding)
    return True


_LOG2E = 1.4426950408889634


@functools.partial(mx.compile, shapeless=True)
def fast_swiglu(gate: Any, x: Any) -> Any:
    """silu(gate) * x, with exp(-g) taken as 2 ** (-g log2 e): MLX's CPU exp runs about
    0.1G elements/s here and its power 0.3G, so a 512-token prompt chunk's activations took
    10.5 ms a layer with mlx-lm's swiglu and 3.0 with this (docs/benchmarks.md, prefill).
    Within a few float32 ulps of it; 0 where 2 ** 128 overflows, as silu's own limit."""
    return gate / (1.0 + mx.power(2.0, gate * -_LOG2E)) * x


def cpu_swiglu(config: Mapping[str, Any]) -> bool:
    """On MLX's CPU backend, `fast_swiglu` for mlx-lm's `swiglu` in the model's module and
    its stacked experts' (switch_layers): module globals, so every model of that
    architecture in this process (the KV benchmarks' mlx-lm cache rows run on Strata's own
    model; mlx-lm's own subject loads in its own process). False where nothing was changed:
    another backend, or a module without mlx-lm's swiglu."""
    if mx.default_device() != mx.cpu:
        return False
    ours = importlib.import_module("mlx_lm.models.activations").swiglu
    changed = False
    for mod in (model_module(config.get("model_type", "")), _switch_layers()):
        if getattr(mod, "swiglu", None) is ours:
            setattr(mod, "swiglu", fast_swiglu)  # noqa: B010  (a module global, by name)
            changed = True
    return changed


# A decode step's RoPE and norms (one position) through one compiled graph each, on MLX's
# CPU backend: there mx.fast.rope, rms_norm and layer_norm are built of MLX's plain ops (about a
# dozen for the rotation), each dispatched on its own. In a chain of 100 on the starter's
# shapes a rotation took 50 us and a norm 18.5; compiled, 22 and 8.8, with bit-equal results.
# In the starter's decode step, alternated in one process: 25.9 -> 22.0 ms at depth 0, a
# sparse step at 32k 59.5 -> 54.3, an exact one at 16k 56.1 -> 53.5 (docs/benchmarks.md). Prompt
# chunks (more rows) keep the plain ops: one graph each is no saving there, and every new
# chunk length would be traced again.
# STRATA_ONE_ROW_COMPILE=0 turns it off.
ONE_ROW_MAX = 16  # rows (positions x heads of a norm's input) still counted as a decode step
ONE_ROW_COMPILE = (os.environ.get("STRATA_ONE_ROW_COMPILE") or "1") != "0"


class _OneRowRoPE:
    def __call__(self, x: Any, offset: Any = 0, *args: Any, **kwargs: Any) -> Any:
        # An int offset (one sequence; a batch's offsets are an array) and one position.
        if args or kwargs or type(offset) is not int or x.ndim < 2 or x.shape[-2] != 1:
            return super().__call__(x, offset, *args, **kwargs)  # type: ignore[misc]
        fn = self.__dict__.get("_one_row")
        if fn is None:
            plain: Any = super().__call__  # type: ignore[misc]
            # The offset as an array input: one trace serves every position.
            fn = mx.compile(lambda x, off: plain(x, off))  # type: ignore[misc]
            object.__setattr__(self, "_one_row", fn)
        key = self.__dict__.get("_table_key")
        if key is None:
            key = _table_key(self)
            object.__setattr__(self, "_table_key", key)
        if not key or x.shape[-1] < key[1]:
            return fn(x, mx.array(offset, dtype=mx.int32))
        # Every layer rotates by the same angles at a step's position: the first rotation
        # of a unit vector gives them (cos, sin), the rest reuse them (`_rotate`).
        got = _tables.get(key)
        if got is None or got[0] != offset or got[1] != x.dtype:
            half = key[1] // 2
            unit = mx.concatenate([mx.ones((half,), x.dtype), mx.zeros((half,), x.dtype)])
            cs = fn(unit.reshape(1, 1, 1, 2 * half), mx.array(offset, dtype=mx.int32))
            got = (offset, x.dtype, cs[..., :half], cs[..., half:])
            _tables[key] = got
        return _rotate(x, got[2], got[3])


# (class, dims, base, scale, freqs) of a RoPE whose rotation `_rotate` applies from a table ->
# (offset, dtype, cos, sin) of the last position asked for.
_tables: dict[tuple[Any, ...], tuple[int, Any, Any, Any]] = {}


def _table_key(rope: Any) -> tuple[Any, ...]:
    """The key under which `rope`'s one-position angles are shared, or () where `_rotate`
    does not give what its own call gives: a rotation mx.fast.rope computes alone (no scaling
    of x before it, as SuScaledRoPE and YarnRoPE's mscale do), halves layout (not
    traditional)."""
    cls = type(rope).plain_class
    if getattr(rope, "traditional", True) or cls.__name__ not in (
            "RoPE", "Llama3RoPE", "ProportionalRoPE"):
        return ()
    freqs = rope.get("_freqs")  # an array attribute lives in the module's dict
    tag = None if freqs is None else hashlib.sha1(np.array(freqs).tobytes()).hexdigest()
    return (cls, int(rope.dims), getattr(rope, "base", None), getattr(rope, "scale", None), tag)


@mx.compile
def _rotate(x: Any, c: Any, s: Any) -> Any:
    """x rotated as mx.fast.rope's graph on the CPU rotates it (the same ops in the same
    order, so the same bits): halves x1, x2 of the first 2 len(c) dims, the rest kept."""
    half = c.shape[-1]
    x1 = x[..., :half]
    x2 = x[..., half:2 * half]
    outs = [x1 * c - x2 * s, x1 * s + x2 * c]
    if 2 * half < x.shape[-1]:
        outs.append(x[..., 2 * half:])
    return mx.concatenate(outs, axis=-1)


@functools.cache
def _compiled_rms_norm(eps: float) -> Any:
    return mx.compile(lambda x, w: mx.fast.rms_norm(x, w, eps))


class _OneRowRMSNorm:
    def __call__(self, x: Any) -> Any:
        if x.ndim < 1 or x.size > ONE_ROW_MAX * x.shape[-1]:
            return super().__call__(x)  # type: ignore[misc]
        eps = float(self.eps)  # type: ignore[attr-defined]
        return _compiled_rms_norm(eps)(x, self["weight"])  # type: ignore[index]


@functools.cache
def _compiled_layer_norm(eps: float, weight: bool, bias: bool) -> Any:
    def norm(x: Any, *wb: Any) -> Any:
        w = wb[0] if weight else None
        b = wb[-1] if bias else None
        return mx.fast.layer_norm(x, w, b, eps)
    return mx.compile(norm)


class _OneRowLayerNorm:
    def __call__(self, x: Any) -> Any:
        if x.ndim < 1 or x.size > ONE_ROW_MAX * x.shape[-1]:
            return super().__call__(x)  # type: ignore[misc]
        wb = [self[k] for k in ("weight", "bias") if k in self]  # type: ignore[operator, index]
        eps = float(self.eps)  # type: ignore[attr-defined]
        fn = _compiled_layer_norm(eps, "weight" in self, "bias" in self)  # type: ignore[operator]
        return fn(x, *wb)


def _rope_classes() -> tuple[type, ...]:
    """MLX's RoPE and mlx-lm's own scaled ones whose __call__ is one mx.fast.rope of the
    offset (not DynamicNTKScalingRoPE: it computes with the offset in Python)."""
    utils = importlib.import_module("mlx_lm.models.rope_utils")
    names = ("Llama3RoPE", "SuScaledRoPE", "YarnRoPE", "ProportionalRoPE")
    return (nn.RoPE, *(c for n in names if isinstance(c := getattr(utils, n, None), type)))


def compile_one_row_ops(model: Any) -> int:
    """On MLX's CPU backend, give `model`'s RoPE modules (`_rope_classes`, exactly those
    classes), nn.RMSNorm and nn.LayerNorm modules a compiled path for one position
    (`_OneRowRoPE`, `_OneRowRMSNorm`, `_OneRowLayerNorm`): the same numbers, fewer
    dispatched ops. Their classes become subclasses of their own (parameters and
    isinstance unchanged; `plain_class` names the class it was). Returns how many
    modules changed; 0 on another backend or with STRATA_ONE_ROW_COMPILE=0."""
    if mx.default_device() != mx.cpu or not ONE_ROW_COMPILE:
        return 0
    ropes = _rope_classes()
    changed = 0
    for _, mod in model.named_modules():
        cls = getattr(type(mod), "plain_class", type(mod))
        if cls in ropes:
            _subclass_with(mod, _OneRowRoPE)
        elif cls is nn.RMSNorm:
            _subclass_with(mod, _OneRowRMSNorm)
        elif cls is nn.LayerNorm:
            _subclass_with(mod, _OneRowLayerNorm)
        else:
            continue
        changed += 1
    return changed

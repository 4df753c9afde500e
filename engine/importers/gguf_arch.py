"""GGUF architectures: what each `general.architecture` is in mlx-lm's terms.

Contract: an `Arch` says, for one GGUF architecture, which mlx-lm model file runs it
(`model_type`; the architecture itself is never written here), how llama.cpp's converter
renamed its tensors (`layer`, `top`: GGUF name parts -> mlx-lm parameter paths), how it
changed their values (`reverse`: Q/K row permutation, norms stored with 1 added, ...) and the
config.json mlx-lm's ModelArgs read (`config`). `ARCHS` is the registry (dense families
here; engine.importers.gguf_moe registers the mixture-of-experts ones);
`arch_for(path, meta, shapes)` is the entry for a file's metadata (a registered variant may
pick another: Mixtral is "llama" with experts), ImportFailed naming the architecture and
listing the supported ones otherwise.
`hf_name(arch, gguf_name)` maps one tensor name (None: not the model's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ImportFailed

# Per-layer GGUF tensor names (blk.N.<part>) of the llama family -> mlx-lm paths under
# model.layers.N; the families below start from it.
LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LLAMA_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class Meta:
    """One file's metadata under its architecture's key prefix, with one-line failures."""

    def __init__(self, path: Path, arch: str, meta: Mapping[str, Any],
                 tensors: Mapping[str, tuple[int, ...]],
                 read: Callable[[str], np.ndarray] | None = None) -> None:
        self.path, self.arch, self.all, self.tensors = path, arch, meta, tensors
        self._read = read

    def tensor(self, gguf_name: str) -> np.ndarray:
        """A (small, float) tensor's values, for configs llama.cpp folded into a tensor
        (Llama 3's rope_freqs); ImportFailed when the file lacks it."""
        if self._read is None or gguf_name not in self.tensors:
            raise ImportFailed(f"{self.path}: missing tensor {gguf_name}")
        return self._read(gguf_name)

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}` (default when absent)."""
        return self.all.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.all.get(f"{self.arch}.{key}")
        if value is None:
            raise ImportFailed(f"{self.path}: missing metadata {self.arch}.{key}")
        return value

    def has(self, gguf_name: str) -> bool:
        return gguf_name in self.tensors


# (config, mlx-lm path, array in HF layout) -> the array as mlx-lm wants it. `data` is what
# the reader gives (block rows for quantized types, floats otherwise): a reverse may only move
# whole rows of a quantized tensor; a value change applies to float tensors only.
Reverse = Callable[[dict[str, Any], str, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Arch:
    """One GGUF architecture as llama.cpp's converter writes it."""

    name: str  # general.architecture
    model_type: str  # mlx_lm.models.<model_type>
    hf_class: str  # config["architectures"][0], as the Hugging Face checkpoint names it
    config: Callable[[Meta], dict[str, Any]]  # the full config.json for mlx-lm's ModelArgs
    layer: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_LAYER))
    top: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_TOP))
    reverse: tuple[Reverse, ...] = ()
    skip: frozenset[str] = frozenset({"rope_freqs.weight"})  # read by `config`, not weights


ARCHS: dict[str, Arch] = {}
# general.architecture -> functions that pick another Arch for some files of it (llama.cpp
# writes Mixtral as "llama" with an expert count): the first that returns one wins.
VARIANTS: dict[str, list[Callable[[Meta], Arch | None]]] = {}


def register(arch: Arch) -> Arch:
    ARCHS[arch.name] = arch
    return arch


def register_variant(name: str, pick: Callable[[Meta], Arch | None]) -> None:
    VARIANTS.setdefault(name, []).append(pick)


def supported() -> list[str]:
    """The architectures a GGUF may name, for messages and docs."""
    return sorted(ARCHS)


def arch_for(path: Path, meta: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]],
             read: Callable[[str], np.ndarray] | None = None) -> tuple[Arch, Meta]:
    """The Arch for a file's metadata (and its Meta); ImportFailed listing the supported."""
    name = str(meta.get("general.architecture", ""))
    if name not in ARCHS:
        raise ImportFailed(f"{path}: unsupported architecture {name!r} "
                           f"(supported: {', '.join(supported())})")
    m = Meta(path, name, meta, tensors, read)
    for pick in VARIANTS.get(name, []):
        chosen = pick(m)
        if chosen is not None:
            return chosen, m
    return ARCHS[name], m


def hf_name(arch: Arch, gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    # A whole "part.suffix" key maps a bare parameter (gpt-oss's attn_sinks.weight -> sinks).
    if parts[0] == "blk" and len(parts) == 4 and f"{parts[2]}.{parts[3]}" in arch.layer:
        return f"model.layers.{parts[1]}.{arch.layer[f'{parts[2]}.{parts[3]}']}"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in arch.layer:
        return f"model.layers.{parts[1]}.{arch.layer[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in arch.top:
        return f"{arch.top[parts[0]]}.{parts[1]}"
    return None


def model_config(arch: Arch, m: Meta) -> dict[str, Any]:
    """config.json for a file: the architecture's own fields plus model_type and names."""
    config = arch.config(m)
    config.setdefault("model_type", arch.model_type)
    config.setdefault("architectures", [arch.hf_class])
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                    ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in m.all:
            config.setdefault(hf, int(m.all[key]))
    return config


# -- shared pieces of the families' configs ----------------------------------------------
def vocab_size(m: Meta) -> int:
    tokens = m.all.get("tokenizer.ggml.tokens")
    return len(tokens) if tokens else int(m.get("vocab_size", 0))


def common_config(m: Meta) -> dict[str, Any]:
    """The fields every decoder-only family shares (llama.cpp's LLM_KV_* common keys)."""
    hidden = int(m.need("embedding_length"))
    heads = int(m.need("attention.head_count"))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(m.need("block_count")),
        "intermediate_size": int(m.need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.get("attention.head_count_kv", heads)),
        "head_dim": int(m.get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m.get("context_length", 4096)),
        "vocab_size": vocab_size(m),
        "tie_word_embeddings": not m.has("output.weight"),
    }


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE -> half-split RoPE)."""
    r = rows.shape[0]
    return (
        rows.reshape(n_head, r // n_head // 2, 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def unpermute_qk(config: dict[str, Any], name: str, data: np.ndarray) -> np.ndarray:
    """llama's converter permutes Q and K rows for interleaved RoPE; mlx-lm's llama wants the
    Hugging Face (half-split) order back."""
    if ".self_attn.q_proj." in name:
        return unpermute_rows(data, int(config["num_attention_heads"]))
    if ".self_attn.k_proj." in name:
        return unpermute_rows(data, int(config["num_key_value_heads"]))
    return data


# -- RoPE: what llama.cpp reads, as mlx-lm's rope_scaling ----------------------------------
def rope_scaling(m: Meta) -> dict[str, Any] | None:
    """`rope.scaling.*` as mlx-lm's rope_scaling (None: plain RoPE), as llama.cpp reads it.

    llama.cpp takes a missing type as "linear" when a factor is given (the old
    `rope.scale_linear` key included). For yarn it uses its own defaults (beta_fast 32,
    beta_slow 1, extrapolation 1) whatever yarn_* keys the file has, outside a few families
    (grok, deepseek2) that are not dense ones here: so these are mlx-lm's defaults too.
    `rope.scaling.attn_factor` scales Q and K in llama.cpp; mlx-lm's plain and linear RoPE
    cannot, so a file with one is refused.
    """
    kind = m.get("rope.scaling.type")
    factor = m.get("rope.scaling.factor", m.get("rope.scale_linear"))
    if kind is None:
        kind = "linear" if factor is not None else "none"
    attn = m.get("rope.scaling.attn_factor")
    if attn is not None and abs(float(attn) - 1.0) > 1e-6:
        raise ImportFailed(f"{m.path}: rope.scaling.attn_factor {float(attn):g} is not "
                           f"supported for {m.arch} (mlx-lm's RoPE has no such scale)")
    if kind == "none" or (kind in ("linear", "yarn") and float(factor or 1.0) == 1.0):
        return None
    if kind == "linear":
        return {"type": "linear", "rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        return {
            "type": "yarn", "rope_type": "yarn", "factor": float(factor),
            # llama.cpp: n_ctx_orig_yarn, the training context when the key is absent.
            "original_max_position_embeddings": int(m.get(
                "rope.scaling.original_context_length", m.get("context_length", 4096))),
        }
    raise ImportFailed(f"{m.path}: RoPE scaling {kind!r} is not supported for {m.arch}")


def _llama3_factors(scaling: Mapping[str, float], base: float, dim: int) -> np.ndarray:
    """The per-frequency divisors mlx-lm's Llama3RoPE applies (its formula, in numpy)."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    smooth = (old / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen > old / low, factor,
                    np.where(wavelen > old / high, medium, 1.0))


def llama3_rope_scaling(freqs: np.ndarray, base: float, dim: int
                        ) -> dict[str, Any] | None:
    """Llama 3's rope_scaling recovered from the `rope_freqs` tensor llama.cpp's converter
    folds it into (one divisor per frequency: 1 for short wavelengths, `factor` for long ones,
    a smooth ramp between); None when every divisor is 1.

    The divisors depend only on the two wavelength thresholds, original_context / low_factor
    and original_context / high_factor, so low_freq_factor is taken as 1 (as in every Llama 3
    release) and the thresholds are fitted to the ramp (exactly, from two or more ramp points;
    placed between the neighbouring wavelengths otherwise). The result is checked by
    recomputing the divisors with mlx-lm's formula; ValueError when they disagree.
    """
    f = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if f.shape[0] != dim // 2 or not np.all(np.isfinite(f)) or f.min() <= 0:
        raise ValueError(f"rope_freqs has {f.shape[0]} values for head size {dim}")
    factor = float(f.max())
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    x = 1.0 / (2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    one = np.isclose(f, 1.0, rtol=0, atol=1e-5)
    full = np.isclose(f, factor, rtol=1e-5, atol=0)
    ramp = ~(one | full)
    if ramp.sum() >= 2:
        # 1/f = (1 - s)/factor + s with s = (x - x_low)/(x_high - x_low), x = 1/wavelength.
        s = (1.0 / f[ramp] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(x[ramp], s, 1)
        x_low = -b / a
        x_high = x_low + 1.0 / a
    else:
        # The thresholds fall between wavelengths: anywhere in the gaps gives the same
        # divisors. x decreases along the frequencies.
        last_one = x[one].min() if one.any() else x.max() * 2
        first_full = x[full].max() if full.any() else x.min() / 2
        if ramp.sum() == 1:
            xm = float(x[ramp][0])
            sm = (1.0 / f[ramp][0] - 1.0 / factor) / (1.0 - 1.0 / factor)
            # s(xm) = sm pins x_low given x_high; keep x_low above the first full point.
            bound = min(last_one, (xm - (1 - sm) * first_full) / sm) if sm > 0 else last_one
            x_high = (xm + bound) / 2
            x_low = (xm - sm * x_high) / (1 - sm)
        else:
            x_high = first_full + 0.75 * (last_one - first_full)
            x_low = first_full + 0.25 * (last_one - first_full)
    old, high = 1.0 / x_low, x_high / x_low
    # Round to the integers releases use when that keeps the divisors (it does whenever two
    # or more ramp points pinned the thresholds).
    for old_c, high_c, rtol in ((float(round(old)), float(round(high, 3)), 2e-6),
                                (old, high, 1e-4)):
        scaling: dict[str, Any] = {
            "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": high_c, "original_max_position_embeddings": old_c,
        }
        if np.allclose(_llama3_factors(scaling, base, dim), f, rtol=rtol, atol=0):
            if old_c.is_integer():
                scaling["original_max_position_embeddings"] = int(old_c)
            return scaling
    raise ValueError("rope_freqs does not follow Llama 3's RoPE scaling")


def _rope_dims(m: Meta, head_dim: int) -> int:
    return int(m.get("rope.dimension_count", head_dim))


def full_rotary(m: Meta, head_dim: int) -> None:
    """Refuse partial RoPE (mlx-lm's files here rotate the whole head)."""
    if _rope_dims(m, head_dim) != head_dim:
        raise ImportFailed(f"{m.path}: partial RoPE ({_rope_dims(m, head_dim)} of {head_dim} "
                           f"head dimensions) is not supported for {m.arch}")


def derived_head_dim(m: Meta, config: dict[str, Any], model_type: str) -> None:
    """mlx-lm files that take the head size as hidden / heads: refuse a file that differs."""
    derived = config["hidden_size"] // config["num_attention_heads"]
    if config["head_dim"] != derived:
        raise ImportFailed(f"{m.path}: head size {config['head_dim']} differs from hidden / "
                           f"heads ({derived}), which mlx-lm's {model_type} assumes")


def no_rope_scaling(m: Meta, model_type: str) -> None:
    """For mlx-lm files that build plain RoPE whatever the config says: refuse scaling."""
    scaling = rope_scaling(m)
    if scaling is not None:
        raise ImportFailed(f"{m.path}: RoPE scaling {scaling.get('rope_type')!r} is not "
                           f"supported for {model_type} (mlx-lm's {model_type} uses plain "
                           "RoPE)")


def _layer_is_sliding(m: Meta, layers: int, default: int) -> list[bool]:
    """llama.cpp's per-layer sliding-window flags: `attention.sliding_window_pattern` as an
    array of flags, or n (the family's default when absent): layer i slides unless
    i % n == n - 1 (n = 0: every layer slides)."""
    pattern = m.get("attention.sliding_window_pattern", default)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) < layers:
            raise ImportFailed(f"{m.path}: sliding-window pattern has {len(pattern)} entries "
                               f"for {layers} layers")
        return [bool(x) for x in pattern[:layers]]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


# -- value changes the converter made -------------------------------------------------------
def _floats(name: str, data: np.ndarray) -> np.ndarray:
    if data.dtype.kind != "f":
        # A norm is a 1-D float tensor in every file llama.cpp writes.
        raise ValueError(f"{name} is stored as {data.dtype}, expected floats")
    return data


def minus_one_norms(config: dict[str, Any], name: str, data: np.ndarray) -> np.ndarray:
    """Gemma's converter stores RMSNorm weights with the 1 added (x * (1 + w) in Gemma's
    code); mlx-lm's Gemma RMSNorm adds the 1 itself."""
    if name.endswith("norm.weight"):
        return _floats(name, data) - np.asarray(1, dtype=data.dtype)
    return data


# -- llama (Llama 2 and 3.x, Mistral, SmolLM, ...) -----------------------------------------
def _llama_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    full_rotary(m, config["head_dim"])  # llama.cpp refuses anything else for llama
    bias = m.has("blk.0.attn_q.bias")
    if bias and not m.has("blk.0.attn_output.bias"):
        # mlx-lm's llama puts a bias on all four projections or on none.
        raise ImportFailed(f"{m.path}: Q/K/V biases without an output bias are not "
                           "supported for llama")
    config["attention_bias"] = bias
    config["mlp_bias"] = m.has("blk.0.ffn_up.bias")
    scaling = rope_scaling(m)
    if m.has("rope_freqs.weight"):
        # Llama 3.1+: the converter folds rope_scaling {rope_type: llama3} into per-frequency
        # divisors; llama.cpp applies them on top of any other scaling, mlx-lm cannot.
        llama3 = llama3_rope_scaling(m.tensor("rope_freqs.weight"), config["rope_theta"],
                                     config["head_dim"])
        if llama3 is not None and scaling is not None:
            raise ImportFailed(f"{m.path}: rope_freqs together with RoPE scaling "
                               f"{scaling['type']!r} is not supported")
        scaling = llama3 or scaling
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


register(Arch("llama", "llama", "LlamaForCausalLM", _llama_config, reverse=(unpermute_qk,)))
# No llama.cpp converter writes "mistral" (Mistral 7B and Nemo are "llama"); kept for files
# from other tools that do.
register(Arch("mistral", "llama", "MistralForCausalLM", _llama_config,
              reverse=(unpermute_qk,)))


# -- qwen2 (Qwen2, Qwen2.5) ------------------------------------------------------------------
def _hidden_over_heads_config(m: Meta, model_type: str) -> dict[str, Any]:
    """The common config of a family whose mlx-lm file takes the head size as hidden / heads
    and reads rope_scaling (qwen2, olmo2)."""
    config = common_config(m)
    full_rotary(m, config["head_dim"])
    derived_head_dim(m, config, model_type)
    scaling = rope_scaling(m)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _qwen2_config(m: Meta) -> dict[str, Any]:
    return _hidden_over_heads_config(m, "qwen2")


def _qwen2_as_llama_config(m: Meta) -> dict[str, Any]:
    config = _llama_config(m)
    config["architectures"] = ["Qwen2ForCausalLM"]
    return config


QWEN2 = register(Arch("qwen2", "qwen2", "Qwen2ForCausalLM", _qwen2_config))
# mlx-lm's qwen2 always has Q/K/V biases; a qwen2 file without them is llama's computation
# (NeoX-style RoPE, which llama.cpp's converter does not permute for qwen2).
QWEN2_NO_BIAS = Arch("qwen2", "llama", "Qwen2ForCausalLM", _qwen2_as_llama_config)
register_variant("qwen2", lambda m: None if m.has("blk.0.attn_q.bias") else QWEN2_NO_BIAS)


# -- qwen3 (dense) ---------------------------------------------------------------------------
def _qwen3_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    full_rotary(m, config["head_dim"])
    if m.has("blk.0.attn_q.bias"):
        raise ImportFailed(f"{m.path}: Q/K/V biases are not supported for qwen3")
    scaling = rope_scaling(m)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
register(Arch("qwen3", "qwen3", "Qwen3ForCausalLM", _qwen3_config,
              layer={**LLAMA_LAYER, **QK_NORMS}))


# -- gemma2, gemma3 (text) ---------------------------------------------------------------------
GEMMA_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _query_pre_attn_scalar(config: dict[str, Any], big_layers: int) -> int:
    """llama.cpp scales queries by 1/sqrt(head size), except in the 27B models (told apart
    by their layer count) where it is 1/sqrt(hidden / heads), as Google's gemma_pytorch.
    An int, as Hugging Face's Gemma configs have it (transformers' strict config checks the
    type when mlx_lm.load opens the folder)."""
    if config["num_hidden_layers"] == big_layers:
        return int(config["hidden_size"] // config["num_attention_heads"])
    return int(config["head_dim"])


def _gemma2_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    full_rotary(m, config["head_dim"])
    no_rope_scaling(m, "gemma2")
    config["tie_word_embeddings"] = True  # llama.cpp's gemma2 reads token_embd for output
    config["attn_logit_softcapping"] = float(m.get("attn_logit_softcapping", 50.0))
    config["final_logit_softcapping"] = float(m.get("final_logit_softcapping", 30.0))
    config["query_pre_attn_scalar"] = _query_pre_attn_scalar(config, 46)
    # Informational for mlx-lm, whose gemma2 attends to the whole context in every layer
    # (llama.cpp: every other layer within this window).
    config["sliding_window"] = int(m.get("attention.sliding_window", 4096))
    return config


def _gemma3_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    layers = config["num_hidden_layers"]
    full_rotary(m, config["head_dim"])
    cap = m.get("final_logit_softcapping")
    if cap is not None and float(cap) != 0.0:
        raise ImportFailed(f"{m.path}: final logit softcapping is not supported for gemma3 "
                           "(mlx-lm's gemma3_text has none)")
    config["query_pre_attn_scalar"] = _query_pre_attn_scalar(config, 62)
    window = int(m.get("attention.sliding_window", 0) or 0)
    if window > 0:
        sliding = _layer_is_sliding(m, layers, 6)
        # mlx-lm's gemma3_text: layer i is global when i % n == n - 1, for one n.
        n = next((n for n in range(1, layers + 1)
                  if sliding == [i % n < n - 1 for i in range(layers)]), None)
        if n is None or n > layers:
            raise ImportFailed(f"{m.path}: sliding-window layers {sliding} are not a pattern "
                               "mlx-lm's gemma3_text can express (every n-th layer global)")
    else:
        n, window = 1, config["max_position_embeddings"]  # no sliding layers
    config["sliding_window"] = window
    config["sliding_window_pattern"] = n
    config["layer_types"] = ["full_attention" if i % n == n - 1 else "sliding_attention"
                             for i in range(layers)]
    # Sliding layers: their own base (10000 when the file does not say), never scaled.
    config["rope_local_base_freq"] = float(m.get("rope.freq_base_swa", 10000.0))
    scaling = rope_scaling(m)
    if scaling is not None and scaling["rope_type"] != "linear":
        raise ImportFailed(f"{m.path}: RoPE scaling {scaling['rope_type']!r} is not supported "
                           "for gemma3")
    config["rope_scaling"] = scaling
    return config


register(Arch("gemma2", "gemma2", "Gemma2ForCausalLM", _gemma2_config, layer=GEMMA_LAYER,
              top={k: v for k, v in LLAMA_TOP.items() if k != "output"},
              reverse=(minus_one_norms,)))
register(Arch("gemma3", "gemma3_text", "Gemma3ForCausalLM", _gemma3_config,
              layer={**GEMMA_LAYER, **QK_NORMS}, reverse=(minus_one_norms,)))


# -- phi3 (Phi-3, Phi-3.5, Phi-4) ---------------------------------------------------------------
PHI3_FACTORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})


def _phi3_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if config["head_dim"] != head_dim:
        raise ImportFailed(f"{m.path}: head size {config['head_dim']} differs from hidden / "
                           f"heads ({head_dim}), which mlx-lm's phi3 assumes")
    if not m.has("blk.0.attn_qkv.weight"):
        raise ImportFailed(f"{m.path}: phi3 without a fused attn_qkv is not supported")
    config["partial_rotary_factor"] = _rope_dims(m, head_dim) / head_dim
    context = config["max_position_embeddings"]
    original = int(m.get("rope.scaling.original_context_length", context))
    config["original_max_position_embeddings"] = original
    if m.has("rope_factors_long.weight"):
        # LongRoPE (Phi-3-*-128k, Phi-3.5): per-frequency factors folded into two tensors.
        # llama.cpp picks the long ones for contexts past the original one and the short
        # ones below; mlx-lm's SuScaledRoPE always applies the long ones.
        kind = m.get("rope.scaling.type", "longrope")
        if kind not in ("longrope", "su"):
            raise ImportFailed(f"{m.path}: RoPE scaling {kind!r} with LongRoPE factors is "
                               "not supported for phi3")
        attn = float(m.get("rope.scaling.attn_factor", 1.0))
        scale = context / original
        mlx_attn = (np.sqrt(1 + np.log(scale) / np.log(original)) if scale > 1.0 else 1.0)
        if abs(attn - mlx_attn) > 1e-4 * mlx_attn:
            raise ImportFailed(f"{m.path}: rope.scaling.attn_factor {attn:g} differs from "
                               f"the LongRoPE scale mlx-lm's phi3 derives ({mlx_attn:g})")
        config["rope_scaling"] = {
            "type": "longrope", "rope_type": "longrope",
            "long_factor": [float(x) for x in m.tensor("rope_factors_long.weight").ravel()],
            "short_factor": [float(x) for x in m.tensor("rope_factors_short.weight").ravel()]
            if m.has("rope_factors_short.weight") else 1.0,
        }
    else:
        # mlx-lm's phi3 takes a rope_scaling only with LongRoPE factors.
        no_rope_scaling(m, "phi3")
    return config


register(Arch(
    "phi3", "phi3", "Phi3ForCausalLM", _phi3_config,
    # The Hugging Face checkpoint's fused projections, kept fused by the converter and by
    # mlx-lm: attn_qkv is [q; k; v] rows, ffn_up is [gate; up] rows.
    layer={"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj",
           "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
           "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
    skip=PHI3_FACTORS,
))


# -- starcoder2 (StarCoder2; LayerNorm and biases everywhere, GELU MLP) -----------------------
def _starcoder2_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    full_rotary(m, config["head_dim"])
    derived_head_dim(m, config, "starcoder2")
    no_rope_scaling(m, "starcoder2")
    config["norm_epsilon"] = float(m.need("attention.layer_norm_epsilon"))
    return config


register(Arch(
    "starcoder2", "starcoder2", "Starcoder2ForCausalLM", _starcoder2_config,
    layer={"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
           "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
           "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
))


# -- olmo2 (OLMo 2; OLMo 3 is olmo2 with sliding-window layers) -------------------------------
def _olmo2_config(m: Meta) -> dict[str, Any]:
    return _hidden_over_heads_config(m, "olmo2")  # llama.cpp's olmo2 also takes hidden / heads


def _olmo3_config(m: Meta) -> dict[str, Any]:
    config = _olmo2_config(m)
    layers = config["num_hidden_layers"]
    config["architectures"] = ["Olmo3ForCausalLM"]
    config["sliding_window"] = int(m.need("attention.sliding_window"))
    sliding = _layer_is_sliding(m, layers, 4)
    if all(sliding) or not any(sliding):
        # mlx-lm's olmo3 builds one mask of each kind from a layer of that kind.
        raise ImportFailed(f"{m.path}: olmo3 needs both sliding-window and full-attention "
                           "layers")
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    base_swa = float(m.get("rope.freq_base_swa", config["rope_theta"]))
    if base_swa != config["rope_theta"]:
        raise ImportFailed(f"{m.path}: a separate RoPE base for sliding-window layers "
                           f"({base_swa:g}) is not supported for olmo3")
    return config


OLMO2_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    # Over the whole projection (heads x head size), not per head as in qwen3.
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
}
register(Arch("olmo2", "olmo2", "Olmo2ForCausalLM", _olmo2_config, layer=OLMO2_LAYER))
OLMO3 = Arch("olmo2", "olmo3", "Olmo3ForCausalLM", _olmo3_config, layer=OLMO2_LAYER)
register_variant("olmo2", lambda m: OLMO3 if int(m.get("attention.sliding_window", 0) or 0) > 0
                 else None)


# -- granite (IBM Granite 3.x dense: llama with four multipliers) -----------------------------
def _granite_config(m: Meta) -> dict[str, Any]:
    config = _llama_config(m)
    derived_head_dim(m, config, "granite")
    # llama.cpp's granite: a missing scale means none (attention: 1/sqrt(head size)).
    config["logits_scaling"] = float(m.need("logit_scale"))
    config["embedding_multiplier"] = float(m.get("embedding_scale", 0.0) or 1.0)
    config["residual_multiplier"] = float(m.get("residual_scale", 0.0) or 1.0)
    config["attention_multiplier"] = float(m.get("attention.scale", 0.0)
                                           or config["head_dim"] ** -0.5)
    return config


register(Arch("granite", "granite", "GraniteForCausalLM", _granite_config,
              reverse=(unpermute_qk,)))


# -- command-r (Cohere Command R, Aya 23; parallel attention and MLP, LayerNorm) --------------
def _command_r_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    full_rotary(m, config["head_dim"])
    derived_head_dim(m, config, "cohere")
    no_rope_scaling(m, "cohere")
    if m.has("blk.0.attn_q.bias"):
        raise ImportFailed(f"{m.path}: attention biases are not supported for command-r")
    config["tie_word_embeddings"] = True  # llama.cpp's command-r reads token_embd for output
    config["layer_norm_eps"] = float(m.need("attention.layer_norm_epsilon"))
    config["layer_norm_bias"] = False
    # llama.cpp: no scaling when the key is absent.
    config["logit_scale"] = float(m.get("logit_scale", 0.0) or 1.0)
    # Command R+'s per-head norms (llama.cpp reads them in files of 64 layers or more).
    config["use_qk_norm"] = m.has("blk.0.attn_q_norm.weight")
    return config


register(Arch(
    "command-r", "cohere", "CohereForCausalLM", _command_r_config,
    # Cohere's RoPE is the interleaved kind: llama.cpp's converter leaves Q/K rows as they
    # are and mlx-lm's cohere runs traditional RoPE, so nothing to undo.
    layer={"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
           "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", **QK_NORMS,
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"},
    top={k: v for k, v in LLAMA_TOP.items() if k != "output"},
))

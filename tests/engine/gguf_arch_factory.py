"""Tiny random-weight GGUF files per dense architecture, laid out as llama.cpp's converter
writes them (conversion/<family>.py and convert_hf_to_gguf.py), for logit comparisons.

Contract: `write_arch(path, spec, vocab, seed)` makes random weights in the Hugging Face layout
(the names and shapes of mlx-lm's model file for the family), then does what the converter does
to them: its metadata keys, its tensor names, llama's Q/K row permutation, Gemma's norms stored
with 1 added, Llama 3's RoPE scaling folded into `rope_freqs`, Phi-3's LongRoPE factors as
tensors. Every tensor is written as F32 (llama.cpp's own quantizer makes the other types from
it). Returns an `ArchFile` with the file's path and the Hugging Face-layout weights.

The models are decisive, so that greedy tokens do not flip on rounding noise: the embedding
dominates the residual stream and the output head is a scaled, permuted copy of the embedding
(tied heads are the embedding itself), so each position's top logit stands several units above
the rest while every layer still moves every logit (logits' std is a few units).
`ARCH_SPECS` holds one spec per architecture the dense importer maps; `ROPE_SPECS` variants
(llama's RoPE scaling types and Mistral Nemo's head size, OLMo 3's sliding windows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.engine.gguf_factory import Vocab, permute_qk


@dataclass(frozen=True)
class ArchSpec:
    """One tiny model. Hidden and FFN sizes are multiples of 256 so that K-quants apply."""

    arch: str  # general.architecture
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # written as key_length (as the converter does when set)
    ffn: int = 512
    tie: bool = False
    qkv_bias: bool = False
    context: int = 512
    rope_base: float = 10000.0
    # The Hugging Face rope_scaling the converter encodes: {"rope_type": "llama3" | "linear" |
    # "yarn" | "longrope", ...}.
    rope: dict[str, Any] | None = field(default=None, hash=False)
    sliding_window: int | None = None
    rope_base_swa: float | None = None  # gemma3: the sliding layers' base
    attn_softcap: float | None = None  # gemma2
    final_softcap: float | None = None  # gemma2
    rope_dims: int | None = None  # phi3: partial rotary dimensions
    # granite: {"embedding_scale", "residual_scale", "attention.scale", "logit_scale"}
    scales: dict[str, float] | None = field(default=None, hash=False)
    swa_pattern: list[bool] | None = field(default=None, hash=False)  # olmo2 (OLMo 3)
    embed_std: float = 1.0
    head_gain: float = 0.2  # untied head = head_gain * permuted embedding rows
    proj_std: float = 0.05

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def gemma(self) -> bool:
        return self.arch in ("gemma2", "gemma3")

    @property
    def permuted(self) -> bool:
        """Whether the converter permutes Q/K rows (LlamaModel and its subclasses)."""
        return self.arch in ("llama", "granite")


# One spec per architecture, shaped like a real release of it where a shape matters.
ARCH_SPECS: dict[str, ArchSpec] = {
    # Llama 3.1/3.2: untied, rope_freqs from rope_type llama3 (an original context of 64 so
    # that the ramp acts within the test's 56 positions), RoPE base 500000.
    "llama": ArchSpec("llama", rope_base=500000.0, rope={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # Qwen2.5: Q/K/V biases, no permutation, RoPE base 1e6.
    "qwen2": ArchSpec("qwen2", qkv_bias=True, rope_base=1e6),
    # Qwen3-0.6B: tied, head size 128 != hidden / heads, q/k norms.
    "qwen3": ArchSpec("qwen3", head_dim=128, tie=True, rope_base=1e6, embed_std=0.5,
                      proj_std=0.03),
    # Gemma 2: tied, +1 norms, post-norms, softcaps, window 4096.
    "gemma2": ArchSpec("gemma2", head_dim=64, tie=True, sliding_window=4096,
                       attn_softcap=2.0, final_softcap=30.0, embed_std=0.125),
    # Gemma 3: six layers so that the default pattern (every 6th global) has a global layer; a
    # window of 8 so that it acts; a local base and a global linear factor as in 4B+.
    "gemma3": ArchSpec("gemma3", layers=6, head_dim=64, tie=True, sliding_window=8,
                       rope_base=1e6, rope_base_swa=10000.0,
                       rope={"rope_type": "linear", "factor": 8.0}, embed_std=0.2),
    # Phi-3-mini-128k: fused qkv and gate_up, LongRoPE factors (original context 256 < the
    # reference's 512, so llama.cpp uses the long factors, as mlx-lm always does).
    "phi3": ArchSpec("phi3", heads=4, kv_heads=4, context=1024, rope={
        "rope_type": "longrope", "original_max_position_embeddings": 256}),
    # StarCoder2: LayerNorm with biases, biases on every projection, GELU MLP, tied.
    "starcoder2": ArchSpec("starcoder2", tie=True, qkv_bias=True, rope_base=1e5,
                           embed_std=0.5, proj_std=0.03),
    # OLMo 2: no pre-norms, post-norms, q/k norms over the whole projection, untied.
    "olmo2": ArchSpec("olmo2", rope_base=5e5, embed_std=2.0),
    # Granite 3.x: llama with the four multipliers of granite-3.0-2b.
    "granite": ArchSpec("granite", scales={"embedding_scale": 12.0, "residual_scale": 0.22,
                                           "attention.scale": 0.015625, "logit_scale": 8.0},
                        embed_std=0.1, head_gain=1.6),
    # Command R: tied, parallel attention and MLP, LayerNorm without bias, logit_scale 0.0625
    # (so a larger embedding for logits of a few units). llama.cpp reads per-head q/k norms
    # (Command R+) only with 64 layers or more: not in a tiny file.
    "command-r": ArchSpec("command-r", tie=True, rope_base=8e6, embed_std=3.0,
                          scales={"logit_scale": 0.0625}),
}

ROPE_SPECS: dict[str, ArchSpec] = {
    "llama-linear": replace(ARCH_SPECS["llama"], rope={"rope_type": "linear", "factor": 4.0}),
    "llama-yarn": replace(ARCH_SPECS["llama"], rope={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    # Mistral Nemo's shape: head size 128 with hidden / heads = 64.
    "llama-nemo": replace(ARCH_SPECS["llama"], head_dim=128, rope=None, rope_base=1e6),
    # OLMo 3: olmo2 with sliding-window layers (every 4th full), window 8 so that it acts.
    "olmo3": replace(ARCH_SPECS["olmo2"], layers=4, sliding_window=8,
                     swa_pattern=[True, True, True, False]),
}


@dataclass
class ArchFile:
    path: Path
    spec: ArchSpec
    hf: dict[str, np.ndarray]  # the random weights, Hugging Face layout and names
    rope_freqs: np.ndarray | None = None  # what the converter folded Llama 3 scaling into


def llama3_factors(rope: dict[str, Any], base: float, dim: int) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for rope_type llama3 (LlamaModel.generate_extra_tensors),
    in numpy float32 as the converter computes it in torch float32."""
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# -- Hugging Face layout ------------------------------------------------------------------
def _layer_shapes(s: ArchSpec) -> dict[str, tuple[int, ...]]:
    """mlx-lm's parameter names under model.layers.N for the family, with shapes."""
    q, kv = s.heads * s.hd, s.kv_heads * s.hd
    if s.arch == "phi3":
        return {
            "input_layernorm.weight": (s.hidden,),
            "self_attn.qkv_proj.weight": (q + 2 * kv, s.hidden),
            "self_attn.o_proj.weight": (s.hidden, q),
            "post_attention_layernorm.weight": (s.hidden,),
            "mlp.gate_up_proj.weight": (2 * s.ffn, s.hidden),
            "mlp.down_proj.weight": (s.hidden, s.ffn),
        }
    if s.arch == "starcoder2":
        return {
            "input_layernorm.weight": (s.hidden,), "input_layernorm.bias": (s.hidden,),
            "self_attn.q_proj.weight": (q, s.hidden), "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.weight": (kv, s.hidden), "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.weight": (kv, s.hidden), "self_attn.v_proj.bias": (kv,),
            "self_attn.o_proj.weight": (s.hidden, q), "self_attn.o_proj.bias": (s.hidden,),
            "post_attention_layernorm.weight": (s.hidden,),
            "post_attention_layernorm.bias": (s.hidden,),
            "mlp.c_fc.weight": (s.ffn, s.hidden), "mlp.c_fc.bias": (s.ffn,),
            "mlp.c_proj.weight": (s.hidden, s.ffn), "mlp.c_proj.bias": (s.hidden,),
        }
    if s.arch == "command-r":
        return {
            "input_layernorm.weight": (s.hidden,),
            "self_attn.q_proj.weight": (q, s.hidden), "self_attn.k_proj.weight": (kv, s.hidden),
            "self_attn.v_proj.weight": (kv, s.hidden), "self_attn.o_proj.weight": (s.hidden, q),
            "mlp.gate_proj.weight": (s.ffn, s.hidden), "mlp.up_proj.weight": (s.ffn, s.hidden),
            "mlp.down_proj.weight": (s.hidden, s.ffn),
        }
    if s.arch == "olmo2":
        return {
            "self_attn.q_proj.weight": (q, s.hidden), "self_attn.k_proj.weight": (kv, s.hidden),
            "self_attn.v_proj.weight": (kv, s.hidden), "self_attn.o_proj.weight": (s.hidden, q),
            "self_attn.q_norm.weight": (q,), "self_attn.k_norm.weight": (kv,),
            "post_attention_layernorm.weight": (s.hidden,),
            "mlp.gate_proj.weight": (s.ffn, s.hidden), "mlp.up_proj.weight": (s.ffn, s.hidden),
            "mlp.down_proj.weight": (s.hidden, s.ffn),
            "post_feedforward_layernorm.weight": (s.hidden,),
        }
    out: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (s.hidden,),
        "self_attn.q_proj.weight": (q, s.hidden),
        "self_attn.k_proj.weight": (kv, s.hidden),
        "self_attn.v_proj.weight": (kv, s.hidden),
        "self_attn.o_proj.weight": (s.hidden, q),
        "post_attention_layernorm.weight": (s.hidden,),
        "mlp.gate_proj.weight": (s.ffn, s.hidden),
        "mlp.up_proj.weight": (s.ffn, s.hidden),
        "mlp.down_proj.weight": (s.hidden, s.ffn),
    }
    if s.qkv_bias:
        out.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
                    "self_attn.v_proj.bias": (kv,)})
    if s.gemma:
        out.update({"pre_feedforward_layernorm.weight": (s.hidden,),
                    "post_feedforward_layernorm.weight": (s.hidden,)})
    if s.arch in ("qwen3", "gemma3"):
        out.update({"self_attn.q_norm.weight": (s.hd,), "self_attn.k_norm.weight": (s.hd,)})
    return out


def hf_weights(s: ArchSpec, n_vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights in the Hugging Face layout, decisive as the module docstring says."""
    w: dict[str, np.ndarray] = {}

    def norm(shape: tuple[int, ...]) -> np.ndarray:
        # Gemma's RMSNorm computes x * (1 + w): its checkpoints hold w around 0.
        base = 0.0 if s.gemma else 1.0
        return (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    embed = (s.embed_std * rng.standard_normal((n_vocab, s.hidden))).astype(np.float32)
    w["model.embed_tokens.weight"] = embed
    w["model.norm.weight"] = norm((s.hidden,))
    if s.arch == "starcoder2":
        w["model.norm.bias"] = (0.1 * rng.standard_normal(s.hidden)).astype(np.float32)
    if not s.tie:
        perm = rng.permutation(n_vocab)
        w["lm_head.weight"] = (s.head_gain / s.embed_std * embed[perm]).astype(np.float32)
    for i in range(s.layers):
        for name, shape in _layer_shapes(s).items():
            full = f"model.layers.{i}.{name}"
            if name.endswith("norm.weight"):
                w[full] = norm(shape)
            elif name.endswith(".bias"):
                w[full] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
            else:
                w[full] = (s.proj_std * rng.standard_normal(shape)).astype(np.float32)
    return w


# -- the converter ------------------------------------------------------------------------
_LAYER_NAMES = {  # Hugging Face name under model.layers.N -> GGUF name under blk.N
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # phi3: the fused [gate; up] rows
    "mlp.down_proj": "ffn_down",
    "mlp.c_fc": "ffn_up",  # starcoder2
    "mlp.c_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
              "lm_head": "output"}


def gguf_name(s: ArchSpec, hf: str) -> str:
    """tensor_mapping.py's name for a Hugging Face tensor of the family."""
    module, suffix = hf.rsplit(".", 1)
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{suffix}"
    _, _, n, part = module.split(".", 3)
    names = dict(_LAYER_NAMES)
    if s.gemma or s.arch == "olmo2":
        # Gemma's four norms: pre-attention, post-attention, pre-FFN, post-FFN.
        names.update({"post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    else:
        names["post_attention_layernorm"] = "ffn_norm"
    return f"blk.{n}.{names[part]}.{suffix}"


def converted(s: ArchSpec, hf: str, data: np.ndarray) -> np.ndarray:
    """The values modify_tensors writes for a Hugging Face tensor."""
    if s.permuted and (".q_proj." in hf or ".k_proj." in hf):
        return permute_qk(data, s.heads if ".q_proj." in hf else s.kv_heads)
    if s.gemma and hf.endswith("norm.weight"):
        return data + np.float32(1.0)
    return data


def _metadata(w: gguf.GGUFWriter, s: ArchSpec, n_vocab: int) -> None:
    """set_gguf_parameters of the family's converter class."""
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    if s.arch in ("starcoder2", "command-r"):
        w.add_layer_norm_eps(1e-5)  # norm_epsilon, layer_norm_eps: LayerNorms
    else:
        w.add_layer_norm_rms_eps(1e-6 if s.gemma else 1e-5)
    if s.head_dim is not None:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    rope = s.rope or {}
    kind = rope.get("rope_type")
    if s.arch == "gemma2":
        # Gemma2Model writes no RoPE keys at all (llama.cpp's default base, 10000, applies).
        assert s.attn_softcap is not None and s.final_softcap is not None
        w.add_attn_logit_softcapping(s.attn_softcap)
        w.add_final_logit_softcapping(s.final_softcap)
        w.add_sliding_window(s.sliding_window or 4096)
        return
    if s.arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings",
                                                 s.context))
        w.add_rope_dimension_count(s.rope_dims or s.hd)
        w.add_rope_freq_base(s.rope_base)
        w.add_sliding_window(s.sliding_window or 0)
        if kind == "longrope":
            scale = s.context / rope["original_max_position_embeddings"]
            w.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"]))
                if scale > 1.0 else 1.0)
        return
    # TextModel.set_gguf_parameters (llama, qwen2, qwen3, gemma3).
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_freq_base(s.rope_base)
    if s.rope_base_swa is not None:
        w.add_rope_freq_base_swa(s.rope_base_swa)
    if s.permuted:  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(s.hd)
    for key, value in (s.scales or {}).items():  # GraniteModel
        w.add_float32(f"{s.arch}.{key}", value)
    if s.arch == "command-r":  # CommandR2Model
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    if s.arch == "olmo2" and s.sliding_window:
        w.add_sliding_window(s.sliding_window)
        w.add_sliding_window_pattern(s.swa_pattern or [])
    if s.arch == "gemma3" and s.sliding_window:
        w.add_sliding_window(s.sliding_window)


def write_arch(path: Path, spec: ArchSpec, vocab: Vocab, seed: int = 0) -> ArchFile:
    """Write `spec` as llama.cpp's converter would, every tensor F32. See the module doc."""
    rng = np.random.default_rng(seed)
    n_vocab = len(vocab.tokens)
    hf = hf_weights(spec, n_vocab, rng)
    w = gguf.GGUFWriter(str(path), spec.arch)
    # Not the family's name: llama.cpp keys vocabulary quirks on general.name ("phi3" wants a
    # "</s>" token this vocabulary lacks).
    w.add_name("tiny random model")
    _metadata(w, spec, n_vocab)
    vocab.write(w)
    out = ArchFile(path=Path(path), spec=spec, hf=hf)
    rope = spec.rope or {}
    if spec.arch == "llama" and rope.get("rope_type") == "llama3":
        out.rope_freqs = llama3_factors(rope, spec.rope_base, spec.hd)
        w.add_tensor("rope_freqs.weight", out.rope_freqs)
    if spec.arch == "phi3" and rope.get("rope_type") == "longrope":
        half = (spec.rope_dims or spec.hd) // 2
        # Phi-3's factors: 1 at high frequencies rising towards the low ones.
        long = np.linspace(1.0, 8.0, half, dtype=np.float32) ** 1.5
        short = np.linspace(1.0, 1.5, half, dtype=np.float32)
        w.add_tensor("rope_factors_long.weight", long)
        w.add_tensor("rope_factors_short.weight", short)
    for name, data in hf.items():
        w.add_tensor(gguf_name(spec, name), np.ascontiguousarray(converted(spec, name, data)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

"""Tiny random-weight mixture-of-experts GGUF files, laid out as llama.cpp's converter writes
them (`gguf.GGUFWriter`): mixtral (general.architecture "llama" with an expert count, Q/K rows
permuted), qwen2moe (shared expert and its gate), qwen3moe (q/k norms, a head size apart from
hidden / heads) and gpt-oss (expert and router biases, attention sinks, alternating
sliding-window layers, YaRN RoPE).

Contract: `write_moe_gguf(path, family, vocab, seed)` writes an all-F32 file (what
`convert_hf_to_gguf.py --outtype f32` writes; llama.cpp's quantizer makes the other types from
it) and returns its `MoESpec`. The weights are scaled so that the random model is decisive
and still sensitive to every layer: embeddings of unit size, every projection of unit gain
(std 1/sqrt(fan-in)), routers at gain 3, and an output projection whose random part has gain
3 (next-token logits of std about 4) plus, for each token, a pull towards one fixed successor
token (`_decisive_head`): greedy choices then lead by about 3 std (at least 0.8 std on these
files) while the other logits move with every layer, so greedy agreement is far from the
near ties where two correct implementations may part, and not a constant token either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from tests.engine.gguf_factory import Vocab, permute_qk

FAMILIES = ("mixtral", "qwen2moe", "qwen3moe", "gpt-oss")
OUT_GAIN = 3.0  # random part of the output projection: logits of std ~3
SUCCESSOR_GAIN = 2.0  # see _decisive_head


@dataclass(frozen=True)
class MoESpec:
    """The tiny model's shape; rows and columns are multiples of 256 (K-quant super-blocks)."""

    family: str
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    experts: int = 4
    used: int = 2
    ffn: int = 512  # feed_forward_length (the dense intermediate size)
    ffn_exp: int = 256  # each expert's intermediate size
    ffn_shexp: int = 512  # qwen2moe's shared expert
    context: int = 4096
    rope_base: float = 10000.0
    qkv_bias: bool = False
    sliding_window: int = 0  # gpt-oss: window of the sliding layers (0: none)
    yarn: tuple[float, int] | None = None  # gpt-oss: (factor, original context)

    @property
    def gguf_arch(self) -> str:
        return "llama" if self.family == "mixtral" else self.family


SPECS = {
    # Mixtral's intermediate_size is each expert's (it has no dense FFN).
    "mixtral": MoESpec("mixtral", ffn=256, rope_base=1e6),
    "qwen2moe": MoESpec("qwen2moe", qkv_bias=True, rope_base=1e6),
    # head size 128 with hidden 256 and 4 heads: read from attention.key_length.
    "qwen3moe": MoESpec("qwen3moe", head_dim=128, rope_base=1e6),
    # gpt-oss's own RoPE (base 150000, YaRN factor 32 over 4096) and a short window, so
    # that a 24-token prompt crosses it.
    "gpt-oss": MoESpec("gpt-oss", qkv_bias=True, rope_base=150000.0, context=8192,
                       sliding_window=8, yarn=(32.0, 4096)),
}


def _tensors(spec: MoESpec, n_vocab: int, rng: np.random.Generator
             ) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array in Hugging Face layout) for every tensor, in the converter's order."""
    h, hd, fam = spec.hidden, spec.head_dim, spec.family
    q_rows, kv_rows = spec.heads * hd, spec.kv_heads * hd

    def proj(out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        return (gain / np.sqrt(inp) * rng.standard_normal((out, inp))).astype(np.float32)

    def experts(out: int, inp: int, gain: float = 1.0) -> np.ndarray:
        return (gain / np.sqrt(inp)
                * rng.standard_normal((spec.experts, out, inp))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def small(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    # gpt-oss's SwiGLU multiplies by (up + 1), which about doubles what an expert adds.
    down_gain = 0.5 if fam == "gpt-oss" else 1.0
    out = [("token_embd.weight", rng.standard_normal((n_vocab, h)).astype(np.float32))]
    for i in range(spec.layers):
        b = f"blk.{i}."
        q, k = proj(q_rows, h), proj(kv_rows, h)
        if fam == "mixtral":  # llama's converter permutes Q/K rows for interleaved RoPE
            q, k = permute_qk(q, spec.heads), permute_qk(k, spec.kv_heads)
        out += [(b + "attn_norm.weight", norm(h)), (b + "attn_q.weight", q),
                (b + "attn_k.weight", k), (b + "attn_v.weight", proj(kv_rows, h)),
                (b + "attn_output.weight", proj(h, q_rows))]
        if spec.qkv_bias:
            out += [(b + "attn_q.bias", small(q_rows)), (b + "attn_k.bias", small(kv_rows)),
                    (b + "attn_v.bias", small(kv_rows))]
        if fam == "qwen3moe":
            out += [(b + "attn_q_norm.weight", norm(hd)), (b + "attn_k_norm.weight", norm(hd))]
        if fam == "gpt-oss":
            out += [(b + "attn_output.bias", small(h)),
                    (b + "attn_sinks.weight", small(spec.heads, scale=1.0)),
                    (b + "post_attention_norm.weight", norm(h))]
        else:
            out.append((b + "ffn_norm.weight", norm(h)))
        out += [(b + "ffn_gate_inp.weight", proj(spec.experts, h, gain=3.0)),
                (b + "ffn_gate_exps.weight", experts(spec.ffn_exp, h)),
                (b + "ffn_up_exps.weight", experts(spec.ffn_exp, h)),
                (b + "ffn_down_exps.weight", experts(h, spec.ffn_exp, gain=down_gain))]
        if fam == "gpt-oss":
            out += [(b + "ffn_gate_inp.bias", small(spec.experts, scale=1.0)),
                    (b + "ffn_gate_exps.bias", small(spec.experts, spec.ffn_exp)),
                    (b + "ffn_up_exps.bias", small(spec.experts, spec.ffn_exp)),
                    (b + "ffn_down_exps.bias", small(spec.experts, h))]
        if fam == "qwen2moe":
            # HF's shared_expert_gate is a (1, hidden) Linear; the converter keeps it 2-D.
            out += [(b + "ffn_gate_inp_shexp.weight", proj(1, h)),
                    (b + "ffn_gate_shexp.weight", proj(spec.ffn_shexp, h)),
                    (b + "ffn_up_shexp.weight", proj(spec.ffn_shexp, h)),
                    (b + "ffn_down_shexp.weight", proj(h, spec.ffn_shexp))]
    out.append(("output_norm.weight", norm(h)))
    out.append(("output.weight", _decisive_head(out[0][1], h, rng)))
    return out


def _decisive_head(embd: np.ndarray, h: int, rng: np.random.Generator) -> np.ndarray:
    """The output projection: random rows of gain OUT_GAIN, plus for each token i the unit
    direction of its embedding (times SUCCESSOR_GAIN) added to the row of a successor token
    (a fixed random permutation), so that the token after i leads by several units where the
    final hidden state still points along i's embedding. The other logits are random
    projections of the hidden state and move with every layer."""
    n_vocab = embd.shape[0]
    head = OUT_GAIN / np.sqrt(h) * rng.standard_normal((n_vocab, h))
    unit = embd / np.linalg.norm(embd, axis=1, keepdims=True)
    head[rng.permutation(n_vocab)] += SUCCESSOR_GAIN * unit
    return head.astype(np.float32)


def write_moe_gguf(path: Path, family: str, vocab: Vocab, seed: int = 0,
                   extra: Mapping[str, str | int | float] | None = None) -> MoESpec:
    """Write `family`'s tiny F32 model to `path`; see the module docstring. `extra` adds
    metadata fields the converter would not write (full key: value), for refusal tests."""
    spec = SPECS[family]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), spec.gguf_arch)
    w.add_name(f"tiny-{family}")
    w.add_block_count(spec.layers)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_freq_base(spec.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(spec.experts)
    w.add_expert_used_count(spec.used)
    if family in ("qwen3moe", "gpt-oss"):
        # Their Hugging Face configs carry head_dim, which the converter writes.
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    if family == "mixtral":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(len(vocab.tokens))
        w.add_rope_dimension_count(spec.head_dim)
    else:
        w.add_expert_feed_forward_length(spec.ffn_exp)
    if family == "qwen2moe":
        w.add_expert_shared_feed_forward_length(spec.ffn_shexp)
    if family == "gpt-oss":
        w.add_sliding_window(spec.sliding_window)
    if spec.yarn is not None:
        factor, original = spec.yarn
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_yarn_beta_fast(32.0)
        w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab.write(w)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, array in _tensors(spec, len(vocab.tokens), rng):
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return spec

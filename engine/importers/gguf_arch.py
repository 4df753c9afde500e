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


# -- the dense families ------------------------------------------------------------------
def _llama_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    config["attention_bias"] = m.has("blk.0.attn_q.bias")
    if m.get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear",
                                  "factor": float(m.get("rope.scaling.factor", 1.0))}
    return config


def _qwen2_config(m: Meta) -> dict[str, Any]:
    return _llama_config(m)


register(Arch("llama", "llama", "LlamaForCausalLM", _llama_config, reverse=(unpermute_qk,)))
register(Arch("mistral", "llama", "MistralForCausalLM", _llama_config,
              reverse=(unpermute_qk,)))
register(Arch("qwen2", "qwen2", "Qwen2ForCausalLM", _qwen2_config))

"""GGUF mixture-of-experts architectures, registered into engine.importers.gguf_arch.

Contract: importing this module registers the MoE families, each onto mlx-lm's own model file
under the parameter names that file's Model has after sanitize (so sanitize has nothing to
do): mixtral (which llama.cpp writes as "llama" with `llama.expert_count`, picked by a
variant of "llama"), qwen2moe (with its shared expert and that expert's sigmoid gate),
qwen3moe (q/k norms, no shared expert) and gpt-oss (expert and router biases, attention
sinks, alternating sliding-window layers, YaRN RoPE). Stacked expert tensors (`*_exps`,
(experts, out, in) once the GGUF order is reversed) map onto mlx-lm's switch layers as they
are. gpt-oss's attention sinks are a bare parameter (`self_attn.sinks`), mapped from the full
GGUF part `attn_sinks.weight`. A file whose settings mlx-lm's model file would silently
ignore (RoPE scaling where that file builds plain RoPE, a head size other than the one it
derives, a partial rotary dimension) is refused with one line naming the setting, rather
than imported to compute something else.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.errors import ImportFailed
from engine.importers.gguf_arch import (
    LLAMA_LAYER,
    Arch,
    Meta,
    common_config,
    derived_head_dim,
    full_rotary,
    no_rope_scaling,
    register,
    register_variant,
    rope_scaling,
    unpermute_qk,
)

# The attention and norm parts every family here shares with llama (its dense FFN parts do
# not apply: each MoE family names its expert block below).
_ATTENTION = {k: v for k, v in LLAMA_LAYER.items() if not k.startswith("ffn_")}


def _experts(block: str, router: str = "gate", switch: str = "switch_mlp") -> dict[str, str]:
    """The router and the stacked experts of an MoE block at `block` (mlx-lm's names)."""
    return {
        "ffn_gate_inp": f"{block}.{router}",
        "ffn_gate_exps": f"{block}.{switch}.gate_proj",
        "ffn_up_exps": f"{block}.{switch}.up_proj",
        "ffn_down_exps": f"{block}.{switch}.down_proj",
    }


# -- checks on what mlx-lm's model files can express -----------------------------------
def _moe_counts(m: Meta) -> tuple[int, int]:
    experts, used = int(m.need("expert_count")), int(m.need("expert_used_count"))
    if experts <= 0 or not 0 < used <= experts:
        raise ImportFailed(f"{m.path}: {experts} experts with {used} used per token")
    return experts, used


def _untied(m: Meta, model_type: str) -> None:
    """mlx-lm's qwen2_moe and gpt_oss always have their own lm_head."""
    if not m.has("output.weight"):
        raise ImportFailed(f"{m.path}: missing tensor output.weight ({model_type} has no tied "
                           "output)")


# -- mixtral: "llama" with experts --------------------------------------------------------
def _mixtral_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    experts, used = _moe_counts(m)
    no_rope_scaling(m, "mixtral")
    full_rotary(m, config["head_dim"])
    derived_head_dim(m, config, "mixtral")
    config["num_local_experts"], config["num_experts_per_tok"] = experts, used
    config["intermediate_size"] = int(m.get("expert_feed_forward_length",
                                            config["intermediate_size"]))
    return config


MIXTRAL = Arch(
    "llama", "mixtral", "MixtralForCausalLM", _mixtral_config,
    layer={**_ATTENTION, "ffn_norm": "post_attention_layernorm",
           **_experts("block_sparse_moe")},
    reverse=(unpermute_qk,),
)
# Not registered under its own name: no GGUF names "mixtral"; llama.cpp's converter writes
# Mixtral as general.architecture "llama" with an expert count.
register_variant("llama", lambda m: MIXTRAL if int(m.get("expert_count", 0) or 0) > 0 else None)


# -- qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B) ----------------------------------------------
def _qwen2moe_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    experts, used = _moe_counts(m)
    no_rope_scaling(m, "qwen2_moe")
    full_rotary(m, config["head_dim"])
    derived_head_dim(m, config, "qwen2_moe")
    _untied(m, "qwen2_moe")
    config["num_experts"], config["num_experts_per_tok"] = experts, used
    # llama.cpp's fallbacks when the keys are absent: n_ff / n_expert_used and n_ff.
    config["moe_intermediate_size"] = int(m.get("expert_feed_forward_length",
                                                config["intermediate_size"] // used))
    config["shared_expert_intermediate_size"] = int(
        m.get("expert_shared_feed_forward_length", config["intermediate_size"]))
    return config


def _shared_gate_2d(config: dict[str, Any], name: str, data: np.ndarray) -> np.ndarray:
    """The shared expert's gate is a (1, hidden) Linear; llama.cpp's quantizer writes it as
    a 1-D tensor (the converter's F32 file keeps it 2-D)."""
    if name.endswith(".mlp.shared_expert_gate.weight") and data.ndim == 1:
        return data.reshape(1, -1)
    return data


register(Arch(
    "qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM", _qwen2moe_config,
    layer={**_ATTENTION, "ffn_norm": "post_attention_layernorm", **_experts("mlp"),
           "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
           "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
           "ffn_up_shexp": "mlp.shared_expert.up_proj",
           "ffn_down_shexp": "mlp.shared_expert.down_proj"},
    reverse=(_shared_gate_2d,),
))


# -- qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B) --------------------------------------------
def _qwen3moe_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    experts, used = _moe_counts(m)
    no_rope_scaling(m, "qwen3_moe")
    full_rotary(m, config["head_dim"])
    config["num_experts"], config["num_experts_per_tok"] = experts, used
    config["moe_intermediate_size"] = int(m.get("expert_feed_forward_length",
                                                config["intermediate_size"]))
    # llama.cpp's qwen3moe: every layer is an MoE layer and the chosen experts' weights are
    # renormalized to sum to one.
    config["decoder_sparse_step"], config["mlp_only_layers"] = 1, []
    config["norm_topk_prob"] = True
    return config


register(Arch(
    "qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", _qwen3moe_config,
    layer={**_ATTENTION, "ffn_norm": "post_attention_layernorm",
           "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
           **_experts("mlp")},
))


# -- gpt-oss -------------------------------------------------------------------------------
def _layer_types(m: Meta, layers: int) -> list[str]:
    """llama.cpp's sliding-window pattern: an array of per-layer flags, or every n-th layer
    full (n from attention.sliding_window_pattern, 2 by default) and the others sliding."""
    pattern = m.get("attention.sliding_window_pattern", 2)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) < layers:
            raise ImportFailed(f"{m.path}: sliding-window pattern has {len(pattern)} entries "
                               f"for {layers} layers")
        swa = [bool(x) for x in pattern[:layers]]
    else:
        n = int(pattern)
        swa = [n == 0 or i % n < n - 1 for i in range(layers)]
    types = ["sliding_attention" if s else "full_attention" for s in swa]
    if len(set(types)) < 2:
        # mlx-lm's gpt_oss builds one mask of each kind from a layer of that kind.
        raise ImportFailed(f"{m.path}: gpt-oss needs both sliding-window and full-attention "
                           f"layers (the file has only {types[0]})")
    return types


def _yarn(m: Meta) -> dict[str, Any] | None:
    """gpt-oss's RoPE: plain or YaRN, as llama.cpp reads it (its own beta and extrapolation
    defaults whatever yarn_* keys the file has: gguf_arch.rope_scaling), which are the
    defaults of mlx-lm's YarnRoPE too."""
    scaling = rope_scaling(m)
    if scaling is not None and scaling["rope_type"] != "yarn":
        raise ImportFailed(f"{m.path}: RoPE scaling {scaling['rope_type']!r} is not supported "
                           "for gpt-oss")
    return scaling


def _gpt_oss_config(m: Meta) -> dict[str, Any]:
    config = common_config(m)
    experts, used = _moe_counts(m)
    full_rotary(m, config["head_dim"])
    _untied(m, "gpt_oss")
    base_swa = m.get("rope.freq_base_swa")
    if base_swa is not None and float(base_swa) != config["rope_theta"]:
        raise ImportFailed(f"{m.path}: a separate RoPE base for sliding-window layers "
                           f"({base_swa}) is not supported")
    config["num_local_experts"], config["num_experts_per_tok"] = experts, used
    config["intermediate_size"] = int(m.get("expert_feed_forward_length",
                                            config["intermediate_size"]))
    config["sliding_window"] = int(m.need("attention.sliding_window"))
    config["layer_types"] = _layer_types(m, config["num_hidden_layers"])
    config["rope_scaling"] = _yarn(m)
    return config


register(Arch(
    "gpt-oss", "gpt_oss", "GptOssForCausalLM", _gpt_oss_config,
    layer={**_ATTENTION, "post_attention_norm": "post_attention_layernorm",
           # A bare parameter of the attention module, not a module's .weight.
           "attn_sinks.weight": "self_attn.sinks",
           **_experts("mlp", router="router", switch="experts")},
))

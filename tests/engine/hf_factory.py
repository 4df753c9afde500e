"""Tiny random-weight Hugging Face llama folders, written the way the Hub stores them.

Contract: `write_hf_llama(folder, ...)` writes config.json, float safetensors with Hugging Face
tensor names (one file, or shards plus model.safetensors.index.json), tokenizer.json (a small
byte-level BPE trained here with `tokenizers`) and tokenizer_config.json with a ChatML template,
and returns the config. Weights are random: good for shapes and formats, not for what it says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 320  # config vocab: the trained tokenizer stays below it
HIDDEN = 64
INTERMEDIATE = 128
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Small models are good for tests of shapes and file formats.",
    "1234567890 and some punctuation: !?.,;:'\"()[]{}",
]


def build_tokenizer_json() -> str:
    """A byte-level BPE tokenizer with ChatML specials, serialized as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    assert tok.get_vocab_size(with_added_tokens=True) <= VOCAB
    return str(tok.to_str())


def llama_config(layers: int = 2, tie: bool = False) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def llama_weights(config: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Random float weights under Hugging Face names (mlx arrays, bfloat16)."""
    import mlx.core as mx

    mx.random.seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> Any:
        return (mx.random.normal(shape) * 0.05).astype(mx.bfloat16)

    w: dict[str, Any] = {"model.embed_tokens.weight": rand(v, h),
                         "model.norm.weight": mx.ones((h,), dtype=mx.bfloat16)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({
            p + "self_attn.q_proj.weight": rand(h, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": mx.ones((h,), dtype=mx.bfloat16),
            p + "post_attention_layernorm.weight": mx.ones((h,), dtype=mx.bfloat16),
        })
    # Old checkpoints carry RoPE buffers; mlx-lm's sanitize drops them.
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((head_dim // 2,))
    if not config.get("tie_word_embeddings"):
        w["lm_head.weight"] = rand(v, h)
    mx.eval(w)
    return w


def write_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").write_text(build_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "model_max_length": 512,
        "chat_template": CHATML,
    }, indent=2))


def write_hf_llama(folder: Path, layers: int = 2, tie: bool = False, shards: int = 1,
                   seed: int = 0) -> dict[str, Any]:
    """Write a tiny float llama folder in Hugging Face layout; return its config."""
    import mlx.core as mx

    folder.mkdir(parents=True, exist_ok=True)
    config = llama_config(layers, tie)
    weights = llama_weights(config, seed)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 2}))
    if shards == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    else:
        keys = sorted(weights)
        weight_map: dict[str, str] = {}
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: weights[k] for k in keys[s::shards]}
            mx.save_safetensors(str(folder / name), part, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, name))
        total = sum(a.nbytes for a in weights.values())
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    write_tokenizer(folder)
    return config


# -- every family ----------------------------------------------------------------------------
# Tiny configs with the keys each family's real config.json carries (values shrunk): Llama 3.1
# (rope_scaling llama3), Mistral Nemo (head_dim apart from hidden/heads), Mixtral, Qwen2.5,
# Qwen1.5-MoE, Qwen3, Qwen3-30B-A3B, Gemma 2 2B (saved in float32), Gemma 3 1B, Phi-3.5-mini
# (longrope), gpt-oss-20b (MXFP4 experts, sinks, alternating layer_types), DeepSeek-V2-Lite.
# Every width that a Linear reads is a multiple of 64, so the default recipe (group 64)
# quantizes them all; sliding windows are shorter than the tests' token sequences.
WINDOW = 8


def _base(arch: str, model_type: str, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [arch], "model_type": model_type, "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512, "hidden_act": "silu", "attention_dropout": 0.0,
        "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 2,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "transformers_version": "4.55.0",
    }
    config.update(extra)
    return config


def _config_llama() -> dict[str, Any]:
    return _base("LlamaForCausalLM", "llama", attention_bias=False, mlp_bias=False,
                 pretraining_tp=1, rope_theta=500000.0, eos_token_id=[1, 2],
                 rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 64, "rope_type": "llama3"})


def _config_mistral() -> dict[str, Any]:
    return _base("MistralForCausalLM", "mistral", head_dim=32, rope_theta=1000000.0,
                 sliding_window=None)


def _config_mixtral() -> dict[str, Any]:
    return _base("MixtralForCausalLM", "mixtral", num_local_experts=4, num_experts_per_tok=2,
                 output_router_logits=False, router_aux_loss_coef=0.02, rope_theta=1000000.0,
                 sliding_window=None)


def _config_qwen2() -> dict[str, Any]:
    return _base("Qwen2ForCausalLM", "qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0,
                 max_window_layers=21, sliding_window=32768, use_sliding_window=False,
                 tie_word_embeddings=True)


def _config_qwen2_moe() -> dict[str, Any]:
    return _base("Qwen2MoeForCausalLM", "qwen2_moe", rms_norm_eps=1e-6, rope_theta=1000000.0,
                 max_window_layers=21, sliding_window=32768, use_sliding_window=False,
                 decoder_sparse_step=1, moe_intermediate_size=64,
                 shared_expert_intermediate_size=128, num_experts_per_tok=2, num_experts=4,
                 norm_topk_prob=False, output_router_logits=False, router_aux_loss_coef=0.001,
                 mlp_only_layers=[])


def _config_qwen3() -> dict[str, Any]:
    return _base("Qwen3ForCausalLM", "qwen3", attention_bias=False, head_dim=32,
                 rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000,
                 max_window_layers=28, sliding_window=None, use_sliding_window=False,
                 tie_word_embeddings=True)


def _config_qwen3_moe() -> dict[str, Any]:
    return _base("Qwen3MoeForCausalLM", "qwen3_moe", attention_bias=False, head_dim=32,
                 rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000.0,
                 decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=64,
                 norm_topk_prob=True, num_experts=4, num_experts_per_tok=2,
                 max_window_layers=48, output_router_logits=False,
                 router_aux_loss_coef=0.001, sliding_window=None, use_sliding_window=False)


def _gemma(arch: str, model_type: str, **extra: Any) -> dict[str, Any]:
    config = _base(arch, model_type, head_dim=32, hidden_activation="gelu_pytorch_tanh",
                   hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, attention_bias=False,
                   query_pre_attn_scalar=32, sliding_window=WINDOW, pad_token_id=0,
                   bos_token_id=2, eos_token_id=[1, 2], cache_implementation="hybrid",
                   tie_word_embeddings=True)
    del config["hidden_act"]
    config.update(extra)
    return config


def _config_gemma2() -> dict[str, Any]:
    return _gemma("Gemma2ForCausalLM", "gemma2", attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, rope_theta=10000.0, torch_dtype="float32",
                  hidden_act="gelu_pytorch_tanh")


def _config_gemma3_text() -> dict[str, Any]:
    return _gemma("Gemma3ForCausalLM", "gemma3_text", attn_logit_softcapping=None,
                  final_logit_softcapping=None, rope_local_base_freq=10000,
                  rope_scaling=None, rope_theta=1000000, sliding_window_pattern=2)


def _config_phi3() -> dict[str, Any]:
    half = HIDDEN // 4 // 2  # head_dim / 2 factors
    return _base("Phi3ForCausalLM", "phi3", num_key_value_heads=4, attention_bias=False,
                 embd_pdrop=0.0, resid_pdrop=0.0, original_max_position_embeddings=64,
                 max_position_embeddings=512, pad_token_id=3, rope_theta=10000.0,
                 sliding_window=262144, eos_token_id=2,
                 rope_scaling={"type": "longrope",
                               "long_factor": [1.0 + i / 2 for i in range(half)],
                               "short_factor": [1.0 + i / 8 for i in range(half)]},
                 auto_map={"AutoConfig": "configuration_phi3.Phi3Config",
                           "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"})


def _config_gpt_oss() -> dict[str, Any]:
    return _base("GptOssForCausalLM", "gpt_oss", attention_bias=True, experts_per_token=2,
                 num_experts_per_tok=2, num_local_experts=4, head_dim=16, intermediate_size=64,
                 initial_context_length=16, layer_types=["sliding_attention", "full_attention"],
                 output_router_logits=False, pad_token_id=3, rope_theta=150000,
                 rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                               "original_max_position_embeddings": 16, "rope_type": "yarn",
                               "truncate": False},
                 router_aux_loss_coef=0.9, sliding_window=WINDOW, swiglu_limit=7.0,
                 quantization_config={"modules_to_not_convert": [
                     "model.layers.*.self_attn", "model.layers.*.mlp.router",
                     "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"})


def _config_deepseek_v2() -> dict[str, Any]:
    return _base("DeepseekV2ForCausalLM", "deepseek_v2", attention_bias=False,
                 aux_loss_alpha=0.001, first_k_dense_replace=1, kv_lora_rank=64,
                 moe_intermediate_size=64, moe_layer_freq=1, n_group=1, n_routed_experts=4,
                 n_shared_experts=1, norm_topk_prob=False, num_key_value_heads=4,
                 num_experts_per_tok=2, pretraining_tp=1, q_lora_rank=None,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, rms_norm_eps=1e-6,
                 rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                               "mscale_all_dim": 0.707,
                               "original_max_position_embeddings": 16, "type": "yarn"},
                 max_position_embeddings=640,
                 rope_theta=10000, routed_scaling_factor=1.0, scoring_func="softmax",
                 seq_aux=True, topk_group=1, topk_method="greedy")


CONFIGS = {
    "llama": _config_llama, "mistral": _config_mistral, "mixtral": _config_mixtral,
    "qwen2": _config_qwen2, "qwen2_moe": _config_qwen2_moe, "qwen3": _config_qwen3,
    "qwen3_moe": _config_qwen3_moe, "gemma2": _config_gemma2,
    "gemma3_text": _config_gemma3_text, "phi3": _config_phi3, "gpt_oss": _config_gpt_oss,
    "deepseek_v2": _config_deepseek_v2,
}
FAMILIES = tuple(CONFIGS)
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2")


def family_config(family: str) -> dict[str, Any]:
    """The tiny config.json of one family (see CONFIGS)."""
    return CONFIGS[family]()


class _Weights:
    """Random tensors under Hugging Face names: Linear weights scaled by 1/sqrt(fan-in) so the
    logits spread; norms random too, so that a tensor loaded into the wrong slot shows."""

    def __init__(self, config: dict[str, Any], seed: int) -> None:
        import mlx.core as mx

        self.mx = mx
        self.dtype = getattr(mx, config.get("torch_dtype", "bfloat16"))
        self.key = mx.random.key(seed)
        self.w: dict[str, Any] = {}
        # Gemma's RMSNorm scales by 1 + weight: its checkpoints store weights around 0.
        self.norm_center = 0.0 if config["model_type"].startswith("gemma") else 1.0

    def _normal(self, shape: tuple[int, ...]) -> Any:
        self.key, sub = self.mx.random.split(self.key)
        return self.mx.random.normal(shape, key=sub)

    def linear(self, name: str, out: int, inp: int, bias: bool = False) -> None:
        self.w[f"{name}.weight"] = (self._normal((out, inp)) * inp ** -0.5).astype(self.dtype)
        if bias:
            self.w[f"{name}.bias"] = (self._normal((out,)) * 0.1).astype(self.dtype)

    def norm(self, name: str, dim: int) -> None:
        self.w[f"{name}.weight"] = (self.norm_center + 0.1 * self._normal((dim,))).astype(
            self.dtype)

    def tensor(self, name: str, shape: tuple[int, ...], scale: float) -> None:
        self.w[name] = (self._normal(shape) * scale).astype(self.dtype)

    def attention(self, p: str, c: dict[str, Any], bias: bool = False, o_bias: bool = False,
                  qk_norm: bool = False) -> None:
        h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or h // heads
        self.linear(p + "self_attn.q_proj", heads * hd, h, bias)
        self.linear(p + "self_attn.k_proj", kv * hd, h, bias)
        self.linear(p + "self_attn.v_proj", kv * hd, h, bias)
        self.linear(p + "self_attn.o_proj", h, heads * hd, o_bias)
        if qk_norm:
            self.norm(p + "self_attn.q_norm", hd)
            self.norm(p + "self_attn.k_norm", hd)

    def mlp(self, p: str, hidden: int, inter: int) -> None:
        self.linear(p + "gate_proj", inter, hidden)
        self.linear(p + "up_proj", inter, hidden)
        self.linear(p + "down_proj", hidden, inter)

    def experts(self, p: str, n: int, hidden: int, inter: int,
                names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
        gate, up, down = names
        for e in range(n):
            self.linear(f"{p}{e}.{gate}", inter, hidden)
            self.linear(f"{p}{e}.{up}", inter, hidden)
            self.linear(f"{p}{e}.{down}", hidden, inter)

    def top(self, c: dict[str, Any]) -> None:
        h = c["hidden_size"]
        self.tensor("model.embed_tokens.weight", (c["vocab_size"], h), 1.0)
        self.norm("model.norm", h)
        if not c.get("tie_word_embeddings"):
            self.linear("lm_head", c["vocab_size"], h)

    def mxfp4(self, name: str, shape: tuple[int, int, int]) -> None:
        """gpt-oss's MXFP4 experts as the checkpoint stores them: `{name}_blocks`, uint8
        (experts, out, in/32, 16), two FP4 codes a byte; `{name}_scales`, uint8 E8M0 exponents
        (experts, out, in/32), around 2^-4 here."""
        mx = self.mx
        e, out, inp = shape
        self.key, a, b = mx.random.split(self.key, 3)
        self.w[f"{name}_blocks"] = mx.random.randint(0, 256, (e, out, inp // 32, 16),
                                                     key=a).astype(mx.uint8)
        self.w[f"{name}_scales"] = mx.random.randint(121, 125, (e, out, inp // 32),
                                                     key=b).astype(mx.uint8)


def family_weights(family: str, config: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Random weights of one family under the names its transformers class saves."""
    import mlx.core as mx

    c = config
    w = _Weights(c, seed)
    h, inter = c["hidden_size"], c["intermediate_size"]
    w.top(c)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.norm(p + "input_layernorm", h)
        w.norm(p + "post_attention_layernorm", h)
        if family in ("llama", "mistral"):
            w.attention(p, c)
            w.mlp(p + "mlp.", h, inter)
        elif family == "qwen2":
            w.attention(p, c, bias=True)
            w.mlp(p + "mlp.", h, inter)
        elif family == "qwen3":
            w.attention(p, c, qk_norm=True)
            w.mlp(p + "mlp.", h, inter)
        elif family == "mixtral":
            w.attention(p, c)
            n = c["num_local_experts"]
            w.linear(p + "block_sparse_moe.gate", n, h)
            w.experts(p + "block_sparse_moe.experts.", n, h, inter, ("w1", "w3", "w2"))
        elif family == "qwen2_moe":
            w.attention(p, c, bias=True)
            w.linear(p + "mlp.gate", c["num_experts"], h)
            w.experts(p + "mlp.experts.", c["num_experts"], h, c["moe_intermediate_size"])
            w.mlp(p + "mlp.shared_expert.", h, c["shared_expert_intermediate_size"])
            w.linear(p + "mlp.shared_expert_gate", 1, h)
        elif family == "qwen3_moe":
            w.attention(p, c, qk_norm=True)
            w.linear(p + "mlp.gate", c["num_experts"], h)
            w.experts(p + "mlp.experts.", c["num_experts"], h, c["moe_intermediate_size"])
        elif family in ("gemma2", "gemma3_text"):
            w.attention(p, c, qk_norm=family == "gemma3_text")
            w.mlp(p + "mlp.", h, inter)
            w.norm(p + "pre_feedforward_layernorm", h)
            w.norm(p + "post_feedforward_layernorm", h)
        elif family == "phi3":
            hd = h // c["num_attention_heads"]
            w.linear(p + "self_attn.qkv_proj",
                     (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd, h)
            w.linear(p + "self_attn.o_proj", h, c["num_attention_heads"] * hd)
            w.linear(p + "mlp.gate_up_proj", 2 * inter, h)
            w.linear(p + "mlp.down_proj", h, inter)
        elif family == "gpt_oss":
            w.attention(p, c, bias=True, o_bias=True)
            w.tensor(p + "self_attn.sinks", (c["num_attention_heads"],), 1.0)
            n = c["num_local_experts"]
            w.linear(p + "mlp.router", n, h, bias=True)
            # gate and up interleaved by row, as the checkpoint has them
            w.mxfp4(p + "mlp.experts.gate_up_proj", (n, 2 * inter, h))
            w.tensor(p + "mlp.experts.gate_up_proj_bias", (n, 2 * inter), 0.1)
            w.mxfp4(p + "mlp.experts.down_proj", (n, h, inter))
            w.tensor(p + "mlp.experts.down_proj_bias", (n, h), 0.1)
        elif family == "deepseek_v2":
            heads, rope = c["num_attention_heads"], c["qk_rope_head_dim"]
            nope, vd, rank = c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
            w.linear(p + "self_attn.q_proj", heads * (nope + rope), h)
            w.linear(p + "self_attn.kv_a_proj_with_mqa", rank + rope, h)
            w.norm(p + "self_attn.kv_a_layernorm", rank)
            w.linear(p + "self_attn.kv_b_proj", heads * (nope + vd), rank)
            w.linear(p + "self_attn.o_proj", h, heads * vd)
            if i < c["first_k_dense_replace"]:
                w.mlp(p + "mlp.", h, inter)
            else:
                n, moe = c["n_routed_experts"], c["moe_intermediate_size"]
                w.linear(p + "mlp.gate", n, h)  # DeepSeek's MoEGate: a bare weight
                w.experts(p + "mlp.experts.", n, h, moe)
                w.mlp(p + "mlp.shared_experts.", h, moe * c["n_shared_experts"])
        else:
            raise ValueError(f"unknown family {family!r}")
    mx.eval(w.w)
    return w.w


def write_hf_family(folder: Path, family: str, seed: int = 0) -> dict[str, Any]:
    """Write a tiny random-weight Hugging Face folder of `family` (one of FAMILIES): its
    config.json, model.safetensors under transformers' names, the small BPE tokenizer."""
    import mlx.core as mx

    folder.mkdir(parents=True, exist_ok=True)
    config = family_config(family)
    weights = family_weights(family, config, seed)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    eos = config["eos_token_id"]
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": eos}))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    write_tokenizer(folder)
    return config


def write_hf_gpt_oss_bf16(folder: Path, mxfp4_folder: Path) -> dict[str, Any]:
    """The BF16 gpt-oss checkpoint of an MXFP4 one (as unsloth/gpt-oss-20b-BF16 is): the experts
    dequantized (exactly: FP4 codes times powers of two) and saved as transformers' GptOssExperts
    holds them, input-major: gate_up_proj (experts, hidden, 2 x inter, gate and up interleaved
    on the last axis), down_proj (experts, inter, hidden); no quantization_config."""
    import shutil

    import mlx.core as mx

    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((mxfp4_folder / "config.json").read_text())
    del config["quantization_config"]
    source: Any = mx.load(str(mxfp4_folder / "model.safetensors"))
    weights: dict[str, Any] = {}
    for k, v in source.items():
        if k.endswith("_scales"):
            continue
        if k.endswith("_blocks"):
            codes = v.view(mx.uint32).reshape(*v.shape[:2], -1)
            w = mx.dequantize(codes, source[k[: -len("_blocks")] + "_scales"], group_size=32,
                              bits=4, mode="mxfp4")
            weights[k[: -len("_blocks")]] = mx.swapaxes(w, -1, -2).astype(mx.bfloat16)
        else:
            weights[k] = v
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for f in mxfp4_folder.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, folder / f.name)
    return config

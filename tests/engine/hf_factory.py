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

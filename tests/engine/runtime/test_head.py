"""The output head on the last row (engine.runtime.model.last_row_head) across architectures.

Small random-weight models (shapes only; what the starter says is tests/engine/runtime/
test_generate.py's): an untied `lm_head`, the same quantized, and a tied head with gemma2's
soft-capping after it. Inside the block the logits are the full pass's last row.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.runtime.model import build_model, head_on_last_row, last_row_head

BASE: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                        "num_attention_heads": 4, "num_key_value_heads": 2,
                        "rms_norm_eps": 1e-6, "vocab_size": 300, "rope_theta": 10000.0}
CONFIGS = {
    "qwen2 untied": {**BASE, "model_type": "qwen2", "tie_word_embeddings": False},
    "qwen2 untied, 4-bit head": {**BASE, "model_type": "qwen2", "tie_word_embeddings": False,
                                 "quantize": True},
    "gemma2 tied, soft-capped": {**BASE, "model_type": "gemma2", "head_dim": 16,
                                 "query_pre_attn_scalar": 16.0},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_last_row_s_logits_equal_the_full_pass_s(name: str) -> None:
    config = dict(CONFIGS[name])
    quantize = config.pop("quantize", False)
    mx.random.seed(0)
    model = build_model(config)
    if quantize:
        nn.quantize(model, group_size=64, bits=4, class_predicate=lambda p, m: p == "lm_head")
    mx.eval(model.parameters())
    assert head_on_last_row(model, config)
    x = mx.array([[5, 17, 42, 7, 99, 3, 250, 11]])
    full = model(x)
    with last_row_head():
        last = model(x)
    assert full.shape == (1, 8, 300) and last.shape == (1, 1, 300)
    assert mx.allclose(last[0, 0], full[0, -1], atol=1e-5).item()
    assert not mx.allclose(last[0, 0], full[0, 0], atol=1e-3).item()  # not the first row
    assert model(x).shape == full.shape  # outside the block, every row again

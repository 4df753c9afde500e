"""The SwiGLU MLX's CPU backend computes faster (engine.runtime.model.fast_swiglu, cpu_swiglu).

mlx-lm's own swiglu is the reference: the same values within a few float32 ulps over the
whole range a gate takes, its limits included, and a random-weight llama (shapes only) gives
the same logits with either.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from engine.runtime import model as rm


def test_fast_swiglu_equals_mlx_lm_s_over_the_gate_s_range() -> None:
    """From -150 to 150 (past float32's exp range both ways) and random gates: within 4e-7
    relative where silu is not ~0, and 0 where mlx-lm's is 0."""
    reference = __import__("mlx_lm.models.activations", fromlist=["swiglu"]).swiglu
    gate = mx.concatenate([mx.linspace(-150, 150, 30001), mx.random.normal((4096,)) * 6])
    x = mx.random.normal(gate.shape) + 2
    want, got = reference(gate, x), rm.fast_swiglu(gate, x)
    big = mx.abs(want) > 1e-30
    rel = mx.where(big, mx.abs(got - want) / mx.where(big, mx.abs(want), 1), 0)
    assert float(rel.max()) < 4e-7
    assert bool(mx.all(mx.where(big, True, mx.abs(got) <= 1e-30)).item())
    assert not bool(mx.any(mx.isnan(got)).item())


def test_cpu_swiglu_gives_a_llama_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU backend the llama module's swiglu becomes fast_swiglu, and a small
    random-weight llama's logits over 40 tokens stay within 1e-5."""
    llama = rm.model_module("llama")
    # mlx-lm's own to start with (a model loaded earlier in this process replaced it), put
    # back after the test
    reference = __import__("mlx_lm.models.activations", fromlist=["swiglu"]).swiglu
    monkeypatch.setattr(llama, "swiglu", reference)
    config: dict[str, Any] = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "vocab_size": 300, "rope_theta": 10000.0}
    model = rm.build_model(config)
    mx.eval(model.parameters())
    ids = mx.array([[(7 * i) % 300 for i in range(40)]])
    before = model(ids)
    assert rm.cpu_swiglu(config) == (mx.default_device() == mx.cpu)
    if mx.default_device() == mx.cpu:
        assert llama.swiglu is rm.fast_swiglu
    after = model(ids)
    assert float(mx.abs(after - before).max()) < 1e-5

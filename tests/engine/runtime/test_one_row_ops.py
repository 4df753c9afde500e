"""A decode step's RoPE and norms through compiled graphs (engine.runtime.model.
compile_one_row_ops).

The plain modules (mlx.nn's and mlx-lm's own classes) are the reference: every RoPE class it
changes gives bit-equal rotations for one position at offsets from 0 to past a million, the
norms (RMS and layer) bit-equal rows, prompt-shaped and batched calls take the plain path,
and the real starter model decodes the same logits, bit for bit, with and without it. The KV
layer still sees the starter's RoPE as MLX's plain one (its sparse remapping depends on
that).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.kv import remap
from engine.runtime import model as rm

OFFSETS = (0, 1, 127, 4000, 8191, 70000, 1 << 20)


def _rope_modules() -> dict[str, Any]:
    utils = __import__("mlx_lm.models.rope_utils", fromlist=["Llama3RoPE"])
    return {
        "nn.RoPE": nn.RoPE(64, traditional=False, base=100000.0),
        "nn.RoPE traditional, scaled": nn.RoPE(32, traditional=True, base=10000.0, scale=0.5),
        "nn.RoPE partial": nn.RoPE(32, traditional=False, base=10000.0),
        "Llama3RoPE": utils.Llama3RoPE(
            64, max_position_embeddings=131072, traditional=False, base=500000.0,
            scaling_config={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}),
        "YarnRoPE": utils.YarnRoPE(64, max_position_embeddings=32768, base=10000.0,
                                   scaling_factor=4.0, original_max_position_embeddings=8192),
        "SuScaledRoPE": utils.SuScaledRoPE(
            64, base=10000.0, max_position_embeddings=131072,
            original_max_position_embeddings=4096, short_factor=[1.0] * 32,
            long_factor=[1.5] * 32),
    }


class _Holder(nn.Module):
    def __init__(self, **mods: Any) -> None:
        super().__init__()
        for k, v in mods.items():
            setattr(self, k, v)


@pytest.mark.parametrize("name", list(_rope_modules()))
def test_a_compiled_rotation_equals_the_plain_one_bit_for_bit(name: str) -> None:
    rope = _rope_modules()[name]
    plain = type(rope)
    holder = _Holder(rope=rope)
    assert rm.compile_one_row_ops(holder) == 1
    assert type(rope) is not plain and isinstance(rope, plain)
    assert type(rope).plain_class is plain  # type: ignore[attr-defined]
    mx.random.seed(1)
    for heads in (9, 3):
        x = mx.random.normal((1, heads, 1, 64))
        for off in OFFSETS:
            got = rope(x, offset=off)
            want = plain.__call__(rope, x, offset=off)
            assert np.array_equal(np.array(got), np.array(want)), (name, heads, off)
    assert "_one_row" in rope.__dict__  # the compiled path ran
    # A prompt chunk (several positions) and a batch's per-row offsets: the plain path.
    x = mx.random.normal((1, 3, 5, 64))
    assert np.array_equal(np.array(rope(x, offset=40)), np.array(plain.__call__(rope, x, 40)))
    xb = mx.random.normal((2, 3, 1, 64))
    offs = mx.array([3, 900])
    assert np.array_equal(np.array(rope(xb, offset=offs)),
                          np.array(plain.__call__(rope, xb, offs)))


def test_ropes_that_differ_never_share_angles() -> None:
    """Two llama3 scalings and two bases of the same dims, called at the same position in
    turn: each rotates as its own plain class does."""
    utils = __import__("mlx_lm.models.rope_utils", fromlist=["Llama3RoPE"])

    def llama3(factor: float) -> Any:
        return utils.Llama3RoPE(
            64, max_position_embeddings=131072, traditional=False, base=500000.0,
            scaling_config={"factor": factor, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    mods = [llama3(8.0), llama3(32.0), nn.RoPE(64, base=10000.0), nn.RoPE(64, base=500000.0)]
    plain = [type(m) for m in mods]
    assert rm.compile_one_row_ops(_Holder(mods=mods)) == 4
    x = mx.random.normal((1, 4, 1, 64))
    for off in (9000, 9000, 120000):
        for m, cls in zip(mods, plain, strict=True):
            assert np.array_equal(np.array(m(x, offset=off)), np.array(cls.__call__(m, x, off)))


def test_dynamic_ntk_rope_is_left_alone() -> None:
    """It computes its base from the offset in Python: an array offset would not trace."""
    utils = __import__("mlx_lm.models.rope_utils", fromlist=["DynamicNTKScalingRoPE"])
    rope = utils.DynamicNTKScalingRoPE(64, 4096, False, 10000.0, 2.0)
    assert rm.compile_one_row_ops(_Holder(rope=rope)) == 0
    assert type(rope) is utils.DynamicNTKScalingRoPE


def test_a_compiled_norm_equals_the_plain_one_bit_for_bit() -> None:
    mx.random.seed(2)
    norm = nn.RMSNorm(576, eps=1e-5)
    norm.weight = mx.random.normal((576,))
    qk = nn.RMSNorm(64, eps=1e-6)
    qk.weight = mx.random.normal((64,))
    holder = _Holder(norm=norm, qk=qk)
    assert rm.compile_one_row_ops(holder) == 2
    for shape, mod in (((1, 1, 576), norm), ((1, 1, 8, 64), qk), ((1, 40, 576), norm)):
        x = mx.random.normal(shape) * 3
        got = mod(x)
        want = nn.RMSNorm.__call__(mod, x)
        assert np.array_equal(np.array(got), np.array(want)), shape
    # Applying it twice changes nothing more.
    assert rm.compile_one_row_ops(holder) == 2
    assert type(norm).__mro__[2] is nn.RMSNorm


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_a_compiled_layer_norm_equals_the_plain_one_bit_for_bit(affine: bool, bias: bool
                                                                ) -> None:
    mx.random.seed(3)
    norm = nn.LayerNorm(256, eps=1e-5, affine=affine, bias=bias)
    if affine:
        norm.weight = mx.random.normal((256,))
    if bias:
        norm.bias = mx.random.normal((256,))
    assert rm.compile_one_row_ops(_Holder(norm=norm)) == 1
    for shape in ((1, 1, 256), (2, 1, 256), (1, 33, 256)):
        x = mx.random.normal(shape) * 2 + 1
        assert np.array_equal(np.array(norm(x)), np.array(nn.LayerNorm.__call__(norm, x)))


def _plain(model: Any) -> list[tuple[Any, type]]:
    """Give every changed module its plain class back; the list to restore them."""
    changed = []
    for _, mod in model.named_modules():
        if isinstance(mod, (rm._OneRowRoPE, rm._OneRowRMSNorm, rm._OneRowLayerNorm)):
            changed.append((mod, type(mod)))
            mod.__class__ = type(mod).plain_class
    return changed


def _decode(lm: Any, steps: int) -> list[np.ndarray]:
    cache = rm.cache_module().make_prompt_cache(lm.model)
    ids = lm.tokenizer.encode("The capital of France is")
    logits = lm.model(mx.array([ids]), cache=cache)[:, -1, :]
    out = []
    for _ in range(steps):
        y = mx.argmax(logits, axis=-1)
        logits = lm.model(y[None], cache=cache)[:, -1, :]
        out.append(np.array(logits))
    return out


def test_the_starter_decodes_the_same_logits_with_and_without(starter_lm: Any) -> None:
    lm = starter_lm
    layers = len(lm.model.layers)
    # Loaded by LoadedModel: each layer's rope and two norms, and the final norm.
    assert sum(isinstance(m, rm._OneRowRoPE) for _, m in lm.model.named_modules()) == layers
    assert sum(isinstance(m, rm._OneRowRMSNorm)
               for _, m in lm.model.named_modules()) == 2 * layers + 1
    got = _decode(lm, 6)
    changed = _plain(lm.model)
    try:
        assert len(changed) == 3 * layers + 1
        want = _decode(lm, 6)
    finally:
        for mod, cls in changed:
            mod.__class__ = cls
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(a, b)
    # The KV layer still reads the starter's RoPE as MLX's plain one.
    assert remap.rope_fields(lm.model)["rope_base"] == 100000.0

"""Packed weights (engine.runtime.packed): the real starter model, loaded, has every
projection and its output head registered with its 4- and 8-bit codes; its decode steps read
them, and decode the same greedy tokens with logits within float rounding of the float32
weights' (the same model loaded with packing off); closing the registrations puts the
products back on sgemv; the bytes the codes add are counted."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine import matvec
from engine.platform import parameter_bytes
from engine.runtime import packed

STEPS = 24


def _decode(lm: Any, prompt: str) -> tuple[list[int], np.ndarray, int]:
    """Greedy tokens and their logits over STEPS decode steps after `prompt`, with mlx-lm's
    cache; and how many products read packed codes meanwhile."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm.model)
    ids = lm.tokenizer.encode(prompt)
    y = mx.argmax(lm.model(mx.array([ids]), cache=cache)[:, -1, :], axis=-1)
    before = matvec.packed()
    tokens, logits = [], []
    for _ in range(STEPS):
        out = lm.model(y[None], cache=cache)[:, -1, :]
        y = mx.argmax(out, axis=-1)
        logits.append(np.array(out[0]))
        tokens.append(int(y.item()))
    return tokens, np.stack(logits), matvec.packed() - before


@pytest.fixture(scope="module")
def plain(starter: dict[str, Any]) -> Any:
    """The starter loaded with packing off: its products read the float32 weights."""
    from engine.runtime.generate import LoadedModel

    was = packed.ENABLED
    packed.ENABLED = False
    try:
        return LoadedModel.load(starter["path"])
    finally:
        packed.ENABLED = was


def test_the_starter_decodes_from_its_codes_as_from_its_float32_weights(
        starter_lm: Any, plain: Any) -> None:
    if not packed.applies(starter_lm.profile.dtype):
        pytest.skip(f"no packed products here ({starter_lm.profile.name}, {matvec.status()})")
    layers = starter_lm.config["num_hidden_layers"]
    assert len(starter_lm.packed) == 7 * layers + 1  # q, k, v, o, gate, up, down; the head
    assert len(plain.packed) == 0
    from engine.platform import blas_status

    assert "weights' decode products from their codes" in blas_status()  # in bench reports
    prompt = "The history of the Roman Empire is long and"
    got, got_logits, served = _decode(starter_lm, prompt)
    want, want_logits, none = _decode(plain, prompt)
    assert served == STEPS * len(starter_lm.packed) and none == 0
    assert got == want
    err = np.abs(got_logits - want_logits).max() / np.abs(want_logits).max()
    assert 0 < err < 1e-5  # float rounding: the sums run in another order


def test_the_codes_are_counted_and_closing_puts_products_back_on_sgemv(
        starter: dict[str, Any], plain: Any) -> None:
    from engine.runtime.generate import LoadedModel

    lm = LoadedModel.load(starter["path"])
    if not packed.applies(lm.profile.dtype):
        pytest.skip("no packed products here")
    # 4-bit codes for 30 x 7 projections, 8-bit for the embedding, float32 scale and bias
    # per 32: about a fifth of the float32 weights
    assert 0.15 < lm.packed.nbytes / parameter_bytes(lm.model) < 0.25
    lm.packed.close()
    assert len(lm.packed) == 0 and lm.packed.nbytes == 0
    tokens, _, served = _decode(lm, "Paris is")
    assert served == 0
    assert tokens == _decode(plain, "Paris is")[0]


def test_a_collected_model_leaves_nothing_registered(starter: dict[str, Any]) -> None:
    import gc

    from engine.runtime.generate import LoadedModel

    before = matvec.registered()
    lm = LoadedModel.load(starter["path"], warm_up=False)
    if not packed.applies(lm.profile.dtype):
        pytest.skip("no packed products here")
    assert matvec.registered() == before + len(lm.packed) > before
    del lm
    gc.collect()
    assert matvec.registered() == before


def test_only_a_load_that_decodes_keeps_the_codes(starter: dict[str, Any]) -> None:
    """Imports, cluster ranks and the benchmarks' peers apply the profile without keeping
    the codes (nothing registered, nothing held beside the float32 weights)."""
    from pathlib import Path

    from engine.platform import compute_profile
    from engine.runtime.model import load_weights_into_model

    profile = compute_profile()
    if not packed.applies(profile.dtype):
        pytest.skip("no packed products here")
    kept, _ = load_weights_into_model(Path(starter["path"]), profile, keep_codes=True)
    plain_model, _ = load_weights_into_model(Path(starter["path"]), profile)
    assert sum(hasattr(m, packed.SOURCE_ATTR) for _, m in kept.named_modules()) == 211
    assert not any(hasattr(m, packed.SOURCE_ATTR) for _, m in plain_model.named_modules())
    assert len(packed.pack_weights(plain_model)) == 0

"""Long contexts that stay right: RoPE past the trained length (YaRN at load) on the real
starter model, and the needle prompt built from natural text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def _logits(model: Any, ids: list[int]) -> np.ndarray:
    import mlx.core as mx

    out = model(mx.array(ids)[None])[0]
    mx.eval(out)
    return np.array(out)


def test_extend_rope_only_past_the_trained_length() -> None:
    from engine.runtime.model import extend_rope

    base = {"model_type": "llama", "max_position_embeddings": 8192, "rope_theta": 1e5}
    for context in (None, 0, 4096, 8192):
        assert extend_rope(base, context) == base
    yarn = extend_rope(base, 32768)["rope_scaling"]
    assert (yarn["rope_type"], yarn["factor"], yarn["original_max_position_embeddings"]) == (
        "yarn", 4.0, 8192)
    assert "rope_scaling" not in base  # a copy, the caller's config untouched
    # A model that scales already keeps its own; an architecture outside the list is as is.
    own = {**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert extend_rope(own, 32768) == own
    assert extend_rope({**base, "model_type": "gemma3_text"}, 32768)["model_type"] == \
        "gemma3_text"
    assert "rope_scaling" not in extend_rope({**base, "model_type": "gemma3_text"}, 32768)


@pytest.fixture(scope="module")
def folder(starter: Any) -> Path:
    return Path(starter["path"])


def test_starter_inside_trained_length_is_unchanged(starter_lm: Any, folder: Path) -> None:
    from engine.runtime.model import load_weights_into_model

    model, config = load_weights_into_model(folder, starter_lm.profile, context=8192)
    assert "rope_scaling" not in config
    ids = starter_lm.tokenizer.encode(PROMPT)
    assert np.abs(_logits(model, ids) - _logits(starter_lm.model, ids)).max() == 0.0


def test_starter_past_trained_length_is_mlx_lm_yarn(starter_lm: Any, folder: Path) -> None:
    """Built at 32k, the starter rotates with YaRN (factor 4): logits equal mlx-lm's own
    model loaded with the same rope config (same weights, same profile) within 1e-4, and
    differ from the unscaled model's (the scaling is in effect)."""
    from mlx_lm.utils import load_model

    from engine.runtime.model import apply_profile, load_weights_into_model

    model, config = load_weights_into_model(folder, starter_lm.profile, context=32768)
    assert config["rope_scaling"]["factor"] == 4.0
    ref, _ = load_model(folder, model_config={"rope_scaling": config["rope_scaling"]})
    apply_profile(ref, starter_lm.profile)
    ids = starter_lm.tokenizer.encode(PROMPT)
    ours = _logits(model, ids)
    assert np.abs(ours - _logits(ref, ids)).max() < 1e-4
    assert np.abs(ours - _logits(starter_lm.model, ids)).max() > 1e-2

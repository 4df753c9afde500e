"""Will it fit: weights in the compute profile plus KV at the chosen context, counted layer by
layer, against this machine's memory; a model that does not fit is refused with the numbers
and the largest context that would fit.

Real parts: mlx-lm's own model files (tiny random models built from their ModelArgs through
engine.runtime.model.model_module) and caches, the starter model's GGUF, library folder and
load, a tiny Hugging Face folder, the real memory cap (STRATA_MAX_MEMORY_MB).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.errors import LoadFailed
from engine.platform import ComputeProfile
from engine.runtime import fit, packed
from engine.runtime.fit import KVLayer, WeightSizes, check_memory, estimate, kv_bytes, kv_layers

F32 = ComputeProfile("cpu-f32", dequantize=True, dtype="float32")
NATIVE = ComputeProfile("native", dequantize=False, dtype="float16")
STARTER_KV_PER_TOKEN_F32 = 2 * 30 * 3 * 64 * 4  # 2 (K, V) x layers x KV heads x head dim x 4 B

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5}
CONFIGS: dict[str, dict[str, Any]] = {
    # every third layer global, the others a 64-token window
    "gemma3_text": {**TINY, "model_type": "gemma3_text", "num_hidden_layers": 6,
                    "sliding_window": 64, "sliding_window_pattern": 3,
                    "query_pre_attn_scalar": 16},
    # alternating sliding (32 tokens) and full layers, MoE
    "gpt_oss": {**TINY, "model_type": "gpt_oss", "num_hidden_layers": 4, "intermediate_size": 64,
                "sliding_window": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
    # multi-head latent attention: mlx-lm caches the up-projected keys and values
    "deepseek_v2": {**TINY, "model_type": "deepseek_v2", "num_hidden_layers": 2,
                    "num_key_value_heads": 4, "moe_intermediate_size": 32, "kv_lora_rank": 32,
                    "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                    "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "topk_method": "greedy",
                    "n_group": 1, "topk_group": 1,
                    "rope_scaling": {"type": "yarn", "factor": 1.0, "mscale": 1,
                                     "mscale_all_dim": 0, "beta_fast": 32, "beta_slow": 1,
                                     "original_max_position_embeddings": 2048}},
    "llama": {**TINY, "model_type": "llama", "num_hidden_layers": 2},
}


def _cache_bytes_after(config: dict[str, Any], tokens: int) -> int:
    """Bytes mlx-lm's own caches hold after a `tokens - 1` token prompt and one decode step."""
    import mlx.core as mx

    from engine.runtime.model import cache_module, model_module

    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    cache = cache_module().make_prompt_cache(model)
    model(mx.array([[i % 100 for i in range(tokens - 1)]]), cache=cache)
    model(mx.array([[7]]), cache=cache)
    mx.eval([c.state for c in cache])
    return sum(int(c.nbytes) for c in cache)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_kv_counts_each_layer_type_as_mlx_lm_caches_hold_it(family: str) -> None:
    """512 tokens, past every window: full layers hold all of them, sliding ones their window."""
    config = CONFIGS[family]
    layers = kv_layers(config)
    estimated = kv_bytes(layers, 512, 4)  # random float32 models: float32 KV
    assert estimated == _cache_bytes_after(config, 512)
    all_full = kv_bytes([KVLayer(x.key_values, x.value_values) for x in layers], 512, 4)
    if family in ("gemma3_text", "gpt_oss"):
        assert estimated < all_full
    else:
        assert estimated == all_full


def test_layer_types_from_each_familys_config_keys() -> None:
    def windows(**config: Any) -> list[int | None]:
        return [x.window for x in kv_layers({**TINY, "num_hidden_layers": 6, **config})]

    w = 4096
    assert windows(model_type="gemma3_text", sliding_window=512) == [512] * 5 + [None]
    assert windows(model_type="gemma3", text_config={"sliding_window": 512,
                                                     "sliding_window_pattern": 2}) \
        == [512, None] * 3  # the multimodal config's language model
    assert windows(model_type="gpt_oss", sliding_window=128) == [128, None] * 3
    assert windows(model_type="llama", sliding_window=w,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"]) == [w] * 5 + [None]
    assert windows(model_type="gemma2", sliding_window=w) == [w, None] * 3
    assert windows(model_type="mistral", sliding_window=w) == [w] * 6
    assert windows(model_type="mistral", sliding_window=None) == [None] * 6
    assert windows(model_type="qwen2", sliding_window=w, use_sliding_window=False) == [None] * 6
    assert windows(model_type="llama") == [None] * 6
    # grouped-query heads and head_dim from the config; phi3-style configs without head_dim
    (layer,) = kv_layers({"hidden_size": 3072, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "num_hidden_layers": 1})
    assert (layer.key_values, layer.value_values) == (8 * 96, 8 * 96)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_bytes_are_those_of_mx_quantize(bits: int) -> None:
    import mlx.core as mx

    from engine.kv.settings import DEFAULT_GROUP

    tokens, heads, head_dim = 256, 2, 64
    x = mx.zeros((1, heads, tokens, head_dim), dtype=mx.float16)
    parts = mx.quantize(x, group_size=DEFAULT_GROUP[bits], bits=bits)
    held = sum(int(p.nbytes) for p in parts) * 2  # keys and values alike
    assert kv_bytes([KVLayer(heads * head_dim, heads * head_dim)], tokens, 2, bits) == held


@pytest.fixture(scope="module")
def starter_weights(starter: dict[str, Any]) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    import mlx.core as mx

    from engine.runtime.model import read_config, weight_files

    folder = Path(starter["path"])
    weights: dict[str, Any] = {}
    for f in weight_files(folder):
        loaded: Any = mx.load(str(f))  # memory-mapped: shapes and dtypes, no tensor read
        weights.update(loaded)
    return folder, read_config(folder), weights


def test_the_starters_estimate_is_what_its_load_holds(
        starter: dict[str, Any], starter_weights: tuple[Path, dict[str, Any], dict[str, Any]],
        starter_lm: Any) -> None:
    from engine.platform import parameter_bytes

    folder, config, weights = starter_weights
    sizes = WeightSizes.from_arrays(config, weights)
    assert sizes.params == starter["params"] == 134_515_008
    f = estimate(config, sizes, starter_lm.profile)
    # what the load really holds (with the codes its decode steps read)
    assert f.weights_bytes == parameter_bytes(starter_lm.model) + starter_lm.packed.nbytes
    assert f.context == f.trained_context == 8192
    if starter_lm.profile.dtype == "float32":
        assert f.kv_bytes == STARTER_KV_PER_TOKEN_F32 * 8192
    assert estimate(config, sizes, NATIVE).weights_bytes \
        == sizes.quant_bytes + 2 * sizes.float_params  # Metal: as stored, norms in float16


def test_a_load_that_does_not_fit_is_refused_with_the_largest_context_that_would(
        starter_weights: tuple[Path, dict[str, Any], dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.runtime.model import load_weights_into_model

    folder, config, weights = starter_weights
    monkeypatch.delenv("STRATA_CONTEXT", raising=False)
    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", "700")
    # the float32 weights, and where decode steps read them the 4-bit codes (0.115 GB)
    kept = WeightSizes.from_arrays(config, weights).packable_bytes or 0
    cap, held = 700 * 2**20, 134_515_008 * 4 + (kept if packed.applies("float32") else 0)
    most = (cap - held) // STARTER_KV_PER_TOKEN_F32
    most -= most % fit.CONTEXT_STEP
    with pytest.raises(LoadFailed) as refused:
        check_memory(folder, config, weights, F32)
    line = str(refused.value)
    need = held + STARTER_KV_PER_TOKEN_F32 * 8192
    assert "\n" not in line and line.startswith(
        f"{folder.name}: needs about {need / 1e9:.2f} GB (weights {held / 1e9:.2f} GB as "
        "float32, KV 0.38 GB for 8,192")
    assert "0.73 GB is available (STRATA_MAX_MEMORY_MB)" in line
    assert most >= 1024 and f"up to {most:,} tokens (STRATA_CONTEXT={most})" in line
    assert check_memory(folder, config, weights, F32, context=most).fits
    with pytest.raises(LoadFailed):
        check_memory(folder, config, weights, F32, context=most + 2 * fit.CONTEXT_STEP)
    # The offer taken: the real load passes at that context.
    monkeypatch.setenv("STRATA_CONTEXT", str(most))
    model, _ = load_weights_into_model(folder, F32)
    assert model is not None
    # Less than the weights: no context fits.
    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", "300")
    with pytest.raises(LoadFailed, match="the weights alone are more than that"):
        check_memory(folder, config, weights, F32)


def test_sources_describe_their_weights_from_headers(
        starter: dict[str, Any], tmp_path: Path,
        starter_weights: tuple[Path, dict[str, Any], dict[str, Any]]) -> None:
    from engine.importers import open_source
    from engine.importers.starter import starter_gguf
    from tests.engine.hf_factory import write_hf_llama

    folder, config, weights = starter_weights
    from_arrays = WeightSizes.from_arrays(config, weights)
    library_source = open_source(folder)
    assert library_source.weight_sizes() == from_arrays  # safetensors headers
    gguf = open_source(starter_gguf())
    assert gguf.weight_sizes().params == starter["params"]  # the GGUF's tensor table
    assert gguf.preflight(F32).weights_bytes == estimate(config, from_arrays, F32).weights_bytes
    assert gguf.preflight(F32).kv_bytes == STARTER_KV_PER_TOKEN_F32 * 8192

    hf_config = write_hf_llama(tmp_path / "hf")
    hf = open_source(tmp_path / "hf")
    params = hf.weight_sizes().params
    hidden, inter, vocab = (hf_config[k] for k in ("hidden_size", "intermediate_size",
                                                   "vocab_size"))
    kv_dim = hf_config["num_key_value_heads"] * hidden // hf_config["num_attention_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden
    assert params == 2 * vocab * hidden + hf_config["num_hidden_layers"] * per_layer + hidden
    kept = hf.weight_sizes().packable_bytes if packed.applies("float32") else 0
    assert kept is not None  # the importer's 4-bit codes, kept where decode steps read them
    assert hf.preflight(F32).weights_bytes == params * 4 + kept
    # on Metal the importer's default quantization: well under float16
    assert hf.preflight(NATIVE).weights_bytes < params * 2 * 0.6


def test_memory_limit_and_chosen_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", "512")
    assert fit.memory_limit() == (512 * 2**20, "STRATA_MAX_MEMORY_MB")
    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", "lots")
    with pytest.raises(LoadFailed, match="STRATA_MAX_MEMORY_MB='lots'"):
        fit.memory_limit()
    monkeypatch.delenv("STRATA_MAX_MEMORY_MB")
    if sys.platform != "darwin":
        assert fit.gpu_memory_limit() is None  # never asks for a GPU limit off macOS
    config = CONFIGS["llama"]
    monkeypatch.setenv("STRATA_CONTEXT", "1000")
    assert fit.chosen_context(config) == 1000 and fit.chosen_context(config, context=64) == 64
    monkeypatch.setenv("STRATA_CONTEXT", "long")
    with pytest.raises(LoadFailed, match="STRATA_CONTEXT='long'"):
        fit.chosen_context(config)
    monkeypatch.delenv("STRATA_CONTEXT")
    assert fit.chosen_context(config) == 2048


def test_paged_kv_with_an_ssd_tier_needs_only_its_ram_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = {**CONFIGS["llama"], "max_position_embeddings": 1 << 20}
    sizes = WeightSizes(float_params=1_000_000)
    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", "64")
    in_ram = estimate(config, sizes, F32)
    assert not in_ram.fits and 0 < in_ram.max_context < 1 << 20
    assert in_ram.max_context % fit.CONTEXT_STEP == 0
    assert in_ram.at(in_ram.max_context).fits
    assert not in_ram.at(in_ram.max_context + fit.CONTEXT_STEP).fits
    paged = estimate(config, sizes, F32, kv_ram_limit=32 << 20)
    assert paged.fits and paged.kv_bytes == 32 << 20 and paged.max_context == 1 << 20
    quantized = estimate(config, sizes, F32, kv_bits=4)
    per_value = 4 / 8 + 2 * 4 / 32
    assert quantized.kv_bytes == math.floor(2 * 2 * 32 * (1 << 20) * per_value)


def test_a_context_chosen_at_import_is_the_one_loads_run_at(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The offer taken at import (`import_path(..., context=N)`, the dialog's and `strata
    import --context`'s): the manifest records it, so the load fits without STRATA_CONTEXT
    and runs at it."""
    from engine.importers import import_path
    from engine.importers.starter import starter_gguf
    from engine.library import Library
    from engine.runtime.generate import LoadedModel

    monkeypatch.delenv("STRATA_CONTEXT", raising=False)
    lib = Library(tmp_path / "home")
    chosen = import_path(lib, starter_gguf(), name="short", context=4096)
    whole = import_path(lib, starter_gguf(), name="whole")
    assert chosen["context"] == 4096 and lib.get("short")["context"] == 4096
    assert "context" not in whole
    # room for the weights (and the codes decode steps read) and 4,096 tokens, not 4,608
    from engine.importers import open_source

    kept = open_source(starter_gguf()).weight_sizes().packable_bytes or 0
    held = 134_515_008 * 4 + (kept if packed.applies("float32") else 0)
    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", str(
        math.ceil((held + 4096 * STARTER_KV_PER_TOKEN_F32) / 2**20) + 1))
    with pytest.raises(LoadFailed, match="up to 4,096 tokens"):
        LoadedModel.load(whole["path"], profile=F32)
    lm = LoadedModel.load(chosen["path"], profile=F32)
    assert lm.context_length == 4096

"""Paged KV and the prefix cache with every attention layout mlx-lm has, on tiny random-weight
mlx-lm models built from their own ModelArgs (the bare mlx_lm package, never the real one):
sliding-window layers (Gemma 3, gpt-oss with learned sinks, Llama/Mistral with layer types)
keep their window in RAM while full-attention layers page through the SSD tier, and every
step's logits equal mlx-lm's own caches; Gemma 2 (attention with soft-capping in its own
code), multi-latent attention and a hybrid recurrent model (Qwen3-Next) get one line and run
in mlx-lm's cache; a restored prefix gives the logits a prefill gives."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from engine.kv import (
    KVSettings,
    KVUnpageable,
    PagedLayerCache,
    WindowLayerCache,
    close_caches,
    geometry_of,
    make_paged_cache,
)
from engine.kv.attention import attend
from engine.kv.prefix import PrefixCache, PrefixCacheError, PrefixSettings
from engine.runtime.model import cache_module, model_module

VOCAB = 320  # tests/engine/hf_factory's tokenizer stays below it
WINDOW = 40  # smaller than the prompt, not a multiple of the page
PAGE = 16
PROMPT = 300  # 18 full pages, 7.5 windows
DECODE = 16
CHUNK = 64
# float32, max |logit difference| over every prompt position and decode step (logits up to
# ~5): measured 1.4e-5 (gpt-oss), 5.5e-5 (llama with windows, qwen3) and 1.1e-4 (gemma3) in
# exact mode with pages read back from the SSD tier, the same with sparse at full budget;
# 0.0 for a restored prefix. Ignoring the window or the sinks moves them by 3 to 7.
TOL = 5e-4

COMMON = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128,
              num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=VOCAB,
              rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0)
SWA = ["sliding_attention", "full_attention"] * 2
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(COMMON, model_type="gemma3_text", sliding_window=WINDOW,
                        sliding_window_pattern=2, query_pre_attn_scalar=32),
    "gpt_oss": dict(COMMON, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=WINDOW, layer_types=SWA),
    "llama_swa": dict(COMMON, model_type="llama", sliding_window=WINDOW, layer_types=SWA),
    "qwen3": dict(COMMON, model_type="qwen3", tie_word_embeddings=True),
    "gemma2": dict(COMMON, model_type="gemma2", query_pre_attn_scalar=32),
    "qwen3_next": dict(COMMON, model_type="qwen3_next", linear_num_value_heads=2,
                       linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=0,
                       num_experts_per_tok=1, decoder_sparse_step=1,
                       shared_expert_intermediate_size=64, mlp_only_layers=[0, 1, 2, 3],
                       moe_intermediate_size=64, partial_rotary_factor=0.5,
                       full_attention_interval=2),
    "deepseek_v2": dict(COMMON, model_type="deepseek_v2", kv_lora_rank=32, q_lora_rank=None,
                        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
                        num_attention_heads=4, num_key_value_heads=4,
                        rope_scaling={"factor": 1.0, "original_max_position_embeddings": 4096}),
}
PAGED = ["gemma3_text", "gpt_oss", "llama_swa", "qwen3"]


def build(name: str, seed: int = 0, **change: Any) -> Any:
    """A random-weight model: attention projections scaled up so that attention is peaked
    (a window that is ignored, or a sink that is dropped, then changes the logits)."""
    cfg = {**CONFIGS[name], **change}
    mod = model_module(cfg["model_type"])
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    params = []
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for k, v in flat:
        if k.endswith(("q_proj.weight", "k_proj.weight")):
            v = mx.random.normal(v.shape) * 0.5
        elif k.endswith(("q_norm.weight", "k_norm.weight")):
            v = mx.full(v.shape, 3.0)  # Gemma's norms scale by 1 + weight
        elif k.endswith("sinks"):
            v = mx.random.normal(v.shape) * 2.0
        params.append((k, v.astype(mx.float32)))
    model.load_weights(params)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {name: build(name) for name in CONFIGS}


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return [int(x) for x in np.random.default_rng(1).integers(3, VOCAB, PROMPT)]


def run(model: Any, caches: list[Any], ids: list[int], steps: int = DECODE) -> np.ndarray:
    """Logits at every prompt position (prefilled CHUNK at a time), then `steps` greedy
    decode steps: (positions, vocab)."""
    out = []
    logits = None
    for i in range(0, len(ids), CHUNK):
        logits = model(mx.array(ids[i:i + CHUNK])[None], cache=caches)
        mx.eval(logits)
        out.append(np.array(logits[0]))
    assert logits is not None
    y = mx.argmax(logits[:, -1, :], axis=-1)
    for _ in range(steps):
        logits = model(y[None], cache=caches)
        mx.eval(logits)
        out.append(np.array(logits[0]))
        y = mx.argmax(logits[:, -1, :], axis=-1)
    return np.concatenate(out)


@pytest.fixture(scope="module")
def reference(models: dict[str, Any], ids: list[int]) -> dict[str, np.ndarray]:
    """mlx-lm's own caches (make_prompt_cache: KVCache and RotatingKVCache)."""
    return {name: run(models[name], cache_module().make_prompt_cache(models[name]), ids)
            for name in PAGED}


def settings(tmp: Path, mode: str = "exact", **kw: Any) -> KVSettings:
    # 1 MB of RAM (the least there is) holds 16 pages per layer of these models (8 for
    # qwen3's four paged layers): the prompt's 19 pages go to the SSD tier and come back.
    base = dict(mode=mode, page_tokens=PAGE, sink_tokens=PAGE, window_tokens=PAGE,
                budget_tokens=4 * PAGE, ram_mb=1, ssd_dir=tmp)
    return KVSettings(**{**base, **kw}).validate()


# -- geometry -------------------------------------------------------------------------------
def test_geometry_per_layer(models: dict[str, Any]) -> None:
    g = {name: geometry_of(m, "float32", cache_module().make_prompt_cache(m))
         for name, m in models.items()}
    for name in ("gemma3_text", "gpt_oss", "llama_swa"):
        assert g[name].windows == (WINDOW, 0, WINDOW, 0), name
        assert g[name].paged_layers == [1, 3] and g[name].unpaged is None
    assert g["qwen3"].windows == () and g["qwen3"].paged_layers == [0, 1, 2, 3]
    assert (g["qwen3"].kv_heads, g["qwen3"].head_dim) == (4, 64)
    # A sliding layer costs its window, not the context.
    per_layer_token = 4 * (64 + 64) * 4
    assert g["gemma3_text"].bytes_per_token() == 2 * per_layer_token
    assert g["gemma3_text"].kv_bytes(10_000) == per_layer_token * (2 * 10_000 + 2 * WINDOW)
    assert g["qwen3"].kv_bytes(10_000) == per_layer_token * 4 * 10_000
    # Not pageable, each in one line; mlx-lm's cache runs them.
    assert "soft-capping" in str(g["gemma2"].unpaged) and g["gemma2"].no_prefix is None
    assert "ArraysCache" in str(g["qwen3_next"].unpaged) and g["qwen3_next"].no_prefix
    assert "\n" not in str(g["qwen3_next"].unpaged)
    mla = g["deepseek_v2"]
    assert mla.shape(0) == (4, 48, 24)  # K: nope + rope dims, V: v_head_dim
    assert "48 and 24" in str(mla.unpaged) and mla.no_prefix is not None
    assert mla.kv_bytes(100) == 4 * 4 * (48 + 24) * 4 * 100
    with pytest.raises(KVUnpageable, match="recurrent or hybrid"):
        make_paged_cache(models["qwen3_next"], KVSettings(mode="exact", ssd=False),
                         g["qwen3_next"])
    with pytest.raises(PrefixCacheError, match="ArraysCache"):
        PrefixCache.for_geometry(g["qwen3_next"], b"k" * 32, PrefixSettings(folder=Path(".")))


# -- paged exact and sparse against mlx-lm ------------------------------------------------
@pytest.mark.parametrize("name", PAGED)
def test_paged_exact_matches_mlx_lm(name: str, models: dict[str, Any], ids: list[int],
                                    reference: dict[str, np.ndarray], tmp_path: Path) -> None:
    model = models[name]
    caches = make_paged_cache(model, settings(tmp_path))
    kinds = [type(c) for c in caches]
    if name != "qwen3":
        assert kinds == [WindowLayerCache, PagedLayerCache] * 2
    got = run(model, caches, ids)
    worst = float(np.abs(got - reference[name]).max())
    assert worst < TOL, (name, worst)
    store = caches[1].store
    assert store.n_layers == (4 if name == "qwen3" else 2)
    stats = store.stats()
    assert stats["pages_ssd"] > 0 and stats["evictions"] > 0 and stats["ssd_reads"] > 0
    # A sliding layer holds about its window, never the context.
    for c in caches:
        if isinstance(c, WindowLayerCache):
            assert c.nbytes <= 4 * (64 + 64) * 4 * (WINDOW + 2 * 256)
    close_caches(caches)


def test_ignoring_the_window_or_the_sinks_changes_the_logits(
        ids: list[int], reference: dict[str, np.ndarray]) -> None:
    """The comparisons here can fail: the same weights with a window past the prompt, or
    with the sinks at zero, are far from mlx-lm's windowed, sinked cache."""
    for name in ("gemma3_text", "gpt_oss"):
        wide = build(name, sliding_window=4096)
        full = run(wide, cache_module().make_prompt_cache(wide), ids)
        assert np.abs(full - reference[name]).max() > 2000 * TOL, name
    model = build("gpt_oss")
    for layer in model.layers:
        layer.self_attn.sinks = mx.zeros_like(layer.self_attn.sinks)
    plain = run(model, cache_module().make_prompt_cache(model), ids)
    assert np.abs(plain - reference["gpt_oss"]).max() > 2000 * TOL


@pytest.mark.parametrize("name", ["gpt_oss", "gemma3_text"])
def test_sparse_with_full_budget_equals_mlx_lm(name: str, models: dict[str, Any],
                                               ids: list[int],
                                               reference: dict[str, np.ndarray],
                                               tmp_path: Path) -> None:
    caches = make_paged_cache(models[name], settings(tmp_path, "sparse",
                                                     budget_tokens=PROMPT + DECODE + PAGE))
    got = run(models[name], caches, ids)
    assert np.abs(got - reference[name]).max() < TOL
    close_caches(caches)


def test_learned_sinks_in_every_attention_path(tmp_path: Path) -> None:
    """attend() with sinks equals MLX's fused attention with sinks: fused prefill over a
    resident past, page-wise prefill and decode over pages read back from the SSD tier, and
    sparse decode's page selection."""
    rng = np.random.default_rng(0)
    hq, h, d = 8, 2, 32
    s = settings(tmp_path, ram_mb=1, budget_tokens=6 * PAGE)
    caches = make_paged_cache_for(s, h, d)
    cache = caches[0]
    sinks = mx.array(rng.normal(size=hq).astype(np.float32) * 2)
    keys_all, values_all = [], []
    scale = d ** -0.5
    for L in (100, 90, 3, 1, 1):
        q = mx.array(rng.normal(size=(1, hq, L, d)).astype(np.float32))
        k = mx.array(rng.normal(size=(1, h, L, d)).astype(np.float32) * 2)
        v = mx.array(rng.normal(size=(1, h, L, d)).astype(np.float32))
        keys_all.append(k)
        values_all.append(v)
        cache.update_and_fetch(k, v)
        got = attend(cache, q, k, v, scale, sinks)
        kk, vv = mx.concatenate(keys_all, axis=2), mx.concatenate(values_all, axis=2)
        t = kk.shape[2]
        mask = (mx.arange(L)[:, None] + (t - L)) >= mx.arange(t)[None]
        want = mx.fast.scaled_dot_product_attention(q, kk, vv, scale=scale, mask=mask,
                                                    sinks=sinks)
        assert np.abs(np.array(got) - np.array(want)).max() < 1e-5, L
        without = attend(cache, q, k, v, scale)
        assert np.abs(np.array(without) - np.array(want)).max() > 1e-3  # sinks matter
    # Sparse decode with a budget below the context: the selected pages plus the sinks'
    # term, against the same softmax over exactly those positions.
    cache.store.settings = s.with_(mode="sparse")
    q = mx.array(rng.normal(size=(1, hq, 1, d)).astype(np.float32))
    k = mx.array(rng.normal(size=(1, h, 1, d)).astype(np.float32))
    v = mx.array(rng.normal(size=(1, h, 1, d)).astype(np.float32))
    cache.update_and_fetch(k, v)
    got = np.array(attend(cache, q, k, v, scale, sinks))
    assert np.isfinite(got).all()
    plain = np.array(attend(cache, q, k, v, scale))
    # With the sinks' logit in the denominator every output shrinks by the same factor per
    # head as the unsinked sparse result: out_sink = out * Z / (Z + exp(sink)) > 0.
    ratio = got / plain
    per_head = ratio.reshape(hq, d)
    assert np.allclose(per_head, per_head[:, :1], rtol=1e-4)
    assert ((per_head > 0) & (per_head < 1)).all()
    close_caches(caches)


def make_paged_cache_for(s: KVSettings, kv_heads: int, head_dim: int) -> list[Any]:
    from engine.kv import KVStore

    store = KVStore(s, n_layers=1, kv_heads=kv_heads, head_dim=head_dim, dtype="float32")
    return [PagedLayerCache(store, 0)]


# -- the window cache ---------------------------------------------------------------------
def test_window_cache_trims_within_its_slack(models: dict[str, Any], ids: list[int],
                                             tmp_path: Path) -> None:
    """A follow-up prompt trims the window layers as it trims the pages, then continues to
    the same logits; a trim past what the window keeps is refused, not wrong."""
    model = models["gpt_oss"]
    seq = ids + ids
    ref = run(model, cache_module().make_prompt_cache(model), seq)
    caches = make_paged_cache(model, settings(tmp_path))
    run(model, caches, seq[:556], steps=0)
    window = caches[0]
    assert isinstance(window, WindowLayerCache) and window.start > 0  # compacted
    assert not window.can_trim(window.offset - window.start)
    with pytest.raises(ValueError, match="cannot be trimmed"):
        window.trim(window.offset - window.start)
    for c in caches:
        assert c.trim(56) == 56  # back to 500 tokens
    tail = run(model, caches, seq[500:])
    assert np.abs(tail - ref[500:]).max() < TOL
    close_caches(caches)


# -- the prefix cache ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "qwen3"])
def test_prefix_restore_gives_the_prefill_logits(name: str, models: dict[str, Any],
                                                 ids: list[int],
                                                 reference: dict[str, np.ndarray],
                                                 tmp_path: Path) -> None:
    model = models[name]
    g = geometry_of(model, "float32", cache_module().make_prompt_cache(model))
    pc = PrefixCache.for_geometry(g, b"k" * 32, PrefixSettings(folder=tmp_path,
                                                                page_tokens=PAGE))
    prompt = ids[:203]
    plan = pc.lookup(prompt)
    depth = len(plan.hashes) * PAGE  # 192: the last full page before the final token
    caches = cache_module().make_prompt_cache(model)
    for i in range(0, depth, CHUNK):
        model(mx.array(prompt[i:min(i + CHUNK, depth)])[None], cache=caches)
        mx.eval([c.state for c in caches])
    window = pc.snapshot(caches)
    assert (window is None) == (name == "qwen3")
    assert pc.store(caches, prompt, plan, window) == len(plan.hashes)
    pc.flush()
    suffixes = sorted(p.suffix for p in tmp_path.iterdir() if not p.name.startswith("pages.db"))
    assert suffixes == ([".kvp"] if name == "qwen3" else [".kvp", ".kvw"])

    again = pc.lookup(prompt)
    assert again.hit_pages == len(plan.hashes)
    fresh = cache_module().make_prompt_cache(model)
    assert pc.restore(fresh, prompt, again, 0) == depth
    out = run(model, fresh, prompt[depth:], steps=0)
    ref = run(model, cache_module().make_prompt_cache(model), prompt, steps=0)
    assert np.abs(out - ref[depth:]).max() < TOL
    if name != "qwen3":
        # Without its window file the prefix is not usable: no hit, never wrong logits.
        next(tmp_path.glob("*.kvw")).unlink()
        assert pc.lookup(prompt).hit_pages == 0
    pc.close()


def store_prompt(pc: PrefixCache, model: Any, prompt: list[int]) -> None:
    plan = pc.lookup(prompt)
    caches = cache_module().make_prompt_cache(model)
    model(mx.array(prompt[:len(plan.hashes) * PAGE])[None], cache=caches)
    mx.eval([c.state for c in caches])
    pc.store(caches, prompt, plan, pc.snapshot(caches))
    pc.flush()


def test_window_files_leave_with_their_pages(models: dict[str, Any], tmp_path: Path) -> None:
    """Over budget, the least recently used prompt goes, its window file with its run; the
    folder's figures count window files."""
    from engine.kv.prefix import folder_runs

    model = models["gpt_oss"]
    g = geometry_of(model, "float32", cache_module().make_prompt_cache(model))
    pc = PrefixCache.for_geometry(g, b"k" * 32, PrefixSettings(folder=tmp_path,
                                                                page_tokens=PAGE,
                                                                budget_mb=1.5))
    rng = np.random.default_rng(5)
    a, b = ([int(x) for x in rng.integers(3, VOCAB, 200)] for _ in range(2))
    store_prompt(pc, model, a)
    runs, size = folder_runs(tmp_path)
    assert runs == 1 and size == pc.disk_bytes() > 12 * pc.page_bytes
    assert pc.lookup(a).hit_pages == 12
    store_prompt(pc, model, b)
    assert pc.lookup(a).hit_pages == 0 and pc.lookup(b).hit_pages == 12
    files = (p for p in tmp_path.iterdir() if not p.name.startswith("pages.db"))  # the table
    assert sorted(p.suffix for p in files) == [".kvp", ".kvw"]
    pc.close()


# -- through the runtime: generate, the pool, the fallback --------------------------------
def write_folder(folder: Path, name: str) -> Path:
    """A model folder as the library holds one: config.json, the weights, a tokenizer."""
    from tests.engine.hf_factory import write_tokenizer

    folder.mkdir(parents=True)
    model = build(name)
    (folder / "config.json").write_text(json.dumps(CONFIGS[name]))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(
        model.parameters())))
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    return {name: write_folder(root / name, name) for name in ("gemma3_text", "qwen3_next")}


def greedy(lm: Any, prompt: list[int], n: int, **kw: Any) -> tuple[list[int], Any]:
    from engine.runtime.generate import generate
    from engine.runtime.sampling import SamplingParams

    events = list(generate(lm, prompt, SamplingParams(temperature=0.0), max_tokens=n, **kw))
    return [e.token for e in events if e.token is not None], events[-1]


def test_generate_paged_and_prefix_on_a_sliding_model(folders: dict[str, Path],
                                                      tmp_path: Path) -> None:
    from engine.runtime.generate import LoadedModel

    lm = LoadedModel.load(folders["gemma3_text"])
    prompt = [int(x) for x in np.random.default_rng(2).integers(3, 300, 700)]
    plain, _ = greedy(lm, prompt, DECODE, prefix_cache=False)
    lm.kv_settings = settings(tmp_path / "kv")
    assert lm.paged and lm.kv_notice is None
    pc = lm.new_cache()
    paged, _ = greedy(lm, prompt, DECODE, prompt_cache=pc, prefix_cache=False)
    assert paged == plain
    # A follow-up that shares all but the last turn reuses the caches (trim, not clear).
    follow = prompt + paged[:8] + [5, 6, 7]
    again, ev = greedy(lm, follow, 4, prompt_cache=pc, prefix_cache=False)
    assert ev.cached_tokens == len(prompt) + 8
    fresh, _ = greedy(lm, follow, 4, prefix_cache=False)
    assert again == fresh
    pc.close()
    # mlx-lm's caches with the SSD prefix cache: the second prompt restores, same tokens.
    lm.kv_settings = None
    lm.enable_prefix_cache(PrefixSettings(folder=tmp_path / "prefix", page_tokens=PAGE))
    first, ev1 = greedy(lm, prompt, DECODE)
    assert first == plain and ev1.cached_tokens == 0
    assert lm.prefix_cache is not None
    lm.prefix_cache.flush()
    second, ev2 = greedy(lm, prompt, DECODE)
    assert ev2.cached_tokens == (len(prompt) - 1) // PAGE * PAGE
    assert second == plain
    lm.disable_prefix_cache()


def test_hybrid_model_runs_in_mlx_lm_cache_with_one_line(folders: dict[str, Path],
                                                         tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    from engine.library import Library
    from engine.runtime.pool import ModelPool, PoolSettings

    pool = ModelPool(Library(tmp_path / "home"), PoolSettings(
        kv=settings(tmp_path / "kv"), prefix_dir=tmp_path / "prefix"))
    with caplog.at_level(logging.WARNING):
        lm = pool.get(str(folders["qwen3_next"]))
        prompt = [int(x) for x in np.random.default_rng(3).integers(3, 300, 40)]
        toks, ev = greedy(lm, prompt, 8, prompt_cache=pool.cache_for(lm, prompt))
        greedy(lm, prompt, 2)
    assert len(toks) == 8 and ev.finish_reason in ("length", "stop")
    assert not lm.paged and lm.prefix_cache is None
    notice = lm.kv_notice
    assert notice is not None and "ArraysCache" in notice and "mlx-lm" in notice
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count(notice) == 1  # once, not per prompt cache
    assert any(m.startswith("prefix cache off:") and "ArraysCache" in m for m in lines)
    snap = pool.memory()
    assert snap.kv_ssd_bytes is None and snap.kv_ssd_reason == notice
    assert snap.kv_ram_bytes is not None and snap.kv_ram_bytes > 0
    assert "ArraysCache" in str(snap.prefix_disk_reason)
    pool.close()

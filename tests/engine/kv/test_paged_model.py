"""Paged KV cache on the real starter model: exact against mlx-lm's KVCache at 2k, sparse.

2k, not 4k: the two prefills are quadratic in MLX's CPU attention (about 100 s each at 4k
here, 30 s at 2k), and 16 pages per layer cross page boundaries as 32 do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

CONTEXT = 2048
GREEDY = 16


def _prefill(lm: Any, cache: list[Any], ids: list[int]) -> Any:
    import mlx.core as mx

    for i in range(0, len(ids) - 1, 512):
        lm.model(mx.array(ids[i:min(i + 512, len(ids) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    out = lm.model(mx.array(ids[-1:])[None], cache=cache)[:, -1, :]
    mx.eval(out)
    return out


def _greedy(lm: Any, cache: list[Any], logits: Any, n: int) -> tuple[list[int], list[Any]]:
    import mlx.core as mx

    toks, steps = [], []
    y = mx.argmax(logits, axis=-1)
    for _ in range(n):
        toks.append(int(y.item()))
        logits = lm.model(y[None], cache=cache)[:, -1, :]
        steps.append(np.array(logits))
        y = mx.argmax(logits, axis=-1)
    return toks, steps


@pytest.fixture(scope="module")
def runs(starter_lm: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2k prefill with mlx-lm's KVCache and one through the paged cache (exact)."""
    from engine.bench.common import prompt_ids
    from engine.kv import KVSettings, make_paged_cache
    from engine.runtime.model import cache_module

    lm = starter_lm
    ids = prompt_ids(lm.tokenizer, CONTEXT)
    ref = cache_module().make_prompt_cache(lm.model)
    ref_logits = _prefill(lm, ref, ids)
    ref_toks, ref_steps = _greedy(lm, ref, ref_logits, GREEDY)
    settings = KVSettings(mode="exact", ssd_dir=tmp_path_factory.mktemp("kv")).validate()
    paged = make_paged_cache(lm.model, settings)
    logits = _prefill(lm, paged, ids)
    toks, steps = _greedy(lm, paged, logits, GREEDY)
    yield dict(ids=ids, ref_logits=np.array(ref_logits), ref_toks=ref_toks,
               ref_steps=ref_steps, logits=np.array(logits), toks=toks, steps=steps,
               paged=paged, settings=settings)
    paged[0].store.close()


def test_exact_matches_mlx_lm_at_2k(runs: dict[str, Any]) -> None:
    assert np.abs(runs["logits"] - runs["ref_logits"]).max() < 1e-3
    assert runs["toks"] == runs["ref_toks"]
    worst = max(np.abs(a - b).max() for a, b in zip(runs["steps"], runs["ref_steps"],
                                                      strict=True))
    assert worst < 1e-3


def test_sparse_with_full_budget_equals_exact(starter_lm: Any, runs: dict[str, Any]) -> None:
    import mlx.core as mx

    paged = runs["paged"]
    store = paged[0].store
    for c in paged:
        c.trim(GREEDY)  # back to the prompt, as a follow-up turn would
    store.settings = runs["settings"].with_(mode="sparse", budget_tokens=CONTEXT + GREEDY)
    first = mx.array(runs["logits"])
    toks, steps = _greedy(starter_lm, paged, first, GREEDY)
    assert toks == runs["toks"]
    assert max(np.abs(a - b).max() for a, b in zip(steps, runs["steps"], strict=True)) < 1e-4
    # The smallest budget (sinks, window and a page: 768 of 2,048): it runs, reads only what is
    # hot, and stays close.
    for c in paged:
        c.trim(GREEDY)
    s = runs["settings"]
    store.settings = s.with_(mode="sparse",
                             budget_tokens=s.sink_tokens + s.window_tokens + s.page_tokens)
    toks, _ = _greedy(starter_lm, paged, first, GREEDY)
    assert len(toks) == GREEDY and toks[0] == runs["toks"][0]
    assert store.stats()["ssd_reads"] == 0


def test_generate_with_paged_cache_matches(starter_lm: Any, tmp_path: Path) -> None:
    from engine.kv import KVSettings
    from engine.runtime.generate import generate
    from engine.runtime.sampling import SamplingParams

    lm = starter_lm
    prompt = lm.tokenizer.encode_chat([{"role": "user",
                                        "content": "What is the capital of France?"}])
    greedy = SamplingParams(temperature=0.0)
    plain = "".join(e.text for e in generate(lm, prompt, greedy, max_tokens=12))
    try:
        for mode in ("exact", "sparse"):
            lm.kv_settings = KVSettings(mode=mode, page_tokens=16, sink_tokens=16,
                                        window_tokens=16, budget_tokens=48,
                                        ssd_dir=tmp_path).validate()
            pc = lm.new_cache()
            text = "".join(e.text for e in generate(lm, prompt, greedy, max_tokens=12,
                                                    prompt_cache=pc))
            assert text == plain and "Paris" in text
            assert pc.nbytes > 0
            pc.close()
    finally:
        lm.kv_settings = None
    assert not any(tmp_path.iterdir())  # session files go with the cache


def test_hook_is_idempotent_and_falls_through(starter_lm: Any) -> None:
    import sys

    from engine.kv.attention import install_hook

    install_hook(starter_lm.model)
    assert install_hook(starter_lm.model) == []
    mod = sys.modules[type(starter_lm.model).__module__]
    assert hasattr(mod.scaled_dot_product_attention, "_strata_original")


def test_cli_kv_options(tmp_path: Path) -> None:
    from app.cli import _kv_settings, build_parser, main

    args = build_parser().parse_args(["generate", "--prompt", "x", "--kv-mode", "sparse",
                                      "--kv-ram-mb", "256", "--kv-budget", "1024"])
    s = _kv_settings(args)
    assert (s.mode, s.ram_mb, s.budget_tokens) == ("sparse", 256, 1024)
    # No --kv-mode: the page store in exact mode, the default KV cache (engine.kv.settings).
    s = _kv_settings(build_parser().parse_args(["generate", "--prompt", "x"]))
    assert s is not None and (s.mode, s.bits) == ("exact", 16)
    assert _kv_settings(build_parser().parse_args(["generate", "--prompt", "x", "--kv-mode",
                                                   "mlx"])) is None
    s = _kv_settings(build_parser().parse_args(["generate", "--prompt", "x", "--kv-mode",
                                                "exact", "--kv-bits", "4"]))
    assert (s.mode, s.bits, s.group()) == ("exact", 4, 32)
    # Quantized pages need the paged cache: refused before the model loads.
    assert main(["generate", "--prompt", "x", "--kv-mode", "mlx", "--kv-bits", "8"]) == 1

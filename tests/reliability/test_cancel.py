"""Stopping a reply during prefill or decode returns KV memory to its budget (measured).

Contract checked: after a cancel the prompt cache holds exactly the tokens it says it holds
(cache offset == len(tokens)) and no more KV than those tokens need (mlx-lm grows its
buffers in steps of 256 positions); a reply that owned its cache gives every byte back
(MLX active memory returns to where it was); the paged store's RAM tier holds only the
pages of the tokens kept, and nothing once closed.
"""

from __future__ import annotations

import gc
from typing import Any

from engine.runtime.generate import PromptCache, generate
from engine.runtime.sampling import SamplingParams
from engine.runtime.speculative import K_MAX

STEP = 256
GREEDY = SamplingParams(temperature=0.0)


def kv_bytes_per_token(lm: Any) -> int:
    attn = lm.model.layers[0].self_attn
    head_dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads
    width = 4 if lm.profile.dtype == "float32" else 2
    return 2 * len(lm.model.layers) * attn.n_kv_heads * head_dim * width


def active_after_cleanup() -> int:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    return int(mx.get_active_memory())


def long_prompt(lm: Any) -> list[int]:
    ids: list[int] = lm.tokenizer.encode_chat(
        [{"role": "user", "content": "Count the sheep in the meadow. " * 70}])
    assert len(ids) > 520  # two prefill chunks
    return ids


def check_holds_only_its_tokens(pc: PromptCache, per_token: int) -> None:
    assert all(c.offset == len(pc.tokens) for c in pc.cache)
    allowed = -(-max(len(pc.tokens), 1) // STEP) * STEP * per_token
    assert pc.nbytes <= allowed, f"{pc.nbytes} bytes for {len(pc.tokens)} tokens"


def test_cancel_in_prefill_and_decode_returns_kv_memory(starter_lm: Any) -> None:
    lm = starter_lm
    ids = long_prompt(lm)
    per_token = kv_bytes_per_token(lm)
    before = active_after_cleanup()

    # Prefill: stop after the first chunk.
    pc = lm.new_cache()
    calls = [0]

    def after_first_chunk() -> bool:
        calls[0] += 1
        return calls[0] >= 1

    events = list(generate(lm, ids, GREEDY, max_tokens=50, cancel=after_first_chunk,
                           prompt_cache=pc, prefix_cache=False))
    assert events[-1].finish_reason == "cancelled" and events[-1].generated_tokens == 0
    assert len(pc.tokens) == 512
    check_holds_only_its_tokens(pc, per_token)
    pc.clear()
    assert pc.nbytes == 0 and pc.tokens == []
    del pc
    assert active_after_cleanup() <= before + (1 << 20)

    # Decode: stop after three tokens.
    pc = lm.new_cache()
    seen = [0]

    def after_three() -> bool:
        return seen[0] >= 3

    for ev in generate(lm, ids[:200], GREEDY, max_tokens=50, cancel=after_three,
                       prompt_cache=pc,
                       prefix_cache=False):
        seen[0] = ev.generated_tokens
    assert ev.finish_reason == "cancelled"
    # At most the step that was running: a speculative verify pass keeps its accepted drafts.
    assert len(pc.tokens) <= 200 + 3 + K_MAX
    check_holds_only_its_tokens(pc, per_token)
    del pc, ev
    assert active_after_cleanup() <= before + (1 << 20)

    # A reply that owns its cache: everything comes back when it stops.
    for _ in generate(lm, ids[:200], GREEDY, max_tokens=50, cancel=lambda: True,
                      prefix_cache=False):
        pass
    assert active_after_cleanup() <= before + (1 << 20)


def test_cancel_returns_paged_ram_tier_pages(starter_lm: Any, tmp_path: Any) -> None:
    from engine.kv import KVSettings

    lm = starter_lm
    ids = long_prompt(lm)
    old = lm.kv_settings
    lm.kv_settings = KVSettings(mode="exact", ssd=False, ram_mb=256).validate()
    try:
        pc = lm.new_cache()
        store = pc.cache[0].store
        calls = [0]

        def after_one_chunk() -> bool:
            calls[0] += 1
            return calls[0] >= 1

        events = list(generate(lm, ids, GREEDY, max_tokens=20, cancel=after_one_chunk,
                               prompt_cache=pc, prefix_cache=False))
        assert events[-1].finish_reason == "cancelled"
        stats = store.stats()
        assert len(pc.tokens) == 512
        assert stats["pages_ram"] == len(lm.model.layers) * (512 // store.P)
        assert stats["bytes_ram"] <= stats["ram_budget_bytes"]
        pc.clear()  # a stopped chat that is dropped: its store closes
        assert store.writer is None and store.prefetcher is None
        pc.close()
    finally:
        lm.kv_settings = old

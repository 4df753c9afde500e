"""The child of `strata bench prefix`: `python -m engine.bench.prefix_worker MODE JOB.json`
measures one figure in a fresh process and prints it as one JSON line on stdout.

Contract: MODE is one of build (prefill the job's prefix, store it in STRATA_PREFIX_DIR and
save mlx-lm's prompt-cache file of it), hit (restore it from the SSD), chat (a chat's cold
first token with the prefix cache on), turns (a multi-turn chat in one ChatSession), mlxlm-load
(load mlx-lm's prompt-cache file) and mlxlm-chat (mlx_lm.load and stream_generate of the same
chat). `first_token_wall` is time.time() at the first token: the parent counts from before
it started this process, so the interpreter and every import are inside cold first tokens.
That is why this module imports at the top only the standard library and Strata's leaves,
and each mode imports its own stack: Strata's runtime for its modes, and for mlxlm-chat mlx-lm's
real package before engine.runtime.model (which otherwise registers a bare `mlx_lm`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.platform import compute_profile
from engine.telemetry import Timeline

# The user's side of the multi-turn chat: short questions, so each turn adds a little history.
TURNS = (
    "Who wrote the text above, do you think?",
    "Name one thing it says about the weather.",
    "What would be a good title for it?",
    "Summarize it for a child in one sentence.",
    "Which word in it is the longest?",
    "Is the tone cheerful or gloomy?",
    "What happens at the end?",
    "Give me three keywords for it.",
    "Translate the first sentence into French.",
    "Thank you. What was my first question?",
)


def _strata(job: dict[str, Any], ids: list[int], max_tokens: int, ignore_eos: bool = False
            ) -> dict[str, Any]:
    # Local, as every import of Strata's stack here: the child's clock runs (module docstring).
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams

    tl = Timeline()
    lm = LoadedModel.load(job["model_dir"], profile=compute_profile(job["profile"]),
                          timeline=tl)
    pc = lm.enable_prefix_cache()
    if ignore_eos:
        # The prefix's first greedy token is EOS: without this, build and hit would both
        # generate nothing and "same output" would compare two empty lists.
        lm.eos_ids = set()
    tokens: list[int] = []
    first_wall = 0.0
    last: Any = None
    cache = lm.new_cache()
    for ev in generate(lm, ids, SamplingParams(temperature=0.0), max_tokens, timeline=tl,
                       prompt_cache=cache):
        if ev.token is not None:
            if not tokens:
                first_wall = time.time()
            tokens.append(ev.token)
        last = ev
    out = {"first_token_wall": first_wall, "tokens": tokens, "ttft_s": last.ttft_s,
           "cached_tokens": last.cached_tokens, "restore_s": pc.stats.restore_s,
           "bytes_read": pc.stats.bytes_read, "timeline": tl.durations(),
           "prefill_s": tl.durations().get("prefill", 0.0)}
    if job.get("save_mlx"):
        from engine.runtime.model import cache_module  # loaded with LoadedModel: no cost

        cm = cache_module()
        n = job["prefix_tokens"]
        exact = []
        for c in cache.cache:  # exactly the prefix, no spare capacity: a fair file
            layer: Any = c  # mlx-lm's own KVCache (no paged setting here): keys, values
            k = cm.KVCache()
            k.keys, k.values, k.offset = layer.keys[..., :n, :], layer.values[..., :n, :], n
            exact.append(k)
        cm.save_prompt_cache(job["mlx_file"], exact)
    pc.close()
    return out


def chat_turns(lm: Any, system: str, questions: Sequence[str], max_tokens: int
               ) -> tuple[list[dict[str, Any]], Any]:
    """Greedy multi-turn chat in one ChatSession: per turn, the first-token time from the
    call (template and tokenizing included) and the prompt's size; returns (rows, session)."""
    from engine.runtime.generate import ChatSession  # local: see the module docstring
    from engine.runtime.sampling import SamplingParams  # local: as above

    session = ChatSession(lm, system=system)
    rows = []
    for i, q in enumerate(questions):
        t0 = time.perf_counter()
        first, last = 0.0, None
        for ev in session.send(q, SamplingParams(temperature=0.0), max_tokens=max_tokens):
            if ev.token is not None and not first:
                first = time.perf_counter()
            last = ev
        assert last is not None
        rows.append({"turn": i + 1, "prompt_tokens": last.prompt_tokens,
                     "cached_tokens": last.cached_tokens,
                     "new_tokens": last.prompt_tokens - last.cached_tokens,
                     "first_token_s": (first or time.perf_counter()) - t0,
                     "ttft_s": last.ttft_s, "generated_tokens": last.generated_tokens})
    return rows, session


def _turns(job: dict[str, Any]) -> dict[str, Any]:
    """The multi-turn chat, then the last turn's prompt once more without any reuse."""
    from engine.runtime.generate import LoadedModel, generate  # local: see the module docstring
    from engine.runtime.sampling import SamplingParams  # local: as above

    lm = LoadedModel.load(job["model_dir"], profile=compute_profile(job["profile"]))
    pc = lm.enable_prefix_cache()  # as the app has it: the system prompt comes off the SSD
    rows, session = chat_turns(lm, job["system"], TURNS[:job["turns"]], job["turn_tokens"])
    pc.close()
    prompt = lm.tokenizer.encode_chat(session.messages[:-1])  # the last turn's prompt
    t0 = time.perf_counter()
    for ev in generate(lm, prompt, SamplingParams(temperature=0.0), 1, prefix_cache=False):
        if ev.token is not None:
            break
    return {"turns": rows, "last_without_reuse_s": time.perf_counter() - t0,
            "last_prompt_tokens": len(prompt)}


def measure(mode: str, job_path: str) -> dict[str, Any]:
    """One figure: `mode` (see the module docstring) on the job file's ids; a JSON-able dict."""
    job = json.loads(Path(job_path).read_text())
    if mode == "build":
        job["save_mlx"] = True
        return _strata(job, job["prefix"], 4, ignore_eos=True)
    if mode == "hit":
        return _strata(job, job["prefix"], 4, ignore_eos=True)
    if mode == "chat":
        return _strata(job, job["chat"], 1)
    if mode == "turns":
        return _turns(job)
    if mode == "mlxlm-load":
        import mlx.core as mx  # what mlx-lm's own file load needs, and no more

        from engine.runtime.model import cache_module  # mlx-lm's cache module, bare package

        t = time.perf_counter()
        cache = cache_module().load_prompt_cache(job["mlx_file"])
        mx.eval([c.keys for c in cache] + [c.values for c in cache])
        return {"load_s": time.perf_counter() - t,
                "file_bytes": os.path.getsize(job["mlx_file"])}
    if mode == "mlxlm-chat":
        # The real mlx_lm package first (its load needs it), then the same compute profile.
        import mlx.core as mx
        from mlx_lm import load, stream_generate

        from engine.runtime.model import apply_profile  # after mlx_lm: it finds the real one

        model, tok = load(job["model_dir"])[:2]
        apply_profile(model, compute_profile(job["profile"]))
        mx.eval(model.parameters())
        for r in stream_generate(model, tok, job["chat"], max_tokens=1):
            return {"first_token_wall": time.time(), "tokens": [int(r.token)]}
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2])), flush=True)

"""Reference generation and logits with the real mlx-lm package, run as a subprocess by the tests.

The real `mlx_lm` package cannot share a process with the engine's bare one
(engine.runtime.model), hence a subprocess.

Usage: python tests/engine/mlxlm_reference.py MODEL_DIR PROFILE MAX_TOKENS < prompt.json
Prints JSON: {"prompt_ids": [...], "tokens": [...]} — mlx-lm's own chat-template token ids
and its greedy tokens (mlx_lm.generate's stream_generate), in Strata's compute profile.

Usage: python tests/engine/mlxlm_reference.py logits < jobs.json
jobs.json: {"convert": [{"hf": DIR, "mlx": DIR, **mlx_lm.convert keywords}, ...],
            "logits": [{"folder": DIR, "profile": NAME, "tokens": [...], "out": FILE.npy,
                        "recipe": {"group_size", "bits", "high_bits"} (optional)}, ...]}
First every conversion runs (mlx_lm.convert: what mlx-lm itself saves), then for each logits
job `mlx_lm.load(folder)` (with "recipe": the float model quantized by mlx-lm's quantize_model
with that recipe: high_bits for embeddings and the head, the model's own quant_predicate
choices, bits elsewhere), Strata's compute profile applied, and the next-token logits at every
position of `tokens` saved as float32 (len(tokens), vocab) to `out`. Prints JSON
{"seconds": {out: load and forward seconds}}.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import engine  # noqa: F401  (the BLAS shim must load before mlx, as in Strata)
from engine.platform import compute_profile
from engine.runtime.model import apply_profile


def _recipe_predicate(model: Any, recipe: dict[str, int]) -> Any:
    own = getattr(model, "quant_predicate", None)
    high = {"group_size": recipe["group_size"], "bits": recipe["high_bits"]}
    low = {"group_size": recipe["group_size"], "bits": recipe["bits"]}

    def predicate(path: str, module: Any) -> bool | dict[str, Any]:
        if "embed_tokens" in path or "lm_head" in path:
            return dict(high)
        choice = own(path, module) if own is not None else True
        if isinstance(choice, dict) or not choice:
            return choice
        return dict(low)

    return predicate


def logits_main() -> None:
    import contextlib
    import io
    import time

    import mlx.core as mx
    import numpy as np
    from mlx_lm import convert, load
    from mlx_lm.utils import quantize_model

    jobs = json.loads(sys.stdin.read())
    for job in jobs.get("convert", []):
        job = dict(job)
        with contextlib.redirect_stdout(io.StringIO()):  # mlx_lm.convert prints progress
            convert(job.pop("hf"), job.pop("mlx"), **job)
    seconds = {}
    for job in jobs.get("logits", []):
        t = time.perf_counter()
        loaded: Any = load(job["folder"], return_config=True)
        model, config = loaded[0], loaded[2]
        if job.get("recipe"):
            r = job["recipe"]
            with contextlib.redirect_stdout(io.StringIO()):
                quantize_model(model, config, r["group_size"], r["bits"],
                               quant_predicate=_recipe_predicate(model, r))
        apply_profile(model, compute_profile(job["profile"]))
        mx.eval(model.parameters())
        out = model(mx.array(job["tokens"])[None])[0].astype(mx.float32)
        np.save(job["out"], np.array(out))
        seconds[job["out"]] = round(time.perf_counter() - t, 3)
    print(json.dumps({"seconds": seconds}))


def main() -> None:
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    if sys.argv[1:] == ["logits"]:
        logits_main()
        return

    folder, profile, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    messages = json.loads(sys.stdin.read())
    loaded: Any = load(folder)
    model, tokenizer = loaded[0], loaded[1]
    apply_profile(model, compute_profile(profile))
    mx.eval(model.parameters())
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    tokens = [int(r.token) for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens)]
    print(json.dumps({"prompt_ids": list(map(int, ids)), "tokens": tokens}))


if __name__ == "__main__":
    main()

"""Reference generation with the real mlx-lm package, run as a subprocess by the tests.

Usage: python tests/engine/mlxlm_reference.py MODEL_DIR PROFILE MAX_TOKENS < prompt.json
Prints JSON: {"prompt_ids": [...], "tokens": [...]} — mlx-lm's own chat-template token ids
and its greedy tokens (mlx_lm.generate's stream_generate), in Strata's compute profile.
"""

from __future__ import annotations

import json
import sys

import engine  # noqa: F401  (the BLAS shim must load before mlx, as in Strata)
from engine.platform import compute_profile
from engine.runtime.model import apply_profile


def main() -> None:
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    folder, profile, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    messages = json.loads(sys.stdin.read())
    model, tokenizer = load(folder)
    apply_profile(model, compute_profile(profile))
    mx.eval(model.parameters())
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    tokens = [int(r.token) for r in stream_generate(model, tokenizer, ids, max_tokens=max_tokens)]
    print(json.dumps({"prompt_ids": list(map(int, ids)), "tokens": tokens}))


if __name__ == "__main__":
    main()

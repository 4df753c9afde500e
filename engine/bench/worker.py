"""One benchmark subject in its own process: `python -m engine.bench.worker SUBJECT MODEL_DIR`.

Contract: reads a JSON job on stdin ({"prompt_ids", "max_tokens", "trials", "profile"}),
runs a warm-up and `trials` greedy generations, and prints one JSON object on stdout with the
per-trial figures, all measured the same way for every subject from token arrival times:
ttft_s (prompt in, first token out), prompt_tps = prompt tokens / ttft_s, decode_tps =
(tokens - 1) / (last token time - first token time). Subjects: 'strata', 'mlx-lm'.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def _measure(stream: Callable[[], Iterator[int]], prompt_len: int) -> dict[str, Any]:
    import mlx.core as mx

    mx.reset_peak_memory()
    t0 = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    for tok in stream():
        times.append(time.perf_counter())
        tokens.append(tok)
    ttft = times[0] - t0
    span = times[-1] - times[0]
    return {
        "ttft_s": ttft,
        "prompt_tps": prompt_len / ttft,
        "decode_tps": (len(times) - 1) / span if span > 0 else 0.0,
        "generated_tokens": len(tokens),
        "tokens": tokens,
        "peak_memory_bytes": int(mx.get_peak_memory()),
    }


def run(subject: str, model_dir: Path, job: dict[str, Any]) -> dict[str, Any]:
    prompt: list[int] = job["prompt_ids"]
    max_tokens = int(job["max_tokens"])
    t_load = time.perf_counter()
    if subject == "mlx-lm":
        import mlx.core as mx
        from mlx_lm import load, stream_generate

        import engine  # noqa: F401  (same BLAS shim as Strata: same compute profile)
        from engine.platform import compute_profile
        from engine.runtime.model import apply_profile

        model, tok = load(str(model_dir))[:2]
        apply_profile(model, compute_profile(job.get("profile")))
        mx.eval(model.parameters())
        load_s = time.perf_counter() - t_load

        def stream() -> Iterator[int]:
            for r in stream_generate(model, tok, prompt, max_tokens=max_tokens):
                if r.finish_reason != "stop" or r.token not in tok.eos_token_ids:
                    yield int(r.token)
    elif subject == "strata":
        from engine.platform import compute_profile
        from engine.runtime.generate import LoadedModel, generate
        from engine.runtime.sampling import SamplingParams

        lm = LoadedModel.load(model_dir, profile=compute_profile(job.get("profile")))
        load_s = time.perf_counter() - t_load
        greedy = SamplingParams(temperature=0)

        def stream() -> Iterator[int]:
            for ev in generate(lm, prompt, greedy, max_tokens):
                if ev.token is not None:
                    yield ev.token
    else:
        raise SystemExit(f"unknown subject {subject!r}")
    _measure(stream, len(prompt))  # warm-up
    trials = [_measure(stream, len(prompt)) for _ in range(int(job["trials"]))]
    return {"subject": subject, "load_s": load_s, "trials": trials}


def main() -> int:
    subject, model_dir = sys.argv[1], Path(sys.argv[2])
    job = json.loads(sys.stdin.read())
    print(json.dumps(run(subject, model_dir, job)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

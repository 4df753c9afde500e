"""Constrained decoding's cost (not a test: a measurement, run by hand).

`python -m tests.engine.server.grammar_speed [MODEL] [RUNS]` decodes 96 greedy tokens with no
processor, with a no-op processor (decode then runs unpipelined, as with any processor) and
with a nested JSON schema's grammar, interleaved RUNS times, and prints each median decode
speed; then the grammar processor's own time per token inside one constrained run (the
model's step evaluated first, so only the mask is timed). Results: docs/server.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import mlx.core as mx

from engine.runtime.generate import LoadedModel, generate
from engine.runtime.grammar import GrammarProcessor, json_grammar
from engine.runtime.sampling import SamplingParams

TOKENS = 96
ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "integer"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "vip"]},
             "maxItems": 3}},
    "required": ["name", "address", "tags"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": ITEM}},
          "required": ["people"], "additionalProperties": False}


def main(model: str = "starter", runs: int = 5) -> None:
    lm = LoadedModel.load(model)
    grammar = json_grammar(SCHEMA)
    ids = lm.tokenizer.encode_chat([{"role": "user", "content":
                                     "List many people with addresses as JSON."}])

    def run(kind: str) -> float:
        procs: list[Any] = []
        if kind == "noop":
            procs.append(lambda h, x: x)
        elif kind == "grammar":
            procs.append(GrammarProcessor(lm.tokenizer, grammar))
        ev = list(generate(lm, ids, SamplingParams(temperature=0), TOKENS,
                           logits_processors=procs))[-1]
        assert ev.generated_tokens == TOKENS, (kind, ev.generated_tokens, ev.finish_reason)
        return ev.decode_tps

    res: dict[str, list[float]] = {k: [] for k in ("free", "noop", "grammar")}
    for _ in range(runs):
        for k, v in res.items():
            v.append(run(k))
    med = {k: statistics.median(v) for k, v in res.items()}
    for k, v in res.items():
        print(f"{k:8} median {med[k]:6.2f} tok/s  runs {[round(x, 2) for x in v]}")
    print(f"grammar vs free: {100 * (1 - med['grammar'] / med['free']):.1f}% slower; "
          f"vs no-op processor: {100 * (1 - med['grammar'] / med['noop']):.1f}%")

    proc = GrammarProcessor(lm.tokenizer, grammar)
    spent: list[float] = []

    def timed(history: list[int], logits: Any) -> Any:
        mx.eval(logits)  # the model's step, not the mask's
        t = time.perf_counter()
        out = proc(history, logits)
        mx.eval(out)
        spent.append(time.perf_counter() - t)
        return out

    t0 = time.perf_counter()
    for _ in generate(lm, ids, SamplingParams(temperature=0), TOKENS, logits_processors=[timed]):
        pass
    total = time.perf_counter() - t0
    print(f"mask: {1e6 * statistics.mean(spent):.0f} us/token mean, {1e6 * max(spent):.0f} max,"
          f" over {len(spent)} tokens; {100 * sum(spent) / total:.2f}% of the run's wall time")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "starter",
         int(sys.argv[2]) if len(sys.argv) > 2 else 5)

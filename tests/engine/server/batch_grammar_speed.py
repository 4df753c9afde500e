"""Grammar requests in the decode batch (not a test: a measurement, run by hand).

`python -m tests.engine.server.batch_grammar_speed [MODEL] [ROWS] [RUNS]` decodes ROWS requests
of 48 greedy tokens, each with grammar_speed's nested JSON schema: one after another through
`generate` (how the server ran them before they batched), then joined in one
engine.runtime.batch.Batch (how it runs them now), and ROWS unconstrained requests in one Batch
(what the masks cost inside a batch); interleaved RUNS times. Prints each median aggregate
tok/s and whether the batched tokens equal the sequential ones. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from engine.runtime.batch import Batch, Row
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.grammar import GrammarProcessor, json_grammar
from engine.runtime.sampling import SamplingParams
from tests.engine.server.grammar_speed import SCHEMA

TOKENS = 48
ASKS = ["List many people with addresses as JSON.", "Give me a JSON list of customers.",
        "Write JSON for three club members.", "People in a town, as JSON please.",
        "JSON: staff of a small shop.", "A JSON roster of a football team.",
        "JSON records of some neighbours.", "Guests at a party as JSON."]
GREEDY = SamplingParams(temperature=0)


def main(model: str = "starter", rows: int = 4, runs: int = 3) -> None:
    lm = LoadedModel.load(model)
    grammar = json_grammar(SCHEMA)
    prompts = [lm.tokenizer.encode_chat([{"role": "user", "content": q}])
               for q in ASKS[:rows]]

    def sequential() -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        out = [[ev.token for ev in generate(lm, ids, GREEDY, TOKENS, prefix_cache=False,
                                            logits_processors=[GrammarProcessor(lm.tokenizer,
                                                                                grammar)])
                if ev.token is not None] for ids in prompts]
        return time.perf_counter() - t0, out

    def batched(constrained: bool) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        batch = Batch(lm, max(rows, 1))
        out: list[list[int]] = [[] for _ in prompts]

        def sink(i: int) -> Callable[..., None]:
            return lambda ev: out[i].append(ev.token) if ev.token is not None else None

        for i, ids in enumerate(prompts):
            procs = [GrammarProcessor(lm.tokenizer, grammar)] if constrained else []
            batch.join(Row(ids, GREEDY, TOKENS, sink(i), processors=procs))
        while len(batch):
            batch.step()
        return time.perf_counter() - t0, out

    batched(True)  # warm: first-call costs
    figures: dict[str, list[float]] = {"sequential, grammar": [], "batched, grammar": [],
                                       "batched, no grammar": []}
    same = True
    for _ in range(runs):
        s_wall, s_out = sequential()
        b_wall, b_out = batched(True)
        p_wall, p_out = batched(False)
        same = same and s_out == b_out
        figures["sequential, grammar"].append(sum(map(len, s_out)) / s_wall)
        figures["batched, grammar"].append(sum(map(len, b_out)) / b_wall)
        figures["batched, no grammar"].append(sum(map(len, p_out)) / p_wall)
        print("  run: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in figures.items()),
              flush=True)
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"{rows} rows of {TOKENS} tokens, nested schema, {runs} runs (median aggregate tok/s)")
    for k, v in med.items():
        print(f"  {k:22} {v:6.1f}  (min {min(figures[k]):.1f}, max {max(figures[k]):.1f})")
    print(f"  batched / sequential: x{med['batched, grammar'] / med['sequential, grammar']:.2f}; "
          f"grammar in the batch: x{med['batched, grammar'] / med['batched, no grammar']:.2f} "
          f"of unconstrained; batched tokens equal sequential: {same}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "starter",
         int(sys.argv[2]) if len(sys.argv) > 2 else 4,
         int(sys.argv[3]) if len(sys.argv) > 3 else 3)

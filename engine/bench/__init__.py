"""Measurement, floor 4: every benchmark of Strata, the KV suites included, and the one entry
point of `strata bench`.

What lives here: quick.py (suites quick and full: Strata against mlx-lm and llama.cpp on the
same weights, each subject in a worker.py process); kv.py (paged KV decode against mlx-lm's
KVCache) with fill.py (synthetic KV fill), passkey.py (pass-key retrieval) and longrun.py
(one long context on the SSD tier); kvbits.py (KV pages at 8 and 4 bits: KL and bytes);
prefix.py (the SSD prefix cache and multi-turn reuse, each figure from a prefix_worker.py
process); importing.py (import time and peak memory per file, llama.cpp's load as the
peer); needle.py (a fact hidden in natural text, exact and sparse, RoPE past the trained
length); spec.py (speculative decoding against plain decoding: edit, summary, open chat);
cluster.py (a model split across 1, 2, 3 local ranks: speed, memory, bytes sent per token);
smoke.py (the engine's half of `strata --smoke`); and what they share: stats.py
(statistics, ratios, the result schema), system.py (RSS, I/O counters, dropping files from
the page cache), common.py (prompt ids, machine facts). Modules here may import every floor
below (the leaves, kv, library, runtime, importers, quant, server), never the window or the
command above.

Contract of this face: `add_arguments(parser)` adds the suite argument and every suite's
options to `strata bench`'s parser; `run_cli(args)` runs the chosen suite and returns its
exit code (0 done, 1 a subject failed, 130 interrupted, having kept what finished). This
module imports only argparse and importlib: every `strata` command builds the parser, and the
suites' child processes import this package before they choose what to load, so a suite's
modules are imported when it runs.
"""

from __future__ import annotations

import argparse
import importlib

SUITES = ("quick", "full", "kv", "prefix", "kvbits", "import", "stored", "needle", "serve",
          "spec", "restart", "cluster", "longctx")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite (default quick) and the options of every suite; each help says whose."""
    p.add_argument("suite", nargs="?", default="quick", choices=SUITES,
                   help="quick (about 2 minutes), full (depth sweep, KV modes), kv (paged KV "
                        "decode), prefix (the SSD prefix cache), kvbits (KV precision) or "
                        "import (import time and peak memory of --files), needle or longctx (a "
                        "fact in natural text, exact and sparse), spec (speculative decoding "
                        "against plain), restart (a real --context document prefilled, the process "
                        "restarted, the same answer), cluster (a model split across 1, 2, 3 "
                        "local ranks)")
    p.add_argument("--model", default="starter",
                   help="library name or alias; comma-separated for several (e.g. recipes)")
    p.add_argument("--depths", help="context depths, comma-separated (quick: 0,512)")
    p.add_argument("--prompt-tokens", type=int, help="prompt tokens after the depth")
    p.add_argument("--max-tokens", type=int, help="tokens generated per run")
    p.add_argument("--prefix-tokens", type=int, help="first-token test: shared prefix length")
    p.add_argument("--suffix-tokens", type=int, help="first-token test: tokens after it")
    p.add_argument("--trials", type=int, help="timed runs per figure (after a warm-up)")
    p.add_argument("--load-trials", type=int, help="cold and warm loads each")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", default="mlx-lm,llama.cpp",
                   help="comma-separated: mlx-lm, llama.cpp, or 'none'")
    p.add_argument("--kv-modes", help="extra Strata rows, one per KV mode beside the default "
                   "mode's row ('mlx': mlx-lm's cache; full: mlx,exact,sparse); 'none' for none")
    p.add_argument("--profile", help="compute profile (default: the backend's)")
    p.add_argument("--json", dest="json_out", help="write results to this file")
    p.add_argument("--csv", dest="csv_out", help="write one row per figure to this file")
    p.add_argument("--files", help="import: comma-separated GGUF files or model folders")
    _add_kv(p)
    _add_prefix(p)
    _add_kvbits(p)
    _add_needle(p)
    _add_spec(p)
    _add_serve(p)
    _add_cluster(p)


def _add_kv(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("kv suite")
    g.add_argument("--contexts", default="4096,16384",
                   help="kv: comma-separated context lengths (default 4096,16384)")
    g.add_argument("--modes", default="mlx,exact,sparse", help="kv: subjects to decode with")
    g.add_argument("--gen", type=int, default=32, help="kv: tokens generated per subject")
    g.add_argument("--kv-budget", type=int, default=2048, help="kv: sparse token budget")
    g.add_argument("--kv-ram-mb", type=int, help="kv: RAM tier budget (default: derived)")
    g.add_argument("--kv-bits", type=int, choices=(16, 8, 4), default=16,
                   help="kv: precision of the paged subjects' pages (mlx-lm's stays as "
                   "computed)")
    g.add_argument("--page-tokens", type=int, default=128, help="kv: tokens per page")
    g.add_argument("--prefill-paged", action="store_true",
                   help="kv: also prefill through the paged cache and compare logits")
    g.add_argument("--synthetic-fill", type=int, metavar="DOC_TOKENS",
                   help="kv: fill every context by tiling the KV of one real prefill of "
                   "DOC_TOKENS tokens (same KV for every subject; labelled synthetic)")
    g.add_argument("--passkey", action="store_true",
                   help="kv: pass-key retrieval table, exact and sparse, instead of speed")
    g.add_argument("--passkey-lengths", default="2048,4096,8192",
                   help="kv --passkey: prompt lengths in tokens")
    g.add_argument("--passkey-depths", default="10,30,50,70,90",
                   help="kv --passkey: key depths in percent of the filler")
    g.add_argument("--passkey-fraction", type=float, default=0.25,
                   help="kv --passkey: sparse budget as a fraction of the prompt")
    g.add_argument("--context", type=int, metavar="TOKENS",
                   help="kv: one long context held mostly on the SSD tier (e.g. 1000000): "
                   "synthetic fill unless --end-to-end")
    g.add_argument("--end-to-end", action="store_true",
                   help="kv --context: real prefill of a pass-key prompt, then its answer")
    g.add_argument("--exact-tokens", type=int, default=2,
                   help="kv --context: tokens decoded in exact mode (0: skip it)")
    g.add_argument("--kv-dtype", choices=("float16", "float32"),
                   help="kv --context: page dtype (default: the model's compute dtype)")
    g.add_argument("--fill-doc", type=int, default=4096,
                   help="kv --context: tokens of the real document tiled by the fill")


def _add_prefix(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefix suite")
    g.add_argument("--system-tokens", type=int, default=1500,
                   help="prefix: system prompt length for the cold first-token chat")
    g.add_argument("--prefix-parts",
                   help="prefix: which measurements, comma-separated (default: all three): "
                        "restore (the 2k-prefix restore against prefill, mlx-lm and the "
                        "disk), chat (cold first token), turns (first token of each turn of "
                        "a multi-turn chat)")
    g.add_argument("--turns", type=int,
                   help="prefix: turns of the multi-turn chat (default and most: all of the "
                        "suite's questions)")
    g.add_argument("--turn-tokens", type=int, default=32,
                   help="prefix: greedy tokens each reply of the multi-turn chat may have")


def _add_kvbits(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("kvbits suite")
    g.add_argument("--bits", default="16,8,4",
                   help="kvbits: KV precisions, comma-separated; 16 is the reference")
    g.add_argument("--groups", default="",
                   help="kvbits: quantization group sizes to try, comma-separated (32,64,128; "
                        "default: the engine's default for each bit width)")
    g.add_argument("--paged-modes", default="exact",
                   help="kvbits: paged KV modes to measure (exact, sparse); the reference is "
                        "exact 16-bit")
    g.add_argument("--prefill-tokens", type=int, default=4096,
                   help="kvbits: tokens of text prefilled (default 4096)")
    g.add_argument("--decode-steps", type=int, default=32,
                   help="kvbits: teacher-forced decode steps after the prefill (default 32)")
    g.add_argument("--text", help="kvbits: text to prefill (default: the shared wikitext-2 "
                                  "test set)")


def _add_needle(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("needle suite")
    g.add_argument("--needle-lengths", default="4096,8192",
                   help="needle: prompt lengths in tokens, comma-separated")
    g.add_argument("--needle-depths", default="10,20,30,40,50,60,70,80,90",
                   help="needle: fact depths in percent of the prose")
    g.add_argument("--needle-budgets", default="768",
                   help="needle: sparse budgets in tokens (sinks and window included)")
    g.add_argument("--needle-modes", default="exact,sparse", help="needle: exact, sparse")
    g.add_argument("--needle-kinds", default="number",
                   help="needle: facts hidden, comma-separated: number, name, quote")
    g.add_argument("--needle-ask", default="after,both",
                   help="needle: where the question is asked, comma-separated: after (the "
                        "prose) or both (before and after it)")
    g.add_argument("--needle-rope", choices=("none", "yarn", "both"), default="both",
                   help="needle: past the trained length, run the model as trained (none), "
                        "with YaRN RoPE scaling (yarn) or both")


def _add_serve(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serve suite")
    g.add_argument("--clients", default="1,2,4,8",
                   help="serve: concurrent streaming clients, comma-separated (default 1,2,4,8)")
    g.add_argument("--requests", type=int, default=8,
                   help="serve: greedy requests each configuration sends (default 8)")


def _add_spec(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("spec suite")
    g.add_argument("--drafters", default="auto",
                   help="spec: drafters against plain decoding, comma-separated (auto, lookup, "
                        "a draft model's name; the peer: mlx-lm, mlx-lm:MODEL for its "
                        "speculative path with MODEL)")
    g.add_argument("--spec-tasks", default="edit,summary,chat1,chat2",
                   help="spec: tasks, comma-separated (edit, summary, chat1, chat2)")


def _add_cluster(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster suite")
    g.add_argument("--cluster-ranks", default="1,2,3",
                   help="cluster: rank counts, comma-separated (each a fresh group)")
    g.add_argument("--cluster-split", choices=("tensor", "pipeline"),
                   help="cluster: force the split (default: tensor where it divides)")


# Each suite's module, by suite name (needle: longctx is issue 19's name for the same suite);
# any other suite (quick, full) is quick.py's.
SUITE_MODULES = {
    "kv": "kv", "prefix": "prefix", "import": "importing", "kvbits": "kvbits",
    "stored": "stored", "spec": "spec", "needle": "needle", "longctx": "needle",
    "restart": "restart", "cluster": "cluster", "serve": "serve",
}


def run_cli(args: argparse.Namespace) -> int:
    """Run `args.suite` (parsed by a parser `add_arguments` set up); its exit code."""
    # Imported here, the chosen suite's alone (see the module docstring).
    name = SUITE_MODULES.get(args.suite, "quick")
    suite = importlib.import_module(f"engine.bench.{name}")
    code: int = suite.run(args)
    return code

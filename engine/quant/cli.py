"""The `strata quantize`, `strata recipes` and `strata eval` subcommands, and the recipe options
`strata import` shares.

Contract: `add_commands(sub, open_source=..., progress=...)` adds the three parsers; the
command that registers them (the composition root) injects how to open a source (a library
model's name, a folder or a .gguf file: engine.importers.open_source, which this package may
not import) and its progress printer (label -> progress(done, total)). Each command prints its
result on stdout (JSON with --json) and progress on stderr; errors are StrataError lines,
printed by the command. `requantize_from_args(args)` is the Requantize that `strata import`'s
recipe options ask for (None without --recipe). `strata eval` reads library models through
engine.runtime (LoadedModel): a library model is an MLX folder, no importer is involved.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ImportFailed
from engine.library.store import Library
from engine.quant.recipes import builtin_names, resolve_recipe
from engine.quant.source import QuantSource
from engine.telemetry import Progress

if TYPE_CHECKING:
    from engine.quant.quantize import Requantize

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
OpenSource = Callable[[str, Library], QuantSource]  # (name or path, library) -> source
ProgressPrinter = Callable[[str], Progress]  # label -> progress(done, total)


def cmd_quantize(args: argparse.Namespace, open_source: OpenSource,
                 progress: ProgressPrinter) -> int:
    from engine.quant.quantize import quantize  # start-up: MLX loads when a command runs

    lib = Library()
    m = quantize(lib, open_source(args.source, lib), args.recipe, args.name,
                 target_bpw=args.bpw, calibration=calibration_from_args(args),
                 calibration_tokens=args.calibration_tokens, method=args.method,
                 progress=progress("quantizing"), replace=args.replace,
                 awq_grid=args.awq_grid)
    print_quantized(m, args.json)
    return 0


def requantize_from_args(args: argparse.Namespace) -> Requantize | None:
    """The Requantize that `--recipe` and the options beside it ask for; None without --recipe
    (the weights are kept as stored), where --method, --bpw and --awq-grid are an error."""
    if args.recipe is None:
        if args.method != "rtn" or args.bpw is not None or args.awq_grid != 20:
            raise ImportFailed("--method, --bpw and --awq-grid need --recipe (the weights are "
                               "kept as stored)")
        return None
    from engine.quant.quantize import Requantize  # start-up: MLX loads when an import runs

    return Requantize(args.recipe, method=args.method, target_bpw=args.bpw,
                      calibration=calibration_from_args(args),
                      calibration_tokens=args.calibration_tokens, awq_grid=args.awq_grid)


def calibration_from_args(args: argparse.Namespace) -> Path | None:
    """--calibration, else tinyshakespeare where a recipe or method needs calibration text."""
    if args.calibration:
        return Path(args.calibration)
    if args.recipe == "auto" or args.method != "rtn":
        default = SHARED_DATA / "tinyshakespeare.txt"
        return default if default.is_file() else None
    return None


def print_quantized(m: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(m, indent=2, sort_keys=True))
        return
    r = m["recipe"]
    how = f" ({r['method']}, {r['calibration_tokens']} tokens of {r['calibration']})" \
        if r.get("method") else ""
    print(f"quantized {m['name']} with {r['name']}{how} "
          f"({m['bytes'] / 1e6:.1f} MB, {m['bits_per_weight']} bits/weight)")
    for cls, formats in r["tensors"].items():
        print(f"  {cls:9} " + ", ".join(f"{k} x{v}" for k, v in formats.items()))


def add_recipe_arguments(p: argparse.ArgumentParser, required: bool) -> None:
    """The options `strata quantize` and `strata import` share."""
    p.add_argument("--recipe", required=required,
                   help="built-in name (see `strata recipes`), 'auto', or a .toml/.json file")
    p.add_argument("--method", default="rtn",  # checked by the engine: one-line errors
                   help="rounding: rtn (round to nearest, default), imatrix (rounding "
                        "weighted by calibration activations; best measured), or calibrated "
                        "through mlx-lm's gptq, awq or dwq")
    p.add_argument("--bpw", type=float, help="with --recipe auto: target bits per weight")
    p.add_argument("--calibration", metavar="FILE",
                   help="calibration text for --recipe auto and --method "
                        "imatrix/gptq/awq/dwq "
                        "(default: ../shared/data/tinyshakespeare.txt)")
    p.add_argument("--calibration-tokens", type=int, default=2048, metavar="N",
                   help="calibration tokens (default 2048)")
    # 20 is engine.quant.quantize.AWQ_GRID, not imported: the parser builds before MLX loads.
    p.add_argument("--awq-grid", type=int, default=20, metavar="N",
                   help="with --method awq: the points its scale and clip searches try "
                        "(mlx-lm's --n-grid; default 20; fewer is faster and coarser)")


def cmd_recipes(args: argparse.Namespace) -> int:
    for name in builtin_names():
        r = resolve_recipe(name)
        print(f"{name:20} {r.description}")
    print(f"{'auto':20} sensitivity-guided allocation for --bpw BITS (calibrated on text)")
    return 0


def cmd_eval(args: argparse.Namespace, progress: ProgressPrinter) -> int:
    from engine.quant.evaluate import evaluate  # start-up: the runtime loads when eval runs

    lib = Library()
    cache: dict[Any, Any] = {}
    results = []
    for model in args.model:
        r = evaluate(lib, model, args.reference, Path(args.text), tokens=args.tokens,
                     window=args.window, progress=progress(f"evaluating {model}"),
                     cache=cache)
        results.append(r.to_dict())
        if not args.json:
            print(f"{r.model}: ppl {r.perplexity:.3f} (reference {r.reference_perplexity:.3f}), "
                  f"KL {r.kl_mean:.4f}, top-1 {100 * r.top1_agreement:.1f}%, "
                  f"{r.bits_per_weight} bits/weight, {(r.bytes_on_disk or 0) / 1e6:.1f} MB, "
                  f"peak {r.peak_memory_bytes / 1e6:.0f} MB, {r.generation_tps:.1f} tok/s "
                  f"[{r.tokens} tokens, {r.profile}]", flush=True)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2,
                         sort_keys=True))
    return 0


def add_commands(sub: Any, open_source: OpenSource, progress: ProgressPrinter) -> None:
    """Add quantize, recipes and eval to argparse subparsers `sub`; see the module docstring."""
    p = sub.add_parser("quantize", help="quantize a model by recipe into a new library model")
    p.add_argument("source", help="library model, MLX or Hugging Face folder, or .gguf file")
    add_recipe_arguments(p, required=True)
    p.add_argument("--name", required=True, help="library name of the new model")
    p.add_argument("--replace", action="store_true", help="replace a model of the same name")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda args: cmd_quantize(args, open_source, progress))

    p = sub.add_parser("recipes", help="list the built-in quantization recipes")
    p.set_defaults(func=cmd_recipes)

    p = sub.add_parser("eval", help="perplexity and KL divergence against a reference model")
    p.add_argument("--model", action="append", required=True,
                   help="library model to measure (repeatable: one reference pass for all)")
    p.add_argument("--reference", required=True, help="library model to compare against")
    p.add_argument("--text", required=True, help="evaluation text file (UTF-8)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens to evaluate (default 4096)")
    p.add_argument("--window", type=int, default=1024,
                   help="tokens per window; each window starts fresh (default 1024)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda args: cmd_eval(args, progress))

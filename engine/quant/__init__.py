"""Quantization by recipe, sensitivity-guided allocation, calibrated methods, and evaluation.

What lives here: recipes as plain data (recipes.py); `quantize` and `Requantize` (quantize.py),
which turn a source model the caller opened (a QuantSource, source.py) and a recipe into a new
library model, rounding to nearest (rounding.py), weighted by activation importance
(importance.py), allocated by sensitivity (sensitivity.py), or calibrated through mlx-lm's
quant module in a child process (methods.py: the parent's side; calibrated.py: the child's);
`import_options`/`expected_sizes` for the import dialog; `evaluate` (evaluate.py), a model
measured against a reference; and the `strata quantize/recipes/eval` subcommands (cli.py).
Quantization takes arrays, a config and a plan: it never reads a GGUF, Hugging Face or MLX
source itself (engine.importers does; an import with a recipe is composed by its caller).
Nothing here imports transformers or mlx_lm's package __init__ into the calling process; the
child does.

Floor 3: imports engine.runtime, engine.kv, engine.library and the leaves (engine.errors,
engine.telemetry, engine.platform); never engine.importers or engine.server (the same floor),
never the app.
"""

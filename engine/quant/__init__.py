"""Quantization by recipe, sensitivity-guided allocation, calibrated methods, and evaluation.

Contract: recipes (engine.quant.recipes) are plain data; `quantize` (engine.quant.quantize)
turns a source model and a recipe into a new library model, rounding to nearest or, with a
calibrated method, through mlx-lm's quant module in a child process (engine.quant.calibrated);
`evaluate` (engine.quant.evaluate) measures a model against a reference. Nothing here imports
transformers or mlx_lm's package __init__ into the calling process; the child does.
"""

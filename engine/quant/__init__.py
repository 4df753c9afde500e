"""Quantization by recipe, sensitivity-guided allocation, and quality evaluation.

Contract: recipes (engine.quant.recipes) are plain data; `quantize` (engine.quant.quantize)
turns a source model and a recipe into a new library model; `evaluate`
(engine.quant.evaluate) measures a model against a reference. Nothing here imports
transformers or mlx_lm's package __init__.
"""

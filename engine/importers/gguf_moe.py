"""GGUF mixture-of-experts architectures, registered into engine.importers.gguf_arch.

Contract: importing this module registers the MoE families (and the variants that pick them,
such as Mixtral, which llama.cpp writes as "llama" with an expert count); stacked expert
tensors (`*_exps`, (experts, out, in)) map onto mlx-lm's switch layers.
"""

from __future__ import annotations

"""Runtime: load a library model, tokenize, sample and generate. One thread owns MLX."""

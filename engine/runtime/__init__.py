"""The runtime (floor 2): load a library model, turn messages into token ids, generate.

What lives here: model.py (an mlx-lm model from an MLX folder, compute profiles, the memory
check, the model's identity), tokenizer.py, sampling.py, generate.py (LoadedModel,
PromptCache, the decode loop, ChatSession), pool.py (ModelPool: the one owner of the loaded
model, its KV settings, prefix cache, prompt caches and their LRU, prewarm and the memory
figures), readahead.py. May import the KV layer and the library (floor 1), the leaves, MLX
and mlx-lm's model files; never the importers, quant, server, bench or the app.
"""

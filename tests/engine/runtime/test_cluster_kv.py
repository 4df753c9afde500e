"""The paged KV cache on a split model, and what each rank holds, against one process.

Real ranks on loopback (engine.runtime.cluster.start_local, the real starter model): a greedy
reply in paged exact mode with small pages (so that the prompt commits pages, not only a
tail) over a tensor split of 3 equals the unsplit model's in the same mode, token for token
and logits within 1e-4; rank 0 pages the KV of its own head; each rank's weight bytes are its
share of the whole. (The pipeline split in paged mode, each rank paging its own layers, and
its exact per-rank weights are in test_cluster_faults.py, on the ranks left after a fault.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.kv import KVSettings
from engine.runtime.cluster_split import share_bytes

REPO = Path(__file__).resolve().parents[3]
TOKENS = 6
PAGE = 16  # the prompt (about 50 tokens) fills pages and leaves a tail
PROMPT = ("Here is a list of fruits: apple, banana, cherry, grape, lemon, mango, orange, "
          "peach, pear, plum. Which of them is yellow?")

DRIVER = """
import json, sys
from pathlib import Path
import numpy as np
from engine.kv import KVSettings
from engine.runtime.cluster import start_local
from engine.runtime.generate import generate
from engine.runtime.sampling import SamplingParams
model, ranks, tokens, page, kvdir, out, prompt = sys.argv[1:]
kv = KVSettings(mode="exact", page_tokens=int(page), ram_mb=64, ssd_dir=Path(kvdir))
cluster = start_local(model, int(ranks), timeout=60, kv=kv)
logits = []
def capture(history, x):
    logits.append(np.array(x).astype(np.float32).reshape(-1))
    return x
with cluster:
    lm = cluster.lm
    pc = lm.new_cache()
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    toks = [ev.token for ev in generate(lm, ids, SamplingParams(temperature=0.0), int(tokens),
                                        logits_processors=[capture], prefix_cache=False,
                                        drafter="off", prompt_cache=pc)
            if ev.token is not None]
    kinds = sorted({type(c).__name__ for c in pc.cache})
    heads = sorted({c.store.kv_heads for c in pc.cache})
    layers = len(pc.cache)
    ranks_info = cluster.ranks
    mode = cluster.plan.mode
np.save(out, np.stack(logits))
print(json.dumps({"tokens": toks, "mode": mode, "kinds": kinds, "heads": heads,
                  "layers": layers, "ranks": ranks_info}))
"""


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["STRATA_HOME"] = str(home)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def reference(starter_lm: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, paged exact with the same pages: greedy tokens and each step's logits."""
    from engine.runtime.generate import generate
    from engine.runtime.sampling import SamplingParams

    logits: list[np.ndarray] = []

    def capture(history: list[int], x: Any) -> Any:
        logits.append(np.array(x).astype(np.float32).reshape(-1))
        return x

    before = starter_lm.kv_settings
    starter_lm.kv_settings = KVSettings(mode="exact", page_tokens=PAGE, ram_mb=64,
                                        ssd_dir=tmp_path_factory.mktemp("kv-one"))
    try:
        pc = starter_lm.new_cache()
        ids = starter_lm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
        assert len(ids) > 2 * PAGE
        toks = [ev.token for ev in generate(starter_lm, ids, SamplingParams(temperature=0.0),
                                            TOKENS, logits_processors=[capture],
                                            prefix_cache=False, prompt_cache=pc,
                                            drafter="off")
                if ev.token is not None]
        assert {type(c).__name__ for c in pc.cache} == {"PagedLayerCache"}
        pc.close()
    finally:
        starter_lm.kv_settings = before
    return {"tokens": toks, "logits": np.stack(logits), "bytes": share_bytes(starter_lm.model),
            "embed": share_bytes(starter_lm.model.model.embed_tokens)
            + share_bytes(starter_lm.model.model.norm)}


def _split(starter: Any, home: Path, tmp: Path, ranks: int) -> dict[str, Any]:
    out = tmp / f"logits-{ranks}.npy"
    proc = subprocess.run([sys.executable, "-c", DRIVER, starter["path"], str(ranks),
                           str(TOKENS), str(PAGE), str(tmp / "kv"), str(out), PROMPT],
                          env=_env(home), cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["logits"] = np.load(out)
    return result


def _same_reply(split: dict[str, Any], reference: dict[str, Any]) -> None:
    assert split["kinds"] == ["PagedLayerCache"]
    assert split["tokens"] == reference["tokens"]
    assert len(split["tokens"]) == TOKENS
    diff = float(np.abs(split["logits"] - reference["logits"]).max())
    assert diff < 1e-4, diff


def test_paged_exact_over_a_tensor_split_of_3_equals_one_process(
        starter: Any, strata_home: Path, tmp_path: Path, reference: dict[str, Any]) -> None:
    split = _split(starter, strata_home, tmp_path, 3)
    assert split["mode"] == "tensor"
    _same_reply(split, reference)
    # Rank 0's pages hold its own KV head (3 KV heads over 3 ranks) for all 30 layers.
    assert (split["heads"], split["layers"]) == ([1], 30)
    # Weights: every rank holds the embedding and the norms whole (mlx-lm's shard leaves
    # them), and a third of each layer's matrices; the layers' small norm vectors (30 x 2 x
    # 576 floats, 0.03 % of the whole) are whole on every rank, hence the 0.5 % tolerance.
    full, whole = reference["bytes"], reference["embed"]
    want = whole + (full - whole) / 3
    got = [r["weights_bytes"] for r in split["ranks"]]
    assert [r["rank"] for r in split["ranks"]] == [0, 1, 2]
    for b in got:
        assert abs(b - want) < 0.005 * want, (got, want)

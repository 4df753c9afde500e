"""`strata bench cluster`'s measurement on real local ranks (engine.bench.cluster.measure).

One short greedy reply of the starter on 2 ranks (a pipeline split) in the suite's own child
process: the bytes counted from the tensors per decoded token are the pipeline's (one hidden
state of 576 float32 plus the 8-int32 header's share of the ring), the kernel's per-socket
TCP counters agree with them, and each rank reports its share's weights and its memory.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from engine.bench.cluster import measure


def test_two_ranks_measured_bytes_agree_with_the_tensors_sent(
        starter: Any, strata_home: Path) -> None:
    r = measure(starter["path"], 2, prompt_tokens=16, max_tokens=4, timeout=300)
    assert (r["ranks"], r["split"], r["generated_tokens"]) == (2, "pipeline", 4)
    assert r["ttft_s"] > 0 and r["decode_tps"] > 0
    # Pipeline: rank 0 sends the hidden state (576 x 4 bytes) and its part of the header's
    # all_sum (2 (N-1)/N x 32 bytes); so does rank 1 (back to rank 0).
    assert r["sent_bytes_per_token_counted"] == 576 * 4 + 32
    if shutil.which("ss"):
        for got in r["sent_bytes_per_token_measured"]:
            assert abs(got - r["sent_bytes_per_token_counted"]) < 0.1 * 2336, r
    ranks = r["per_rank"]
    assert [p["rank"] for p in ranks] == [0, 1]
    assert ranks[0]["weights_bytes"] > ranks[1]["weights_bytes"] > 0  # rank 0: + embedding
    for p in ranks:
        assert p["rss_after_bytes"] > p["weights_bytes"]

"""`strata bench stored` on the starter model, tiny: a stored context built without a
forward pass is restored whole by a fresh process in each paged mode (the 128k figure in
docs/benchmarks.md is the same command at full size)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers import run_strata


def test_a_stored_context_is_restored_by_fresh_processes(starter: dict[str, Any],
                                                         strata_home: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "stored.json"
    r = run_strata("bench", "stored", "--context", "1024", "--fill-doc", "256",
                   "--paged-modes", "sparse,exact", "--gen", "2", "--json", str(out),
                   home=strata_home)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["synthetic"] and res["build"]["stored_tokens"] == 1024
    sparse, exact = res["ask"]
    assert sparse["mode"] == "sparse" and exact["mode"] == "exact"
    # The first asker prefills its question after the restored pages and stores that tail;
    # the second finds the whole prompt, logits included.
    assert sparse["cached_tokens"] == 1024 < sparse["prompt_tokens"]
    assert exact["cached_tokens"] == exact["prompt_tokens"] == sparse["prompt_tokens"]
    assert 0 < exact["peak_rss_bytes"] and "cache restore" in exact["phases"]

"""`strata bench restart` on the starter model, small: real text prefilled by one process,
asked again by fresh ones, the same greedy tokens (the 16k figure in docs/benchmarks.md is
the same command at full size)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.helpers import run_strata


def test_a_restarted_process_gives_the_first_ones_answer(starter: dict[str, Any],
                                                        strata_home: Path,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "restart.json"
    r = run_strata("bench", "restart", "--context", "700", "--kv-modes", "sparse",
                   "--kv-budget", "512", "--max-tokens", "6", "--json", str(out),
                   home=strata_home)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert not res["synthetic"] and res["equal"]
    (row,) = res["rows"]
    first, again, pages = row["first"], row["restart"], row["restart_pages_only"]
    assert first["cached_tokens"] == 0 and first["tokens"]
    # The whole prompt comes back with its tail; without tails, the full pages only.
    assert again["cached_tokens"] == again["prompt_tokens"] == first["prompt_tokens"]
    assert pages["cached_tokens"] == first["prompt_tokens"] // 128 * 128
    assert again["tokens"] == pages["tokens"] == first["tokens"]

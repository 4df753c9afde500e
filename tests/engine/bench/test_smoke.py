"""`strata --smoke` in a checkout: one JSON line."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_strata


def test_smoke_prints_one_json_line(starter: dict, strata_home: Path) -> None:  # type: ignore[type-arg]
    proc = run_strata("--smoke", home=strata_home, env={"QT_QPA_PLATFORM": "offscreen"})
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    report = json.loads(line)
    assert report["ok"] is True and report["frozen"] is False
    assert report["model"] == starter["name"] and report["token"]
    assert report["backend"] in ("cpu", "metal", "cuda", "gpu")
    assert set(report["versions"]) >= {"strata", "mlx", "mlx_lm", "pyside6", "qt", "python"}
    assert report["timings"]["fetch_import_s"] < 1  # the session's library has the starter
    assert report["timings"]["load_s"] > 0 and report["timings"]["first_token_s"] > 0

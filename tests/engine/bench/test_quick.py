"""`strata bench`: statistics and ratios on controlled inputs, the schema, a tiny real run."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.bench.stats import (
    compute_ratios,
    csv_rows,
    flat_figures,
    ratio,
    stat,
    validate,
    write_csv,
)

REPO = Path(__file__).resolve().parents[3]
TINY = ["--trials", "1", "--load-trials", "1", "--depths", "0,32", "--prompt-tokens", "16",
        "--max-tokens", "4", "--prefix-tokens", "24", "--suffix-tokens", "8"]


def _s(*values: float) -> dict[str, float]:
    return stat(values)


def _run(subject: str, decode: float, load: float) -> dict[str, Any]:
    return {"model": "m", "setting": "default", "subject": subject, "status": "complete",
            "load": {"cold_s": _s(load), "warm_s": _s(load / 2), "phases": {},
                     "cache_dropped": True, "note": ""},
            "depths": [{"depth": 0, "prompt_tokens": 8, "ttft_s": _s(0.1), "prompt_tps": _s(80),
                        "decode_tps": _s(decode, decode + 2, decode - 1),
                        "generated_tokens": 4}],
            "memory": {"rss_bytes": 10, "rss_peak_bytes": 20, "footprint_bytes": None,
                       "mlx_active_bytes": 5, "mlx_peak_bytes": 8, "kv_bytes": None}}


def test_stat_is_median_min_max_over_trials() -> None:
    assert stat([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert stat([4, 1, 2, 10]) == {"median": 3.0, "min": 1.0, "max": 10.0, "n": 4}
    assert stat([5])["median"] == 5.0
    with pytest.raises(ValueError):
        stat([])


def test_ratio_is_strata_median_over_peer_median() -> None:
    assert ratio(_s(10, 20, 30), _s(5, 10, 100)) == pytest.approx(2.0)
    assert ratio(_s(1), _s(0)) is None  # a peer that measured nothing gives no ratio
    assert ratio(None, _s(1)) is None


def test_flat_figures_and_ratios_per_figure() -> None:
    ours, peer = _run("strata", decode=20.0, load=1.0), _run("mlx-lm", decode=10.0, load=2.0)
    figs = flat_figures(ours)
    assert figs["decode_tps@0"] == {"median": 20.0, "min": 19.0, "max": 22.0, "n": 3}
    assert "footprint_bytes" not in figs  # None on Linux: absent, never 0
    assert figs["mlx_peak_bytes"]["median"] == 8
    (r,) = compute_ratios([ours, peer])
    assert r["peer"] == "mlx-lm"
    assert r["figures"]["decode_tps@0"] == pytest.approx(2.0)
    assert r["figures"]["load_cold_s"] == pytest.approx(0.5)
    assert r["figures"]["rss_peak_bytes"] == pytest.approx(1.0)


def test_csv_has_a_row_per_figure_and_the_ratio(tmp_path: Path) -> None:
    ours, peer = _run("strata", 20.0, 1.0), _run("mlx-lm", 10.0, 2.0)
    result = {"runs": [ours, peer], "ratios": compute_ratios([ours, peer])}
    rows = csv_rows(result)
    row = next(r for r in rows if r["subject"] == "strata" and r["figure"] == "decode_tps@0")
    assert row["ratio_vs_mlx-lm"] == pytest.approx(2.0) and row["unit"] == "tok/s"
    write_csv(result, tmp_path / "b.csv")
    with open(tmp_path / "b.csv") as fh:
        assert len(list(csv.DictReader(fh))) == len(rows)


def test_the_validator_finds_schema_violations() -> None:
    sch = {"type": "object", "required": ["a"], "$defs": {"n": {"type": "integer"}},
           "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"enum": ["x"]}},
           "additionalProperties": False}
    assert validate({"a": 1}, sch) == []
    assert validate({}, sch) == ["$: missing 'a'"]
    assert validate({"a": True}, sch)  # a bool is not an integer
    assert validate({"a": 1, "b": "y"}, sch)
    assert validate({"a": 1, "c": 0}, sch) == ["$: unexpected 'c'"]


def test_a_tiny_quick_run_writes_a_complete_valid_result(starter: dict[str, Any],
                                                         tmp_path: Path) -> None:
    from app.cli import main

    out, table = tmp_path / "b.json", tmp_path / "b.csv"
    rc = main(["bench", "quick", "--peers", "mlx-lm,llama.cpp", *TINY, "--json", str(out),
               "--csv", str(table)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert validate(result) == []
    assert result["complete"] is True
    runs = {r["subject"]: r for r in result["runs"]}
    llama = result["machine"]["llama_cpp_python"] is not None  # an optional extra
    assert set(runs) == {"strata", "mlx-lm"} | ({"llama.cpp"} if llama else set())
    for r in runs.values():
        assert r["status"] == "complete"
        assert [d["depth"] for d in r["depths"]] == [0, 32]
        assert all(d["generated_tokens"] == 4 for d in r["depths"])  # EOS ignored
        # Draft counts, there for every subject: none drafts in the rows that compare (the
        # Strata subject's default row decodes undrafted, as mlx-lm's stream_generate does).
        assert all(d["drafted_tokens"] == d["accepted_tokens"] == 0 for d in r["depths"])
        assert r["ttft"]["cached"]["cached_tokens"] == 24
        assert r["memory"]["rss_peak_bytes"] > 50e6
        assert r["load"]["cold_s"]["median"] > 0
    assert {"cache lookup", "prefill", "first decode", "load"} <= set(
        runs["strata"]["ttft"]["uncached"]["phases"])
    r = next(x for x in result["ratios"] if x["peer"] == "mlx-lm")
    assert r["same_tokens"] is True
    assert len(result["ratios"]) == (2 if llama else 1)
    assert {"ttft_s", "ttft_cached_s", "prompt_tps@0", "decode_tps@32",
            "load_warm_s"} <= set(r["figures"])
    if not llama:
        assert result["skipped"][0]["subject"] == "llama.cpp"
    assert "decode_tps@32" in table.read_text()


def test_ctrl_c_keeps_what_finished(starter: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "partial.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "bench", "quick", "--peers", "mlx-lm", *TINY,
         "--json", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=dict(os.environ), start_new_session=True,
        # As from a terminal, even when the suite runs with SIGINT ignored (a background job).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    deadline = time.monotonic() + 120
    for line in proc.stderr:  # wait until the first subject has its loads done
        if "first token" in line or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    result = json.loads(out.read_text())
    assert validate(result) == []
    assert result["complete"] is False and result["interrupted"] is True
    assert result["runs"][0]["status"] == "partial"
    assert result["runs"][0]["load"]["warm_s"]["n"] == 1


def test_a_paged_setting_reports_kv_per_tier_and_disk_traffic(
        starter: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.cli import main

    monkeypatch.delenv("STRATA_KV_MODE", raising=False)  # the product's own default

    out = tmp_path / "b.json"
    tiny = [*TINY[:4], "--depths", "0,300", *TINY[6:]]  # 300 tokens: two full 128-token pages
    # exact is the default mode: the default row is the page store's, and names it once.
    rc = main(["bench", "quick", "--peers", "none", "--kv-modes", "exact,mlx", *tiny,
               "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert validate(result) == []
    assert result["settings"]["default_kv_mode"] == "exact"
    assert [r["setting"] for r in result["runs"]] == ["default", "kv=mlx"]
    paged = next(r for r in result["runs"] if r["setting"] == "default")
    deep = paged["depths"][-1]
    # Prompt and generated tokens come on top of the depth: at least 2 pages per layer.
    assert deep["kv_ram_bytes"] >= 2 * 30 * 2 * 3 * 128 * 64 * 4
    assert paged["memory"]["kv_ram_bytes"] == deep["kv_ram_bytes"]
    assert paged["memory"]["kv_ssd_bytes"] >= 0
    if sys.platform == "linux":  # psutil reports storage I/O there
        assert paged["io"]["seconds"] > 0 and paged["io"]["write_bytes"] >= 0
        figures = flat_figures(paged)
        assert {"kv_ram_bytes", "kv_ssd_bytes", "ssd_read_mbs", "ssd_write_mbs"} <= set(figures)
    mlx = next(r for r in result["runs"] if r["setting"] == "kv=mlx")
    assert "kv_ram_bytes" not in mlx["memory"]  # mlx-lm's KVCache has no tiers


def test_strata_rows_against_peers_are_undrafted_and_full_adds_a_drafted_row() -> None:
    """Like with like: quick's Strata rows decode undrafted (the peers draft nothing); the
    full suite adds a row of its own for Strata's auto drafter."""
    import argparse

    from engine.bench.quick import plan

    def rows(suite: str) -> list[str]:
        args = argparse.Namespace(suite=suite, peers="mlx-lm", seed=0)
        return list(plan(args)["draft_rows"])

    assert rows("quick") == []
    assert rows("full") == ["auto"]


def test_the_default_row_runs_the_default_kv_mode_and_mlx_is_a_row_of_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain Strata row is the product's default path (the page store in exact mode), not
    mlx-lm's cache; that cache is an explicit, labelled row, and no mode runs twice."""
    import argparse

    from engine.bench.quick import plan

    monkeypatch.delenv("STRATA_KV_MODE", raising=False)

    def modes(suite: str, kv_modes: str | None = None) -> tuple[str, list[str]]:
        p = plan(argparse.Namespace(suite=suite, peers="mlx-lm", seed=0, kv_modes=kv_modes))
        return p["default_kv_mode"], list(p["kv_modes"])

    assert modes("quick") == ("exact", [])
    assert modes("full") == ("exact", ["mlx", "sparse"])
    assert modes("quick", "mlx,exact,mlx") == ("exact", ["mlx"])
    monkeypatch.setenv("STRATA_KV_MODE", "mlx")
    assert modes("full") == ("mlx", ["exact", "sparse"])

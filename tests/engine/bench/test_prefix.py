"""`strata bench prefix`: the summary of each part from controlled figures, the I/O floor's
file reads, its user errors, and a tiny run of every part on the starter model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from engine.bench.prefix import files_read_speed, run, summarize
from engine.errors import StrataError


def test_summary_of_the_turns_part_alone() -> None:
    rows = [{"turn": i + 1, "prompt_tokens": 100 + 20 * i, "cached_tokens": 90 + 20 * i,
             "new_tokens": 10, "first_token_s": 0.5, "ttft_s": 0.4, "generated_tokens": 3}
            for i in range(3)]
    out = summarize({"turns": {"turns": rows, "last_without_reuse_s": 2.0}})
    assert out["turns"] == 3 and out["turn_last_reuse_speedup"] == 4.0
    assert out["turn_last_over_median_of_turns_2_on"] == 1.0
    assert "restore_s" not in out and "chat_cold_cached_s" not in out


def test_summary_of_the_restore_part_compares_medians() -> None:
    hit = {"restore_s": 0.1, "bytes_read": 100_000_000, "ttft_s": 0.5, "tokens": [2, 3]}
    res = {"uncached": {"ttft_s": 20.0, "prefill_s": 19.0, "tokens": [2, 3]},
           "hit": [hit, {**hit, "restore_s": 0.2}, {**hit, "restore_s": 0.05}],
           "mlxlm_load": [{"load_s": 0.1, "file_bytes": 100_000_000}],
           "disk": {"buffered_gbps": 2.0, "direct_gbps": 1.0},
           "disk_again": [{"buffered_gbps": g} for g in (0.5, 2.0, 1.0)],
           "files_read": [{"gbps": g} for g in (1.0, 3.0, 1.25)]}
    out = summarize(res)
    assert out["restore_gbps"] == pytest.approx(1.0)
    assert out["restore_fraction_of_disk"] == pytest.approx(0.5)
    assert out["restore_fraction_of_disk_again"] == pytest.approx(1.0)
    # Pairs (restart, probe just before it): 1.0/0.5, 0.5/2.0, 2.0/1.0 -> median 2.0.
    assert out["restore_fraction_of_disk_paired"] == pytest.approx(2.0)
    assert out["files_read_gbps"] == 1.25
    assert out["restore_fraction_of_files_read"] == pytest.approx(0.8)
    assert out["tokens_compared"] == 2 and out["outputs_equal"] and out["restores_cold"]


def test_files_read_speed_reads_every_byte(tmp_path: Path) -> None:
    files = []
    for i in range(3):
        f = tmp_path / f"{i}.bin"
        f.write_bytes(bytes([i]) * (300_000 + i))
        files.append(f)
    out = files_read_speed(files)
    assert out["files"] == 3 and out["gbps"] > 0 and out["s"] > 0


def test_unknown_parts_are_a_user_error(starter: Any) -> None:
    args = argparse.Namespace(trials=1, prefix_tokens=256, prefix_parts="restore,speed",
                              turns=10, turn_tokens=4, model=starter["name"], profile=None,
                              system_tokens=64, json_out=None)
    with pytest.raises(StrataError, match="speed"):
        run(args)




def test_a_tiny_run_measures_every_part(starter: Any, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Every child mode runs (build, hit, mlxlm-load, chat, mlxlm-chat, turns) and the
    restored prefix gives the prefilled output."""
    out = tmp_path / "prefix.json"
    args = argparse.Namespace(trials=1, prefix_tokens=256, prefix_parts=None, turns=2,
                              turn_tokens=4, model=starter["name"], profile=None,
                              system_tokens=64, json_out=str(out))
    assert run(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["outputs_equal"] and summary["tokens_compared"] == 4
    assert summary["restore_s"] > 0 and summary["mlxlm_load_s"] > 0
    assert summary["chat_cold_cached_s"] > 0 and summary["chat_cold_mlxlm_s"] > 0
    assert summary["turns"] == 2 and len(summary["turn_first_token_s"]) == 2
    res = json.loads(out.read_text())
    assert res["parts"] == ["restore", "chat", "turns"] and res["summary"] == summary

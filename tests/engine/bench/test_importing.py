"""`strata bench import` through the real command: each file imported in a fresh process
into an empty library, timed, its peak memory read from the OS, llama.cpp's load beside it;
a file that does not import makes the suite exit 1 with the reason."""

from __future__ import annotations

import json
from pathlib import Path

from tests.engine.gguf_factory import ModelSpec, bpe_vocab, write_gguf
from tests.helpers import run_strata


def test_import_suite_times_each_file_and_reports_failures(tmp_path: Path) -> None:
    good = write_gguf(tmp_path / "tiny.gguf", ModelSpec(hidden=64, heads=4, kv_heads=2,
                                                        ffn=128), "Q8_0", bpe_vocab()[0]).path
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    out = tmp_path / "r.json"
    done = run_strata("bench", "import", "--files", f"{good},{bad}", "--trials", "1",
                      "--json", str(out), home=tmp_path / "home", timeout=300)
    assert done.returncode == 1, done.stderr
    result = json.loads(out.read_text())
    ok, failed = result["results"]
    assert ok["ok"] and ok["bytes"] == good.stat().st_size
    assert 0 < ok["seconds_median"] < 120 and ok["peak_rss_median"] > 10 * 2**20
    assert not failed["ok"] and "truncated" in failed["runs"][0]["error"]
    if result["machine"]["llama_cpp_python"] is not None:
        assert ok["llama_cpp_load"]["ok"] and ok["llama_cpp_load"]["seconds_median"] > 0
    assert not (tmp_path / "home" / "models").exists() or not any(
        (tmp_path / "home" / "models").iterdir())  # each import had its own empty home

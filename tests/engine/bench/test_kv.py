"""KV benchmarks on the real starter model, at small sizes: pass key, synthetic fill, long run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from engine.bench.fill import doc_kv, fill_paged, tiled_mlx_cache
from engine.bench.longrun import LongOptions, estimate_prefill_s, format_long, run_long
from engine.bench.passkey import passkey_prompt, passkey_table, run_passkey, sparse_matches_exact
from engine.kv import KVSettings, make_paged_cache
from engine.kv.cache import close_caches


def test_passkey_prompt_and_exact_finds_the_key(starter_lm: Any) -> None:
    ids = passkey_prompt(starter_lm.tokenizer, 1024, 0.3, "12345")
    text = starter_lm.tokenizer.decode(ids)
    assert 900 <= len(ids) <= 1024 and "12345" in text
    assert text.index("12345") < len(text) * 0.5  # the key sits in the first half
    seen: list[Any] = []
    cells = run_passkey(starter_lm, [1024], [0.5], ("exact", "sparse"), page_tokens=32,
                        sink_tokens=32, window_tokens=64, on_cell=seen.append)
    assert [c.mode for c in cells] == ["exact", "sparse"] and seen == cells
    exact, sparse = cells
    assert exact.found, exact
    assert sparse.budget_tokens <= exact.length // 4
    table = passkey_table(cells)
    assert "| 1,024 | exact |" in table and "50%" in table
    assert sparse_matches_exact(cells) == sparse.found


def test_synthetic_fill_pages_verify_and_decode(starter_lm: Any, tmp_path: Path) -> None:
    import mlx.core as mx

    lm = starter_lm
    doc = doc_kv(lm, 256, page_tokens=64)
    assert doc.tokens == 256 and doc.keys[0].shape[2] == 256
    n = 1024
    settings = KVSettings(mode="exact", page_tokens=64, sink_tokens=64, window_tokens=128,
                          budget_tokens=512, ram_mb=1, ssd_dir=tmp_path).validate()
    paged = make_paged_cache(lm.model, settings)
    store = paged[0].store
    try:
        fill_paged(paged, doc, n)
        store.flush()
        assert all(c.offset == n for c in paged)
        st = store.stats()
        assert st["pages_ssd"] == 30 * n // 64 and st["evictions"] > 0  # RAM of 5 pages a layer
        # Every record on disk passes its checksum and holds the document's KV, tiled.
        for layer in (0, 29):
            for page in range(n // 64):
                _, k, v = store._file(layer).read(page)  # checks the CRC
                a = page * 64 % doc.tokens
                assert np.array_equal(k, np.array(doc.keys[layer][0, :, a:a + 64]))
                assert np.array_equal(v, np.array(doc.values[layer][0, :, a:a + 64]))
        # Exact decode over the filled store equals mlx-lm's over the same tiled KV.
        ref = tiled_mlx_cache(doc, n)
        y = mx.argmax(doc.logits, axis=-1)
        a = lm.model(y[None], cache=ref)[:, -1, :]
        b = lm.model(y[None], cache=paged)[:, -1, :]
        assert float(mx.abs(a - b).max()) < 1e-3
        assert store.stats()["ssd_reads"] > 0
    finally:
        close_caches(paged)


def test_long_run_synthetic_and_end_to_end(starter_lm: Any, tmp_path: Path) -> None:
    lines: list[str] = []
    opts = LongOptions(context=2048, gen=3, exact_tokens=2, page_tokens=64,
                       budget_tokens=1024, ram_mb=1, doc_tokens=256, sample_s=0.05,
                       ssd_dir=tmp_path)
    rep = run_long(starter_lm, opts, lines.append)
    assert rep["complete"], rep
    assert "synthetic" in rep["fill"] and rep["pages_ssd"] == 30 * 2048 // 64
    for mode, tokens in (("sparse", 3), ("exact", 2)):
        row = rep["modes"][mode]
        assert row["tokens"] == tokens and row["decode_tps"] > 0
    # A sparse step reads each page at most once (the rescored shortlist's pages are kept for
    # the step's attention), so never more pages than exact mode, which reads every cold one.
    assert rep["modes"]["exact"]["pages_read_per_token"] >= rep["modes"]["sparse"][
        "pages_read_per_token"] > 0
    assert rep["peak_rss"] > 0 and rep["rss_series"] and "fill" in rep["rss_by_phase"]
    text = format_long(rep, starter_lm)
    assert "synthetic" in text and "sparse" in text
    assert not any(tmp_path.iterdir())  # the session's page files went with the store

    e2e = run_long(starter_lm, LongOptions(context=768, modes=("exact",), exact_tokens=10,
                                           end_to_end=True,
                                           page_tokens=64, budget_tokens=1024, ram_mb=1,
                                           ssd_dir=tmp_path), lines.append)
    assert e2e["complete"] and e2e["fill"].startswith("real prefill")
    assert e2e["modes"]["exact"]["found"], e2e["modes"]["exact"]
    assert estimate_prefill_s([(0, 9.0), (512, 1.0), (1024, 2.0), (1536, 3.0)], 2048) == 6.0


def test_bench_kv_output_shape(starter: Any, tmp_path: Path, capsys: Any) -> None:
    from app.cli import main

    out = tmp_path / "kv.json"
    assert main(["bench", "kv", "--contexts", "512", "--synthetic-fill", "256", "--gen", "3",
                 "--kv-budget", "1024", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "KV fill: synthetic" in printed and "x mlx" in printed
    doc = json.loads(out.read_text())
    assert doc["schema"] == "strata-bench-kv/2" and doc["complete"]
    rows = {r["mode"]: r for r in doc["rows"]}
    assert set(rows) == {"mlx", "exact", "sparse"}
    assert rows["exact"]["tokens_same_as_mlx"] == "3/3"
    assert all(r["decode_tps"] > 0 and r["fill"].startswith("synthetic") for r in rows.values())


def test_bench_kv_sparse_rows_select_within_the_contiguous_limit(starter: Any, tmp_path: Path
                                                                 ) -> None:
    """A 2,048-token context with a 768 budget: the store starts in exact mode, where the
    cache keeps every position in one buffer. The sparse row must still select, so its
    first step's logits differ from mlx-lm's. Before `follow_settings` they were equal to the
    last bit, because the sparse run read the exact buffer."""
    from app.cli import main

    out = tmp_path / "kv.json"
    assert main(["bench", "kv", "--contexts", "2048", "--synthetic-fill", "256", "--gen", "2",
                 "--kv-budget", "768", "--modes", "mlx,exact,sparse",
                 "--json", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["exact"]["max_abs_logit_diff_step1"] < 1e-3
    assert rows["sparse"]["max_abs_logit_diff_step1"] > 1e-3


def test_bench_kv_times_no_write_a_fill_left_behind(starter_lm: Any, tmp_path: Path) -> None:
    """A synthetic fill hands the pages past the cache's buffer to the first decode step,
    which queues a few a step for the SSD (`write_behind`); a real prefill has written them
    by then. `bench kv` settles them after its untimed first step, so the timed steps decode
    at that depth and write nothing of the fill."""
    from engine.bench.fill import paged_cache
    from engine.bench.kv import _decode, _fill_from

    lm = starter_lm
    doc = doc_kv(lm, 256, page_tokens=64)
    n = 4096
    settings = KVSettings(mode="exact", page_tokens=64, budget_tokens=768,
                          ssd_dir=tmp_path).validate()
    for settle in (False, True):
        paged, store = paged_cache(lm.model, settings)  # filled in exact mode, as bench kv
        try:
            _fill_from(paged, tiled_mlx_cache(doc, n))
            store.settings = settings.with_(mode="sparse")
            for c in paged:
                c.follow_settings()
            waiting: list[int] = []
            _decode(lm, paged, doc.logits, 2, (lambda s=store, w=waiting: (
                s.flush(), w.append(sum(map(len, s._behind))))) if settle else None)
            left = sum(map(len, store._behind))
            if settle:
                assert waiting == [0] and left == 0
            else:
                assert left > 0  # 64 pages a layer, 16 a step: what settling spares the steps
        finally:
            close_caches(paged)

"""The memory panel: real figures after loading, 'unavailable' for counters that do not exist."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from app.main import MainWindow
from app.memory.view import snapshot_figures
from engine.platform import memory_snapshot
from tests.app.conftest import LOAD_TIMEOUT_MS, WindowFactory


def _megabytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1e-6, "KB": 1e-3, "MB": 1.0, "GB": 1e3}[unit]


def test_the_panel_shows_the_weights_after_loading(make_window: WindowFactory,
                                                   qtbot: Any) -> None:
    window: MainWindow = make_window()
    with qtbot.waitSignal(window.engine.model_loaded, timeout=LOAD_TIMEOUT_MS):
        pass
    with qtbot.waitSignal(window.engine.memory_sampled, timeout=LOAD_TIMEOUT_MS):
        pass
    panel = window.memory
    assert panel.accessibleName() == "Memory panel"
    assert _megabytes(panel.value_text("weights")) > 50  # 135M parameters
    assert _megabytes(panel.value_text("rss")) > 50
    assert _megabytes(panel.value_text("mlx_active")) > 50
    assert _megabytes(panel.value_text("total")) > 100
    # The default KV mode is the page store's exact mode: its SSD tier is a figure.
    assert panel.value_text("kv_ssd") != "unavailable"
    assert panel.value_text("prefix_disk") != "unavailable"  # on, even if still empty
    assert panel.value_text("prefix_disk").endswith(" of a 4.3 GB budget")  # 4096 MiB
    assert panel.model_name == "smollm2-135m-instruct"


def test_missing_counters_read_unavailable_never_zero() -> None:
    figures = snapshot_figures(memory_snapshot(weights_bytes=None, kv_ram_bytes=None))
    assert figures["kv_ssd"] == "unavailable"
    assert figures["prefix_disk"] == "unavailable"
    assert figures["prefix_disk"] != "0 B"
    assert figures["weights"] == "no model loaded"
    assert figures["compressed"] == "unavailable"
    assert figures["kv_ram"] == "no model loaded"
    assert figures["kv_shared"] == "paged KV off"
    assert figures["prefix_hits"] == "prefix cache off"
    figures = snapshot_figures(memory_snapshot(kv_shared_bytes=3_000_000, prefix_hits=3,
                                               prefix_lookups=4))
    assert figures["kv_shared"] == "3.0 MB" and figures["prefix_hits"] == "3 of 4 prompts (75%)"
    assert figures["store_pages"] == "prefix cache off"
    figures = snapshot_figures(replace(memory_snapshot(), store_pages=1200, store_shared_pages=14,
                                       store_asked_pages=32, store_found_pages=14))
    assert figures["store_pages"] == "1,200 pages, 14 shared; 14 of 32 pages asked found (44%)"


def test_the_chart_takes_each_replys_phases(qtbot: Any) -> None:
    from app.memory.chart import LatencyChart, split_phases

    stats = {"ttft_s": 0.3, "decode_tps": 12.0,
             "phases": {"load": 1.5, "cache lookup": 0.001, "prefill": 0.2, "first decode": 0.05,
                        "something new": 0.01}}
    assert [p for p, _ in split_phases(stats)] == ["load", "cache lookup", "prefill",
                                                   "first decode", "other"]
    chart = LatencyChart()
    qtbot.addWidget(chart)
    chart.resize(600, 300)
    chart.set_replies([stats, {"ttft_s": 0.2, "decode_tps": 15.0}])
    assert len(chart.replies) == 2
    assert not chart.grab().isNull()  # paints without error

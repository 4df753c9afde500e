"""The Macs list: a real waiting `strata join` found by mDNS on loopback and typed by address.

Real parts: the waiter is its own process advertising with the real zeroconf on the loopback
interface (STRATA_MDNS_INTERFACE, so the test stays off the real network); the view browses
and asks it from its own thread, the rows arrive through the Qt event loop (offscreen); the
preflight line uses the real library and this machine's memory, capped as a smaller Mac's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from PySide6.QtCore import Qt

from app.cluster.view import ClusterView
from engine.runtime.cluster import free_ports
from tests.engine.runtime import cluster_fixtures

waiter = cluster_fixtures.waiter  # the shared `strata join` (cluster_fixtures.py)


def test_a_typed_mac_is_listed_with_its_memory_and_mlx_and_offered_to_run_across(
        qtbot: Any, starter: Any, library: Any, waiter: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", "400")  # this Mac too small for the starter
    monkeypatch.setenv("STRATA_CONTEXT", "2048")
    view = ClusterView(starter["name"], library)
    qtbot.addWidget(view)
    view.address.setText(waiter)
    with qtbot.wait_signal(view.peers_changed, timeout=20_000):
        qtbot.mouseClick(view.add_button, Qt.MouseButton.LeftButton)
    assert view.table.rowCount() == 1
    row = [view.table.item(0, c).text() for c in range(1, 6)]
    assert row[1] == waiter and row[3] == mx.__version__
    assert " GB free of " in row[2]
    assert view.chosen() == [waiter]
    text = view.fit_label.text()
    assert "does not fit this Mac alone" in text
    # The waiter is this machine: its free memory is far more than the 400 MB cap here.
    assert "run across 2 Macs (pipeline split)" in text, text
    assert view.run_button.isEnabled() and view.run_button.text() == "&Run across 2 Macs"
    with qtbot.wait_signal(view.run_across_requested) as sent:
        qtbot.mouseClick(view.run_button, Qt.MouseButton.LeftButton)
    assert sent.args == [starter["name"], [waiter]]
    # Unchecked: nothing to run across, the button goes off.
    view.table.item(0, 0).setCheckState(Qt.CheckState.Unchecked)
    assert not view.run_button.isEnabled()


def test_a_waiting_mac_is_found_by_mdns(qtbot: Any, starter: Any, library: Any, waiter: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_MDNS_INTERFACE", "127.0.0.1")
    view = ClusterView(starter["name"], library)
    qtbot.addWidget(view)
    with qtbot.wait_signal(view.peers_changed, timeout=20_000):
        qtbot.mouseClick(view.find_button, Qt.MouseButton.LeftButton)
    assert waiter in view.peers, view.peers
    assert view.peers[waiter].mlx == mx.__version__


def test_a_typed_address_with_nobody_there_is_one_line(qtbot: Any, starter: Any,
                                                        library: Any) -> None:
    view = ClusterView(starter["name"], library)
    qtbot.addWidget(view)
    port = free_ports(1)[0]
    with qtbot.wait_signal(view.failed, timeout=20_000) as failed:
        view.add(f"127.0.0.1:{port}")
    assert failed.args[0].startswith(f"127.0.0.1:{port}: no Strata waiting there")
    assert view.status.text() == failed.args[0]
    assert view.table.rowCount() == 0


def test_the_engine_menu_opens_the_macs_list_for_the_default_model(
        qtbot: Any, make_window: Any, starter: Any) -> None:
    window = make_window(preload=False, fetch_starter=False)
    qtbot.wait_until(lambda: window.is_ready, timeout=20_000)
    window.macs_action.trigger()
    dialog = window.macs_dialog
    assert dialog is not None and dialog.isVisible()
    assert dialog.view.model == starter["name"]
    assert "Run across several Macs…" in [a.text() for a in window.menuBar().actions()[-1]
                                         .menu().actions()]


def test_run_across_loads_the_model_split_and_replies_as_one_process(
        qtbot: Any, make_window: Any, starter: Any, library: Any, waiter: str) -> None:
    from app.worker import ReplyRequest
    from engine.runtime.pool import ModelPool
    from engine.runtime.sampling import SamplingParams
    from tests.app.conftest import LOAD_TIMEOUT_MS

    question = "Name three colours."
    pool = ModelPool(library)
    try:
        want = "".join(ev.text for ev in pool.reply(
            1, starter["name"], question, params=SamplingParams(temperature=0.0), max_tokens=8))
    finally:
        pool.close()
    window = make_window(preload=False, fetch_starter=False)
    qtbot.wait_until(lambda: window.is_ready, timeout=20_000)
    window.macs_action.trigger()
    assert window.macs_dialog is not None
    with qtbot.wait_signal(window.engine.model_loaded, timeout=LOAD_TIMEOUT_MS) as loaded:
        window.macs_dialog.view.run_across_requested.emit(starter["name"], [waiter])
    ranks = loaded.args[0]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # Rank 0's group came from the environment for its init only: a process this one starts
    # later must not wait for the group (a quantization child hung on it).
    import os

    assert "MLX_HOSTFILE" not in os.environ and "MLX_RANK" not in os.environ
    assert loaded.args[0]["weights_bytes"] == ranks[0]["weights_bytes"]
    deltas: list[str] = []
    window.engine.reply_delta.connect(lambda _job, text: deltas.append(text))
    with qtbot.wait_signal(window.engine.reply_finished, timeout=LOAD_TIMEOUT_MS):
        window.engine.reply(ReplyRequest(chat_id=7, model=starter["name"], text=question,
                                         temperature=0.0, max_tokens=8))
    assert "".join(deltas) == want
    # The memory panel: a row a Mac, each with its share's weights and its own KV (Mac 2's
    # asked on the control line while the model stays loaded).
    rows = window.memory.macs.rows

    def both_rows() -> None:
        assert not window.memory.macs.isHidden() and len(rows) == 2
        assert "KV not reported yet" not in rows[1].text(), rows[1].text()

    qtbot.wait_until(both_rows, timeout=10_000)
    assert rows[0].text().startswith("this Mac") and rows[1].text().startswith("Mac 2")
    # The prefix cache is on: each Mac's row shows its own page store.
    qtbot.wait_until(lambda: all("prefix pages" in r.text() for r in rows), timeout=10_000)
    assert not window.memory.values["prefix_disk"].toolTip().startswith("prefix cache off")


def test_the_memory_panel_shows_a_row_a_mac_for_a_split_model(qtbot: Any) -> None:
    from app.memory.view import MemoryPanel  # the panel's own module, as the window uses it
    from engine.platform import memory_snapshot
    from engine.runtime.cluster import ClusterMemorySnapshot

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    one = memory_snapshot(326_000_000, 1_200_000)
    panel.show_snapshot(one)
    assert panel.macs.isHidden()  # one Mac: no rows
    fields = {f: getattr(one, f) for f in one.__dataclass_fields__}
    ranks = ({"rank": 0, "host": "mac-1", "weights_bytes": 326_000_000, "kv_bytes": 1_200_000,
              "rss_bytes": 516_000_000, "total_bytes": 24_000_000_000},
             {"rank": 1, "host": "mac-2", "weights_bytes": 212_000_000, "kv_bytes": None,
              "rss_bytes": 356_000_000, "total_bytes": 64_000_000_000})
    panel.show_snapshot(ClusterMemorySnapshot(**fields, ranks=ranks))
    assert not panel.macs.isHidden()
    assert panel.macs.title() == "Each Mac (model split across 2)"
    texts = [label.text() for label in panel.macs.rows]
    assert texts[0].startswith("this Mac (mac-1): weights 326") and "KV 1.2" in texts[0]
    assert texts[1].startswith("Mac 2 (mac-2): weights 212") and "KV not reported yet" in texts[1]
    panel.show_snapshot(one)  # back on one Mac
    assert panel.macs.isHidden()

"""The Discover tab against a hub-compatible server on loopback (HF_ENDPOINT), in the window.

Real parts: Qt offscreen, the window's hub threads and engine thread, real HTTP (the fake Hub
of tests/engine/importers/test_hub.py, serving the starter's GGUF at a network's pace), real
files under STRATA_HOME. A search shows the repository and its variants with a fit verdict;
a download is dropped mid-file (resumed by Range at once), paused, the window closed; a new
window lists it paused, Resume finishes it, the checksum matches and the model is imported.
A download whose bytes do not match the Hub's sha256 is refused in one line and the library
is left empty.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.main import MainWindow
from tests.app.conftest import REPLY_TIMEOUT_MS, WindowFactory
from tests.engine.importers.test_hub import FakeHub, _env

REPO_ID = "bartowski-ish/SmolLM2-135M-Instruct-GGUF"
Q4 = "SmolLM2-135M-Instruct-Q4_1.gguf"
Q8 = "SmolLM2-135M-Instruct-Q8_0.gguf"
MB = 1 << 20


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    from engine.importers.starter import starter_gguf

    data = starter_gguf().read_bytes()
    server = FakeHub()
    server.add(REPO_ID, {"README.md": b"# GGUF\n", Q4: data, Q8: data + bytes(30 * MB)},
               tags=["gguf", "llama"], params=134_515_008, architecture="llama",
               downloads=1234)
    server.add("someone/Qwen3-0.6B-MLX-4bit", {"README.md": b"x"}, tags=["mlx", "qwen3"],
               params=600_000_000, architecture="qwen3", downloads=99)
    server.pace = 0.004  # about 250 MB/s: a pause lands mid-file
    server.start()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _env(server.url, Path("/nonexistent-hf-home")).items():
            if value is None:
                mp.delenv(key, raising=False)
            else:
                mp.setenv(key, value)
        yield server
    server.stop()


def _search(window: MainWindow, qtbot: Any, text: str) -> None:
    view = window.discover.view
    window.show_view("discover")
    assert window.tabs.currentWidget() is view
    with qtbot.waitSignal(window.discover.variants_shown, timeout=REPLY_TIMEOUT_MS):
        view.search_box.setText(text)
        view.search_button.click()


def _ready(window: MainWindow, qtbot: Any) -> None:
    if window.engine.profile is None:  # the fit needs the compute profile
        with qtbot.waitSignal(window.engine.profile_chosen, timeout=REPLY_TIMEOUT_MS):
            pass


def _models(home: Path) -> list[str]:
    folder = home / "models"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_search_download_drop_pause_restart_resume_import(
        hub: FakeHub, make_window: WindowFactory, tmp_path: Path, qtbot: Any) -> None:
    home = tmp_path / "home"
    window = make_window(home=home, fetch_starter=False, preload=False)
    _ready(window, qtbot)
    _search(window, qtbot, "smollm2")
    view = window.discover.view
    assert view.results.repo_ids() == [REPO_ID]
    assert view.results.index(0, 1).data() == "llama"
    assert view.results.index(0, 2).data() == "135M"
    assert [v.label for v in view.variants.variants()] == [Q4, Q8]
    assert view.variants.index(0, 1).data() == "98.4 MB"
    assert view.variants.index(0, 3).data() == "fits at 8,192 tokens"
    assert float(view.variants.index(0, 2).data()) < float(view.variants.index(1, 2).data())
    assert "weights" in view.variants.index(0, 3).data(0x03)  # the tooltip has the numbers

    hub.ranges.clear()
    hub.drops[Q4] = 30 * MB  # the connection drops 30 MB into the file
    view.select_variant(0)
    paused: list[bool] = []

    def pause_past_60_mb(_job: int, done: int, _total: int) -> None:
        if done >= 60 * MB and not paused:
            paused.append(True)
            row.pause_button.click()

    window.discover._fetcher.worker.progressed.connect(pause_past_60_mb)
    with qtbot.waitSignal(window.discover.download_paused, timeout=REPLY_TIMEOUT_MS) as info:
        view.download_button.click()
        (key,) = window.discover.downloads
        row = view.rows[key]
    folder = Path(info.args[0])
    part = folder / (Q4 + ".part")
    kept = part.stat().st_size
    assert 60 * MB <= kept < 98_362_432
    assert row.state == "paused" and row.resume_button.isVisible()
    assert [r for _, r in hub.ranges] == [f"bytes={30 * MB}-"]  # the drop, resumed at once
    assert _models(home) == []
    window.close()
    window.shutdown()

    # A restart: the download is listed paused, and Resume finishes it from its part.
    again = make_window(home=home, fetch_starter=False, preload=False)
    again.show_view("discover")
    row = again.discover.view.rows[str(folder)]
    assert row.state == "paused" and "Paused at" in row.status.text()
    with qtbot.waitSignal(again.discover.download_done, timeout=REPLY_TIMEOUT_MS) as done:
        row.resume_button.click()
    _, ok, name = done.args
    assert ok, name
    assert name == "smollm2-135m-instruct-q4_1"
    assert hub.ranges[-1][1] == f"bytes={kept}-"
    assert _models(home) == [name]
    assert again.library.model.names() == [name]
    assert not folder.exists()  # the download's files go once the library holds the model
    assert "Imported into the library" in row.status.text()
    m = again.library.model.manifest(0)
    assert m is not None and m["source_format"] == "gguf"
    assert m["source"].startswith(f"hub:{REPO_ID}@") and m["source"].endswith(Q4)
    assert again.library.model.index(0, 6).data() == "GGUF file (Hugging Face Hub)"
    from engine.importers.starter import SHA256

    assert hashlib.sha256(hub.repos[REPO_ID][Q4]).hexdigest() == SHA256


def test_a_checksum_mismatch_is_refused_and_nothing_is_imported(
        hub: FakeHub, make_window: WindowFactory, tmp_path: Path, qtbot: Any) -> None:
    home = tmp_path / "home"
    window = make_window(home=home, fetch_starter=False, preload=False)
    _ready(window, qtbot)
    hub.corrupt.add(Q4)
    try:
        _search(window, qtbot, "SmolLM2-135M")
        view = window.discover.view
        view.select_variant(0)
        with qtbot.waitSignal(window.discover.download_done, timeout=REPLY_TIMEOUT_MS) as done:
            view.download_button.click()
    finally:
        hub.corrupt.discard(Q4)
    folder, ok, message = done.args
    assert not ok
    assert "\n" not in message and "checksum mismatch" in message and Q4 in message
    row = view.rows[folder]
    assert "checksum mismatch" in row.status.text()
    assert sorted(p.name for p in Path(folder).iterdir()) == ["download.json"]
    assert _models(home) == [] and window.library.model.rowCount() == 0
    row.cancel_button.click()  # Dismiss: its folder goes too
    assert not Path(folder).exists() and folder not in view.rows


def test_filters_narrow_the_search(hub: FakeHub, make_window: WindowFactory, tmp_path: Path,
                                   qtbot: Any) -> None:
    window = make_window(home=tmp_path / "home", fetch_starter=False, preload=False)
    view = window.discover.view
    view.format_box.setCurrentIndex(view.format_box.findData("mlx"))
    with qtbot.waitSignal(window.discover.results_shown, timeout=REPLY_TIMEOUT_MS) as shown:
        view.search_box.setText("")
        view.search_box.returnPressed.emit()
    assert shown.args == [1] and view.results.repo_ids() == ["someone/Qwen3-0.6B-MLX-4bit"]
    view.format_box.setCurrentIndex(0)
    view.size_box.setCurrentIndex(1)  # up to 1B: both
    view.arch_box.setCurrentIndex(view.arch_box.findData("qwen3"))
    with qtbot.waitSignal(window.discover.results_shown, timeout=REPLY_TIMEOUT_MS) as shown:
        view.search_button.click()
    assert view.results.repo_ids() == ["someone/Qwen3-0.6B-MLX-4bit"]
    view.arch_box.setCurrentIndex(0)
    view.size_box.setCurrentIndex(2)  # 1B to 4B: neither
    with qtbot.waitSignal(window.discover.results_shown, timeout=REPLY_TIMEOUT_MS) as shown:
        view.search_button.click()
    assert shown.args == [0] and "Nothing found" in view.status.text()
    for widget in (view.search_box, view.format_box, view.arch_box, view.size_box,
                   view.search_button, view.download_button, view.results_table,
                   view.variants_table):
        assert widget.accessibleName(), widget

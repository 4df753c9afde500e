"""Will it fit, in the window and the command: the import dialog and the library show weights
plus KV at the chosen context against this machine's memory; a model that does not fit is
refused with the numbers and the largest context that would fit offered instead.

Real parts: Qt offscreen, the engine thread, the starter model (its GGUF file and its library
folder), the `strata` command in a subprocess; STRATA_MAX_MEMORY_MB makes the machine small.
The starter in float32 (Linux CPU) holds 0.54 GB of weights, 0.12 GB of codes its decode steps
read (engine.runtime.packed) and 46,080 bytes of KV per token: 1.03 GB at its 8,192 tokens, so
under an 810 MiB cap it fits up to 4,096 tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from app.library.model import COLUMNS, MEMORY
from tests.app.conftest import REPLY_TIMEOUT_MS, WindowFactory
from tests.app.library.test_library import _drop, _library_state
from tests.helpers import run_strata

CAP_MB = "810"  # the weights fit, the full 8,192-token context does not
OFFER = 4096


def _float32() -> bool:
    from engine.platform import compute_profile
    from engine.runtime import packed

    return compute_profile().dtype == "float32" and packed.applies("float32")


pytestmark = pytest.mark.skipif(not _float32(), reason="the numbers are the float32 profile's "
                                "with packed codes (x86-64 with AVX2)")


def test_import_dialog_refuses_what_does_not_fit_and_imports_at_the_offered_context(
        make_window: WindowFactory, tmp_path: Path, qtbot: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.importers.starter import starter_gguf

    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", CAP_MB)
    monkeypatch.delenv("STRATA_CONTEXT", raising=False)
    home = tmp_path / "home"
    window = make_window(home=home, fetch_starter=False, preload=False)
    dropped = tmp_path / "Big One.gguf"
    shutil.copyfile(starter_gguf(), dropped)
    with qtbot.waitSignal(window.library.import_planned, timeout=REPLY_TIMEOUT_MS) as planned:
        _drop(window, dropped)
    dialog = window.library.dialogs[planned.args[0]]
    fit = dialog.option_fit()
    assert fit is not None and not fit.fits and fit.max_context == OFFER
    assert dialog.fit_label.text().startswith(
        "<b>does not fit: weights 0.65 GB + KV 0.38 GB at 8,192 tokens = 1.03 GB of 0.85 GB "
        "available (STRATA_MAX_MEMORY_MB)</b>")
    message = dialog.message.text()
    assert "does not fit in memory at 8,192 tokens" in message
    assert f"It would fit with a context of up to {OFFER:,} tokens" in message
    assert not dialog.import_button.isEnabled()  # refused before anything runs
    assert dialog.offer_button.isVisibleTo(dialog)
    assert dialog.offer_button.text() == f"Use {OFFER:,} tokens"
    # Every recipe weighs the same here (float32 once loaded): none fits at 8,192 either.
    dialog.select_recipe("q4-g64")
    assert not dialog.import_button.isEnabled()
    dialog.select_recipe("")

    # The engine refuses it too, if asked past the dialog: one line, the library untouched.
    with qtbot.waitSignal(window.library.import_done, timeout=REPLY_TIMEOUT_MS) as refused:
        window.library.engine.import_path(dropped)
    _job, ok, reason = refused.args
    assert not ok and reason.startswith("Big One.gguf: needs about 1.03 GB")
    assert f"up to {OFFER:,} tokens" in reason and "\n" not in reason
    assert not (home / "models").exists() or _library_state(home) == []

    dialog.offer_button.click()  # take the offer
    assert dialog.context_box.value() == OFFER
    assert dialog.fit_label.text().startswith("fits: weights 0.65 GB + KV 0.19 GB at 4,096")
    assert dialog.import_button.isEnabled() and not dialog.offer_button.isVisibleTo(dialog)
    with qtbot.waitSignal(window.library.import_done, timeout=REPLY_TIMEOUT_MS) as done:
        dialog.import_button.click()
    assert done.args[1], done.args[2]
    assert _library_state(home) == ["big-one"]


def test_the_library_shows_each_models_fit(make_window: WindowFactory, starter: dict[str, Any],
                                           qtbot: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from PySide6.QtCore import Qt

    monkeypatch.delenv("STRATA_CONTEXT", raising=False)
    monkeypatch.delenv("STRATA_MAX_MEMORY_MB", raising=False)
    window = make_window(fetch_starter=False, preload=False)
    library = window.library
    name = starter["name"]
    qtbot.waitUntil(lambda: library.model.fit(name) is not None, timeout=30_000)
    assert COLUMNS[MEMORY] == "Memory"
    row = library.model.names().index(name)
    cell = library.model.index(row, MEMORY)
    assert cell.data() == "fits (1.03 GB)"

    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", CAP_MB)
    library.refresh()
    library.view.select_name(name)
    cell = library.model.index(row, MEMORY)
    assert cell.data() == f"up to {OFFER:,} tokens"
    tip = cell.data(Qt.ItemDataRole.ToolTipRole)
    assert tip.startswith("does not fit: weights 0.65 GB + KV 0.38 GB at 8,192 tokens")
    assert f"it would fit with a context of up to {OFFER:,} tokens" in tip
    details = library.view.details.text()
    assert "memory: <b>does not fit" in details and f"up to {OFFER:,} tokens would fit" in details

    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", "300")  # less than the weights
    library.refresh()
    assert library.model.index(row, MEMORY).data() == "too large"


def test_the_command_refuses_an_import_and_a_load_in_one_line(
        starter: dict[str, Any], strata_home: Path, tmp_path: Path) -> None:
    from engine.importers.starter import starter_gguf

    home = tmp_path / "home"
    env: dict[str, str | None] = {"STRATA_MAX_MEMORY_MB": CAP_MB, "STRATA_CONTEXT": None}
    proc = run_strata("import", str(starter_gguf()), home=home, env=env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"strata: error: {starter_gguf().name}: needs about 1.03 GB")
    assert lines[0].endswith(f"up to {OFFER:,} tokens (STRATA_CONTEXT={OFFER})")
    assert not (home / "models").exists() or not any((home / "models").iterdir())
    # The offer taken: imported at that context, and it loads there without STRATA_CONTEXT.
    proc = run_strata("import", str(starter_gguf()), "--name", "short", "--context",
                      str(OFFER), home=home, env=env)
    assert proc.returncode == 0, proc.stderr
    proc = run_strata("generate", "--model", "short", "--prompt", "hi", "--max-tokens", "2",
                      home=home, env=env)
    assert proc.returncode == 0, proc.stderr

    proc = run_strata("generate", "--model", "starter", "--prompt", "hi", home=strata_home,
                      env=env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"strata: error: {starter['name']}: needs")
    assert f"up to {OFFER:,} tokens" in lines[0] and "Traceback" not in proc.stderr

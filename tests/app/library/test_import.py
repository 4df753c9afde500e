"""The import dialog offers the recipes with their size on disk, and imports by the one chosen.

Real parts: Qt offscreen, the engine thread, the starter model's GGUF file.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from app.format import human_bytes
from tests.app.conftest import REPLY_TIMEOUT_MS, WindowFactory
from tests.app.library.test_library import _drop, _library_state


def test_import_dialog_offers_recipes_with_sizes_and_imports_the_choice(
        make_window: WindowFactory, tmp_path: Path, qtbot: Any) -> None:
    from engine.importers import open_source
    from engine.importers.starter import starter_gguf
    from engine.library import Library
    from engine.quant.quantize import expected_sizes
    from engine.quant.recipes import builtin_names

    home = tmp_path / "home"
    window = make_window(home=home, fetch_starter=False, preload=False)
    dropped = tmp_path / "Small One.gguf"
    shutil.copyfile(starter_gguf(), dropped)
    with qtbot.waitSignal(window.library.import_planned, timeout=REPLY_TIMEOUT_MS) as planned:
        _drop(window, dropped)
    dialog = window.library.dialogs[planned.args[0]]
    assert dialog.kind_label.text() == "GGUF file"
    assert not dialog.started and _library_state(home) == []  # nothing runs before Import
    box = dialog.recipe_box
    recipes = [box.itemData(i) for i in range(box.count())]
    assert recipes == ["", *builtin_names()]  # "" is as stored
    texts = [box.itemText(i) for i in range(box.count())]
    assert texts[0] == f"as stored ({human_bytes(dropped.stat().st_size)})"
    sizes = expected_sizes(open_source(dropped), builtin_names())
    for recipe, text in zip(recipes[1:], texts[1:], strict=True):
        bpw, size = sizes[recipe]
        assert text == f"{recipe} ({bpw:.2f} bits/weight, {human_bytes(size)})", text
    # the weights only: a GGUF's tokenizer files are written at import (3.5 MB here)
    assert texts[recipes.index("q4-g64")] == "q4-g64 (4.50 bits/weight, 75.7 MB)"
    dialog.select_recipe("mixed-3.6")
    assert "3-bit g64" in dialog.recipe_label.text()

    dialog.select_recipe("q4-g32")
    with qtbot.waitSignal(window.library.import_done, timeout=REPLY_TIMEOUT_MS) as done:
        dialog.import_button.click()
    job, ok, name = done.args
    assert ok, name
    assert name == "small-one" and window.library.dialogs[job] is dialog
    m = Library(home).get("small-one")
    assert m["recipe"]["name"] == "q4-g32"
    assert m["bits_per_weight"] == round(sizes["q4-g32"][0], 3)
    weights = (Path(m["path"]) / "model.safetensors").stat().st_size
    assert sizes["q4-g32"][1] <= weights <= sizes["q4-g32"][1] * 1.001
    assert "Imported" in dialog.message.text()


def test_closing_the_dialog_before_import_writes_nothing(
        make_window: WindowFactory, tmp_path: Path, qtbot: Any) -> None:
    from engine.importers.starter import starter_gguf

    home = tmp_path / "home"
    window = make_window(home=home, fetch_starter=False, preload=False)
    with qtbot.waitSignal(window.library.import_planned, timeout=REPLY_TIMEOUT_MS) as planned:
        _drop(window, starter_gguf())
    dialog = window.library.dialogs[planned.args[0]]
    with qtbot.waitSignal(dialog.finished, timeout=5_000):
        dialog.buttons.rejected.emit()
    assert planned.args[0] not in window.library.dialogs
    assert _library_state(home) == []

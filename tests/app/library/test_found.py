"""Found on this Mac, in the window: the library lists what LM Studio, Ollama and the Hugging
Face cache keep and adds one in one click, saying how it sits on disk.

Real parts: Qt offscreen, the engine thread (the Ollama GGUF is converted by the real import),
real files laid out as those apps lay them out (tests/engine/library/test_found.py's lay_out),
found through the STRATA_LMSTUDIO_MODELS, STRATA_OLLAMA_MODELS and STRATA_HF_CACHE roots.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.app.conftest import REPLY_TIMEOUT_MS, WindowFactory
from tests.engine.library.test_found import lay_out

MLX_LABEL = "mlx-community/SmolLM2-135M-Instruct-4bit"


@pytest.fixture
def window(make_window: WindowFactory, tmp_path: Path, starter: dict[str, Any],
           monkeypatch: pytest.MonkeyPatch) -> Any:
    roots = lay_out(tmp_path / "apps", starter)
    monkeypatch.setenv("STRATA_LMSTUDIO_MODELS", os.pathsep.join(map(str, roots.lmstudio)))
    monkeypatch.setenv("STRATA_OLLAMA_MODELS", str(roots.ollama[0]))
    monkeypatch.setenv("STRATA_HF_CACHE", str(roots.hf_cache[0]))
    return make_window(home=tmp_path / "home", fetch_starter=False, preload=False)


def _column(window: Any, label: str, col: int) -> str:
    found = window.library.found_model
    return str(found.index(found.labels().index(label), col).data())


def test_found_models_are_listed_and_added_in_one_click(window: Any, qtbot: Any) -> None:
    from engine.library import Library

    view, found = window.library.view, window.library.found_model
    window.show_view("library")
    assert sorted(found.labels()) == [
        "lmstudio-community/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf",
        MLX_LABEL, "mlx-community/SmolLM2-135M-Instruct-8bit", "smollm2:135m"]
    assert _column(window, MLX_LABEL, 1) == "LM Studio"
    assert _column(window, MLX_LABEL, 4) == "links its files: no second copy"
    assert _column(window, "smollm2:135m", 1) == "Ollama"
    assert _column(window, "smollm2:135m", 4) == "converts it to MLX: a second copy"
    assert view.found_table.isVisible() and view.add_found_button.accessibleName()

    # LM Studio's MLX folder: one click, hard links, no second copy.
    view.select_found(MLX_LABEL)
    with qtbot.waitSignal(window.library.found_added, timeout=REPLY_TIMEOUT_MS) as added:
        view.add_found_button.click()
    label, ok, name = added.args
    assert ok, name
    assert (label, name) == (MLX_LABEL, "smollm2-135m-instruct-4bit")
    home = window.engine.home
    m = Library(home).get(name)
    assert m["placement"] == "hardlink" and m["found_in"] == "LM Studio"
    src = found.found(found.labels().index(MLX_LABEL)).path
    assert (Path(m["path"]) / "model.safetensors").samefile(src / "model.safetensors")
    row = window.library.model.names().index(name)
    assert window.library.model.index(row, 6).data() == "MLX folder (LM Studio, hard link)"
    view.select_name(name)
    assert "hard links to LM Studio's files: no second copy" in view.details.text()
    assert _column(window, MLX_LABEL, 4) == f"in the library as {name}"
    view.select_found(MLX_LABEL)
    assert not view.add_found_button.isEnabled()  # added once

    # Ollama's GGUF blob: one click, converted by the engine's import, named as Ollama does.
    view.select_found("smollm2:135m")
    with qtbot.waitSignal(window.library.found_added, timeout=REPLY_TIMEOUT_MS) as added:
        view.add_found_button.click()
    label, ok, name = added.args
    assert ok, name
    assert name == "smollm2-135m"
    m = Library(home).get(name)
    assert m["placement"] == "converted" and m["found_in"] == "Ollama"
    assert Path(m["source"]).name.startswith("sha256-")  # the blob it came from
    row = window.library.model.names().index(name)
    assert window.library.model.index(row, 6).data() == "GGUF file (Ollama, converted)"
    assert _column(window, "smollm2:135m", 4) == f"in the library as {name}"
    assert not any((home / "found-staging").iterdir())
    assert sorted(window.library.model.names()) == ["smollm2-135m", "smollm2-135m-instruct-4bit"]
    assert "Added smollm2:135m from Ollama" in view.found_status.text()

"""docs/models.md is what the tests' matrices say (regenerate it with
`python -m tests.engine.importers.models_doc > docs/models.md`)."""

from __future__ import annotations

from pathlib import Path

from tests.engine.importers.models_doc import render

DOC = Path(__file__).resolve().parents[3] / "docs" / "models.md"


def test_docs_models_md_is_generated_from_the_test_matrices() -> None:
    assert DOC.read_text() == render(), (
        "docs/models.md is stale: python -m tests.engine.importers.models_doc > docs/models.md")

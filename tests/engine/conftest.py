"""Fixtures shared by the engine tests (the session-wide ones are in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.kv.prefix import PrefixCache, PrefixSettings


@pytest.fixture
def prefix(starter_lm: Any, tmp_path: Path) -> Iterator[PrefixCache]:
    """A prefix cache with 32-token pages in a fresh folder, installed on the shared model;
    full pages only (tests/engine/kv/test_tail.py covers the partial last page)."""
    pc = starter_lm.new_prefix_cache(PrefixSettings(folder=tmp_path / "px", page_tokens=32,
                                                    tails=False))
    starter_lm.prefix_cache = pc
    try:
        yield pc
    finally:
        starter_lm.prefix_cache = None
        pc.close()

"""Shared fixtures: an isolated STRATA_HOME per test session, and the real starter model.

The starter GGUF is fetched once per machine into the user cache (STRATA_CACHE), outside the
repository, and imported into this session's temporary library.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _device() -> None:
    """STRATA_DEVICE=cpu puts this process's MLX on the CPU too (CI on virtual GPUs)."""
    if os.environ.get("STRATA_DEVICE") == "cpu":
        from engine.platform import select_device

        select_device()


@pytest.fixture(scope="session")
def strata_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("strata-home")
    os.environ["STRATA_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def library(strata_home: Path):  # noqa: ANN201
    from engine.library import Library

    return Library(strata_home)


@pytest.fixture(scope="session")
def starter(library):  # noqa: ANN001, ANN201
    """The starter model's manifest, in this session's library."""
    from engine.importers.starter import ensure_starter

    return ensure_starter(library)


@pytest.fixture(scope="session")
def starter_lm(starter):  # noqa: ANN001, ANN201
    """The starter model loaded in this process with the backend's compute profile."""
    from engine.runtime.generate import LoadedModel

    return LoadedModel.load(starter["path"])


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent (checkout outside the workspace)")
    return SHARED_DATA

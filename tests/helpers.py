"""Helpers for tests: run the real `strata` command line in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_strata(*args: str, home: Path, timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run the real command line in a subprocess against `home`."""
    env = dict(os.environ, STRATA_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=REPO, **kw)

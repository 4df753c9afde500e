"""Helpers for tests: run the real `strata` command line in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run_strata(*args: str, home: Path, timeout: float = 600,
               env: dict[str, str | None] | None = None, **kw: Any
               ) -> subprocess.CompletedProcess[str]:
    """Run the real command line in a subprocess against `home`.

    `env` adds variables to this process's environment (a value of None removes one).
    """
    full = dict(os.environ, STRATA_HOME=str(home))
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True,
                          text=True, env=full, timeout=timeout, cwd=REPO, **kw)

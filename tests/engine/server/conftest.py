"""The server tests' shared `strata serve`: one subprocess on loopback, with an API key,
serving the starter model, started as users start it and stopped after the package's tests
(which assert it stopped cleanly: no traceback in its log)."""

from __future__ import annotations

import os
import re
import secrets
import selectors
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers import REPO

KEY = "sk-test-" + secrets.token_hex(8)


@contextmanager
def serving(strata_home: Path, log: Path, *extra: str) -> Iterator[str]:
    """`strata serve` started as users start it (plus `extra` options): its base URL (…/v1);
    stopped by SIGTERM after, which must end it cleanly (the CLI's exit status for Ctrl-C)."""
    env = dict(os.environ, STRATA_HOME=str(strata_home))
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve", "--port", "0", "--api-key", KEY, *extra],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO)
    assert proc.stdout is not None
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if sel.select(timeout=180) else ""
        match = re.search(r"http://\S+/v1", line)
        assert match, f"no address announced ({line!r}); stderr: {log.read_text()[-2000:]}"
        yield match.group(0)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == 130, log.read_text()[-2000:]
    assert "Traceback" not in log.read_text() and "terminate called" not in log.read_text()


@pytest.fixture(scope="package")
def server(starter: Any, strata_home: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[str]:
    """The base URL (…/v1) of a server started as users start it; stopped after these tests."""
    with serving(strata_home, tmp_path_factory.mktemp("serve") / "stderr.log") as url:
        yield url


@pytest.fixture(scope="package")
def client(server: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c

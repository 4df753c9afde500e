"""The cluster tests' shared parts: a real waiting `strata join` and how to reach one.

Contract: `waiter` (module scope) is a real `strata join --listen PORT` process advertised by
mDNS on loopback only (STRATA_MDNS_INTERFACE), yielding its "127.0.0.1:PORT" and checking
that SIGTERM stops it cleanly; a test module takes it with `waiter = cluster_fixtures.waiter`.
`waiter_env(home)` is the environment such a process runs in; `wait_for(address, proc)`
waits until it answers; `keyed_waiter_at(addr, home, key)` runs one holding a server key,
asked at `addr` (off loopback), for the key and shipping tests.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.runtime.cluster import free_ports
from engine.runtime.cluster_find import ClusterError, probe

REPO = Path(__file__).resolve().parents[3]


def waiter_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"STRATA_HOME": str(home), "STRATA_MDNS_INTERFACE": "127.0.0.1",
                "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")})
    env.pop("MLX_HOSTFILE", None)
    return env


def wait_for(address: str, proc: subprocess.Popen[bytes], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            probe(address)
            return
        except ClusterError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture(scope="module")
def waiter(strata_home: Path) -> Iterator[str]:
    """A real `strata join` waiting on a free port, advertised on loopback."""
    port = free_ports(1)[0]
    with subprocess.Popen([sys.executable, "-m", "app", "join", "--listen", str(port)],
                          env=waiter_env(strata_home), cwd=REPO,
                          stdin=subprocess.DEVNULL) as proc:
        try:
            wait_for(f"127.0.0.1:{port}", proc)
            yield f"127.0.0.1:{port}"
        finally:
            proc.terminate()
            assert proc.wait(10) == 0  # SIGTERM: it left the network and stopped


@contextlib.contextmanager
def keyed_waiter_at(addr: str, home: Path, key: str) -> Iterator[str]:
    """A real `strata join --api-key KEY` on `home`, not advertised, yielding "ADDR:PORT"
    once it answers there; the key comes from the flag alone (STRATA_API_KEY dropped)."""
    port = free_ports(1)[0]
    env = {k: v for k, v in waiter_env(home).items() if k != "STRATA_API_KEY"}
    with subprocess.Popen([sys.executable, "-m", "app", "join", "--listen", str(port),
                           "--no-advertise", "--api-key", key], env=env, cwd=REPO,
                          stdin=subprocess.DEVNULL) as proc:
        try:
            wait_for(f"{addr}:{port}", proc)
            yield f"{addr}:{port}"
        finally:
            proc.terminate()
            proc.wait(10)

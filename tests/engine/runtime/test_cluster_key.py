"""Off loopback, the control line and a waiter's invitations need the server's key.

Real parts: this machine's own non-loopback address (the container's eth0: traffic to it is
not loopback traffic to either side), a real joining rank (`python -m engine.runtime.cluster`)
reaching rank 0's real `start` in this process, and a real waiting `strata join` asked from
that address. Rank 0 and the rank each prove the key with an HMAC of the other's fresh nonce;
a wrong or missing key is one line, on both sides, before anything loads (no group, no
weights). The case where the key is right (the model shipped, then a reply) is in
test_cluster_ship.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.runtime.cluster import JOIN_COMMAND, ClusterError, free_ports, start, write_hostfile
from engine.runtime.cluster_find import ask, local_address
from engine.telemetry import Timeline
from tests.engine.runtime.cluster_fixtures import REPO, keyed_waiter_at, wait_for, waiter_env

KEY = "the-server-key-1"
ADDR = local_address()
pytestmark = pytest.mark.skipif(ADDR.startswith("127."), reason="no non-loopback address here")


def _refused(tmp_path: Path, home: Path, rank0_key: str | None, rank_key: str | None
             ) -> tuple[str, str, set[str]]:
    """Rank 0 here and one joining rank, both on ADDR: rank 0's line, the rank's stderr and
    the phases rank 0 ran."""
    ports = free_ports(3, ADDR)
    hosts = [f"{ADDR}:{p}" for p in ports[:2]]
    hostfile = write_hostfile(hosts, tmp_path / "hosts.json")
    env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": "1",
           "STRATA_CLUSTER_CONTROL": f"{ADDR}:{ports[2]}", "STRATA_HOME": str(home),
           "PYTHONPATH": str(REPO)}
    env.pop("STRATA_API_KEY", None)
    if rank_key is not None:
        env["STRATA_API_KEY"] = rank_key
    timeline = Timeline()
    with subprocess.Popen(JOIN_COMMAND, env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                          stderr=subprocess.PIPE) as proc:
        try:
            with pytest.raises(ClusterError) as err:
                start("starter", hosts, timeout=30, timeline=timeline,
                      control=f"{ADDR}:{ports[2]}", key=rank0_key)
            _, stderr = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 1
    return str(err.value), stderr.decode(), {name for name, _, _ in timeline.marks}


@pytest.mark.parametrize(("rank0_key", "rank_key", "says", "rank_says"), [
    (KEY, "another-key", "refused: rank 0 does not hold its key",
     "refused rank 0 at {addr}: rank 0 does not hold its key"),
    (KEY, None, "refused: it has no key: off loopback the ranks must hold the server's key",
     "refused rank 0 at {addr}: it has no key"),
    (None, KEY, "refused: it is off loopback and this Mac has no key",
     "refused rank 0 at {addr}: rank 0 does not hold its key"),
])
def test_a_wrong_or_missing_key_off_loopback_is_one_line_before_anything_loads(
        tmp_path: Path, library: Any, starter: Any, rank0_key: str | None,
        rank_key: str | None, says: str, rank_says: str) -> None:
    line, stderr, phases = _refused(tmp_path, tmp_path / "home", rank0_key, rank_key)
    assert line.startswith(f"rank 1 ({ADDR}) {says}"), line
    assert "\n" not in line
    assert rank_says.format(addr=ADDR) in stderr, stderr
    assert stderr.strip().count("\n") == 0, stderr  # one line there too
    assert phases == {"cluster handshake"}, phases  # no group, no tokenizer, no weights
    assert not (tmp_path / "home" / "models").exists() or not any(
        (tmp_path / "home" / "models").iterdir())  # and nothing was sent


@pytest.fixture(scope="module")
def keyed_waiter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `strata join` holding KEY, asked at ADDR (not loopback)."""
    home = tmp_path_factory.mktemp("waiter-home")
    with keyed_waiter_at(ADDR, home, KEY) as address:
        yield address


def test_a_waiter_off_loopback_invites_only_with_the_key(
        keyed_waiter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STRATA_API_KEY", raising=False)
    assert ask(keyed_waiter, {"op": "info"})["strata"]  # what mDNS shows anyway: no key
    with pytest.raises(ClusterError, match=rf"^{keyed_waiter}: it asks for the key"):
        ask(keyed_waiter, {"op": "reserve"})
    with pytest.raises(ClusterError, match=rf"^{keyed_waiter}: {ADDR}: wrong or missing key"):
        ask(keyed_waiter, {"op": "invite", "hosts": ["x:1", "y:2"], "rank": 1,
                           "control": "x:3"}, key="another-key")
    assert not ask(keyed_waiter, {"op": "info"})["busy"]  # nothing was started
    assert int(ask(keyed_waiter, {"op": "reserve"}, key=KEY)["port"]) > 0
    # The same waiter on loopback: this machine's own processes need no key.
    loop = "127.0.0.1:" + keyed_waiter.rpartition(":")[2]
    assert int(ask(loop, {"op": "reserve"})["port"]) > 0


def test_a_waiter_with_no_key_refuses_invitations_from_off_loopback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_API_KEY", KEY)
    port = free_ports(1)[0]
    env = {k: v for k, v in waiter_env(tmp_path).items() if k != "STRATA_API_KEY"}
    with subprocess.Popen([sys.executable, "-m", "app", "join", "--listen", str(port),
                           "--no-advertise"], env=env, cwd=REPO,
                          stdin=subprocess.DEVNULL) as proc:
        try:
            wait_for(f"{ADDR}:{port}", proc)
            with pytest.raises(ClusterError, match="off loopback and this waiter has no key"):
                ask(f"{ADDR}:{port}", {"op": "reserve"})
        finally:
            proc.terminate()
            proc.wait(10)

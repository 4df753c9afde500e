"""A rank that differs is refused, in one line naming what differs, before anything loads.

Rank 0 is the real `start` in this process; the joining rank speaks the real control protocol
over loopback from a thread (hello, the job, its identity), with one field of its identity
changed as another machine's install would have it: another Strata, MLX or mlx-lm version,
another compute profile, another model fingerprint, or no copy of the model. (A real
`strata join` refused for its fingerprint is in test_cluster.py.)
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import pytest

from engine.platform import compute_profile
from engine.runtime.cluster import ClusterError, free_ports, identity, start
from engine.telemetry import Timeline


def _rank1(control: tuple[str, int], change: dict[str, Any], seen: dict[str, Any]) -> None:
    """Rank 1 over the control protocol: this machine's identity with `change` applied."""
    deadline = time.monotonic() + 20
    while True:
        try:
            sock = socket.create_connection(control, timeout=20)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with sock, sock.makefile("rwb") as f:
        f.write(json.dumps({"rank": 1, "memory": 1 << 30}).encode() + b"\n")
        f.flush()
        seen["challenge"] = json.loads(f.readline())  # loopback: no key asked for
        f.write(json.dumps({"proof": None}).encode() + b"\n")
        f.flush()
        seen["job"] = json.loads(f.readline())
        mine = identity(None, compute_profile())
        mine["fingerprint"] = seen["job"]["fingerprint"]
        mine.update(change)
        f.write(json.dumps(mine).encode() + b"\n")
        f.flush()
        seen["verdict"] = json.loads(f.readline())


@pytest.mark.parametrize(("change", "says"), [
    ({"strata": "0.0.1"}, "Strata version differs"),
    ({"mlx": "0.1.0"}, "MLX version differs"),
    ({"mlx-lm": "0.1.0"}, "mlx-lm version differs"),
    ({"profile": ["metal-q", "float16", False]}, "compute profile differs"),
    ({"fingerprint": "sha256:" + "1" * 64}, "model fingerprint differs"),
    ({"fingerprint": None}, "it has no copy of the model"),
])
def test_a_rank_that_differs_is_refused_before_anything_loads(
        starter: Any, change: dict[str, Any], says: str) -> None:
    ports = free_ports(3)
    hosts = [f"127.0.0.1:{p}" for p in ports[:2]]
    seen: dict[str, Any] = {}
    rank1 = threading.Thread(target=_rank1, args=(("127.0.0.1", ports[2]), change, seen))
    rank1.start()
    timeline = Timeline()
    try:
        with pytest.raises(ClusterError) as err:
            start(starter["path"], hosts, timeout=20, timeline=timeline,
                  control=f"127.0.0.1:{ports[2]}")
    finally:
        rank1.join(30)
    line = str(err.value)
    assert line.startswith(f"rank 1 (127.0.0.1) refused: {says}"), line
    assert "\n" not in line
    if "differs" in says:  # both values named: here, there
        key = next(iter(change))
        assert str(change[key]) in line, line
    # The rank was told the same line, and nothing past the handshake ran on rank 0: no
    # group, no tokenizer, no weights.
    assert seen["verdict"] == {"refused": line}
    assert seen["job"]["model"] == starter["name"]
    phases = {name for name, _, _ in timeline.marks}
    assert phases == {"cluster handshake"}, phases

"""Macs waiting to join, found by mDNS on loopback or typed by address, then run as a split.

Real parts: `strata join` with no hostfile (a waiter, its own process) advertising itself
with the real zeroconf on the loopback interface (multicast works there in this container;
STRATA_MDNS_INTERFACE keeps the test off the real network), this process browsing for it, a
typed address asked over TCP, and a bad address refused in one line.
"""

from __future__ import annotations

import mlx.core as mx
import psutil
import pytest

from engine.runtime.cluster import free_ports
from engine.runtime.cluster_find import ClusterError, ask, browse, probe
from tests.engine.runtime import cluster_fixtures

waiter = cluster_fixtures.waiter  # the shared `strata join` (cluster_fixtures.py)


def test_a_typed_address_says_its_memory_and_mlx_version(waiter: str) -> None:
    peer = probe(waiter)
    assert peer.address == waiter
    assert peer.mlx == mx.__version__ and peer.strata and peer.mlx_lm
    assert peer.total_bytes == psutil.virtual_memory().total
    assert 0 < peer.available_bytes <= peer.total_bytes
    assert not peer.busy


def test_a_waiter_is_found_by_mdns(waiter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_MDNS_INTERFACE", "127.0.0.1")
    found = {p.address: p for p in browse(2.0)}
    assert waiter in found, found
    peer = found[waiter]
    assert peer.mlx == mx.__version__
    assert peer.total_bytes == psutil.virtual_memory().total


def test_an_address_with_no_waiter_is_one_line() -> None:
    port = free_ports(1)[0]
    with pytest.raises(ClusterError, match=rf"^127.0.0.1:{port}: no Strata waiting there"):
        probe(f"127.0.0.1:{port}")
    with pytest.raises(ClusterError, match="not a host:port address"):
        probe("mac-mini.local")


def test_a_bad_request_is_refused_and_the_waiter_keeps_waiting(waiter: str) -> None:
    with pytest.raises(ClusterError, match=rf"^{waiter}: bad request \('hosts'\)"):
        ask(waiter, {"op": "invite"})
    with pytest.raises(ClusterError, match=rf"^{waiter}: unknown request 'nosuch'"):
        ask(waiter, {"op": "nosuch"})
    assert not probe(waiter).busy  # still there, nothing started

"""Preflight across Macs: a model too large for this Mac but not for the cluster is offered
"run across N Macs" with each Mac's numbers; one that fits nowhere is refused with them.

Real parts: the starter in a real library, this machine's memory capped with
STRATA_MAX_MEMORY_MB (as a smaller Mac would have it), the peers' memory as their waiters
report it (engine.runtime.cluster_find.Peer); the per-Mac weights are checked against what
real ranks hold (test_cluster.py measures 255 MB per rank for a tensor split of 3).
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.runtime.cluster_find import Peer, preflight

MB = 1_000_000


def _peer(name: str, available_mb: int) -> Peer:
    return Peer(f"10.0.0.{len(name)}:5170", name, "0.1.0", "0.32.4", "0.32.2", "cpu-f32",
                16_000 * MB, available_mb * MB)


def test_too_large_for_this_mac_but_not_for_three_is_offered_with_per_mac_numbers(
        starter: Any, library: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", "400")  # MiB: about 419 MB
    monkeypatch.setenv("STRATA_CONTEXT", "4096")
    one, across = preflight(starter["name"], [_peer("mac-2", 400), _peer("mac-3", 400)],
                            library)
    assert not one.fits  # 540 MB of float32 weights + the KV at 4,096 tokens
    assert across is not None and across.fits and across.mode == "tensor"
    summary = across.summary()
    assert summary.startswith("run across 3 Macs (tensor split): this Mac ")
    assert "mac-2" in summary and "mac-3" in summary and "\n" not in summary
    for r in across.ranks:  # the embedding whole + a third of the layers: 255 MB measured
        assert abs(r.weights_bytes - 255 * MB) < 0.02 * 255 * MB, r
        assert abs(r.kv_bytes - one.kv_bytes / 3) <= 1, r
    assert sum(r.weights_bytes for r in across.ranks) > one.weights_bytes  # embedding x 3


def test_fits_nowhere_is_refused_with_each_macs_numbers(
        starter: Any, library: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATA_MAX_MEMORY_MB", "300")
    monkeypatch.setenv("STRATA_CONTEXT", "4096")
    one, across = preflight(starter["name"], [_peer("mac-2", 150)], library)
    assert not one.fits
    assert across is not None and not across.fits and across.mode == "pipeline"
    # Pipeline layers go by memory: this Mac's 315 MB against mac-2's 150 MB.
    assert across.ranks[0].weights_bytes > across.ranks[1].weights_bytes
    summary = across.summary()
    assert summary.startswith("does not fit across 2 Macs either (")
    assert "this Mac" in summary and "mac-2 " in summary
    assert preflight(starter["name"], [], library)[1] is None

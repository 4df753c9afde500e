"""A rank with no copy of the model gets it from rank 0, checked by fingerprint; then the
server's requests and the chats run on the split model, and the memory panel has a row a Mac.

Real parts: two STRATA_HOMEs on one machine (this session's, holding the starter, and an
empty one), a real waiting `strata join` holding the server's key on the empty one, asked
at this machine's non-loopback address (so the key is proved both ways), rank 0 a driver
process (MLX's group lives as long as its process) running ModelPool.load_across and then
the server's own GenerationJob on the pool (what the window's local server runs per
request), compared with one process's greedy tokens. A rank 0 that drops the line mid-model
or announces another fingerprint leaves nothing in the rank's library.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.library import Library
from engine.runtime.cluster import JOIN_COMMAND, free_ports, write_hostfile
from engine.runtime.cluster_find import local_address
from engine.runtime.generate import generate
from engine.runtime.sampling import SamplingParams
from tests.engine.runtime.cluster_fixtures import REPO, keyed_waiter_at

KEY = "the-server-key-2"
ADDR = local_address()
TOKENS = 4  # a pipeline step on 2 shared cores is slow (docs/cluster.md: about 0.5 tok/s)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]

DRIVER = """
import json, sys
from engine.runtime.pool import ModelPool
from engine.runtime.sampling import SamplingParams
from engine.server.host import GenerationJob
from engine.runtime.generate import GenerationEvent
waiter, key, tokens, messages = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
pool = ModelPool()
pool.load_across("starter", [waiter], key=key)
out = {"server": []}
for _ in range(2):  # the second request reuses the first one's prompt cache
    events = []
    job = GenerationJob(model="starter", prompt=lambda tok: tok.encode_chat(messages),
                        emit=events.append, params=SamplingParams(temperature=0.0),
                        max_tokens=tokens)
    job.run(pool)
    bad = [str(e) for e in events if isinstance(e, Exception)]
    assert not bad, bad
    gen = [e for e in events if isinstance(e, GenerationEvent)]
    out["server"].append({"tokens": [e.token for e in gen if e.token is not None],
                          "cached": gen[-1].cached_tokens})
chat = list(pool.reply(1, "starter", messages[0]["content"],
                       params=SamplingParams(temperature=0.0), max_tokens=tokens))
out["chat"] = [e.token for e in chat if e.token is not None]
snap = pool.memory()
out["ranks"] = [dict(r) for r in snap.ranks]
out["prefix_reason"] = snap.prefix_disk_reason
out["prefix_bytes"] = snap.prefix_disk_bytes
out["kv0"] = snap.kv_ram_bytes
# A server request whose other rank is killed once its reply has begun: the cluster's line.
import os, signal, time
from engine.runtime.cluster_find import probe
events, pid = [], probe(waiter).pid
def emit(e):
    events.append(e)
    if isinstance(e, GenerationEvent) and e.token is not None and len(events) == 2:
        os.kill(pid, signal.SIGKILL)
        out["killed_at"] = time.monotonic()
GenerationJob(model="starter", prompt=lambda tok: tok.encode_chat(messages), emit=emit,
              params=SamplingParams(temperature=0.0), max_tokens=64).run(pool)
out["fault_s"] = time.monotonic() - out.pop("killed_at")
out["fault"] = [str(e) for e in events if isinstance(e, Exception)]
out["fault_tokens"] = len([e for e in events if isinstance(e, GenerationEvent)])
pool.close()
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def empty_waiter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real `strata join` with the key, on a STRATA_HOME with no models, asked off
    loopback."""
    home = tmp_path_factory.mktemp("empty-home")
    with keyed_waiter_at(ADDR, home, KEY) as address:
        yield address, home


@pytest.mark.skipif(ADDR.startswith("127."), reason="no non-loopback address here")
def test_the_model_is_shipped_then_server_requests_and_chats_match_one_process(
        empty_waiter: tuple[str, Path], starter: Any, starter_lm: Any,
        strata_home: Path) -> None:
    address, home = empty_waiter
    assert Library(home).find("starter") is None
    env = {**os.environ, "STRATA_HOME": str(strata_home), "PYTHONPATH": str(REPO)}
    env.pop("STRATA_API_KEY", None)
    run = subprocess.run([sys.executable, "-c", DRIVER, address, KEY, str(TOKENS),
                          json.dumps(MESSAGES)], env=env, cwd=REPO, capture_output=True,
                         timeout=240, check=False)
    lines = [x for x in run.stdout.decode().splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr.decode()[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    # The rank's library now holds the model: complete, the same weights (fingerprint).
    shipped = Library(home).get(starter["name"])
    assert shipped["fingerprint"] == starter["fingerprint"]
    assert not list((home / "models").glob(".tmp-*"))
    # One process, the same prompt, greedy.
    ids = starter_lm.tokenizer.encode_chat(MESSAGES)
    want = [e.token for e in generate(starter_lm, ids, SamplingParams(temperature=0.0), TOKENS)
            if e.token is not None]
    first, second = out["server"]
    assert first["tokens"] == want
    assert second["tokens"] == want and second["cached"] > 0  # its prompt cache reused
    assert out["chat"] == want
    # A row a Mac: each rank's share of the weights and the KV of its own layers.
    ranks = out["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    total = sum(r["weights_bytes"] for r in ranks)
    assert all(0 < r["weights_bytes"] < total for r in ranks)
    assert ranks[0]["kv_bytes"] == out["kv0"] and ranks[0]["kv_bytes"] > 0
    assert ranks[1]["kv_bytes"] > 0 and ranks[1]["rss_bytes"] > 0
    # The prefix cache is on (each rank's own pages): figures, no reason for being off.
    assert out["prefix_reason"] is None and out["prefix_bytes"] is not None
    # Killed mid-reply: the request ends with the cluster's one line, within seconds.
    assert len(out["fault"]) == 1 and out["fault_s"] < 10, out
    assert out["fault"][0].startswith("the reply stopped after "), out["fault"]
    assert "rank 1" in out["fault"][0] and out["fault_tokens"] < 64
    steps = int(out["fault"][0].split("after ")[1].split(" decode")[0])
    assert steps <= out["fault_tokens"] + 1, out  # this reply's steps, not the earlier ones'


# -- a rank 0 that drops the line, or lies about the fingerprint ---------------------------
def _fake_rank0(srv: socket.socket, starter: Any, half: bool, fingerprint: str,
                seen: dict[str, Any]) -> None:
    """Rank 0's side of the protocol up to the model: every file announced, then either
    half of the weights and a closed line, or all of them under `fingerprint`."""
    conn, _ = srv.accept()
    folder = Path(starter["path"])
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name != "manifest.json")
    with conn, conn.makefile("rwb") as f:
        def send(obj: dict[str, Any]) -> None:
            f.write(json.dumps(obj).encode() + b"\n")
            f.flush()

        json.loads(f.readline())  # hello
        send({"challenge": "0" * 32, "proof": None})
        json.loads(f.readline())  # its proof: none needed on loopback
        send({"model": starter["name"], "fingerprint": fingerprint,
              "plan": {"mode": "pipeline", "ranks": 2, "layers": [[0, 15], [15, 30]]},
              "kv": None})
        seen["identity"] = json.loads(f.readline())
        send({"ship": {"name": starter["name"], "fingerprint": fingerprint, "manifest": {},
                       "files": [[p.name, p.stat().st_size] for p in files]}})
        for p in files:
            data = p.read_bytes()
            if half and p.suffix == ".safetensors":
                f.write(data[: len(data) // 2])
                f.flush()
                return  # the line drops mid-model
            f.write(data)
        f.flush()
        seen["answer"] = json.loads(f.readline())


@pytest.mark.parametrize("half", [True, False], ids=["dropped", "wrong-fingerprint"])
def test_a_model_cut_short_or_not_matching_leaves_nothing_in_the_library(
        tmp_path: Path, starter: Any, half: bool) -> None:
    home = tmp_path / "home"
    ports = free_ports(3)
    hostfile = write_hostfile([f"127.0.0.1:{p}" for p in ports[:2]], tmp_path / "hosts.json")
    fingerprint = starter["fingerprint"] if half else "sha256:" + "2" * 64
    seen: dict[str, Any] = {}
    with socket.create_server(("127.0.0.1", ports[2])) as srv:
        srv.settimeout(30)
        rank0 = threading.Thread(target=_fake_rank0, args=(srv, starter, half, fingerprint,
                                                           seen))
        rank0.start()
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": "1",
               "STRATA_CLUSTER_CONTROL": f"127.0.0.1:{ports[2]}", "STRATA_HOME": str(home),
               "PYTHONPATH": str(REPO)}
        run = subprocess.run(JOIN_COMMAND, env=env, cwd=REPO, capture_output=True,
                             timeout=60, check=False)
        rank0.join(30)
    err = run.stderr.decode().strip()
    assert run.returncode == 1, err
    assert seen["identity"]["fingerprint"] is None and seen["identity"]["receive"] is True
    last = err.splitlines()[-1]
    assert last.startswith("strata: error: rank 1: the model from rank 0 was not kept: "), err
    if half:
        assert "closed the connection" in last and "bytes short" in last, last
    else:
        assert f"not the {fingerprint} announced" in last, last
        assert seen["answer"]["refused"].startswith("the model sent has fingerprint sha256:")
    models = home / "models"
    assert Library(home).manifests() == []
    assert not list(models.iterdir()), list(models.iterdir())  # no half-written folder

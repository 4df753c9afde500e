"""After a rank dies, the model runs again: on one machine, or on the ranks that are left.

Real parts: two real `strata join` waiters (their own processes, on loopback), rank 0 a
driver process that invites them (a pipeline split of 3); the driver kills rank 2's process
mid-reply, gets the one-line error, then loads the model on its own (the broken group stays
behind) and replies; the waiters go back to waiting; waiter 2 (its "Mac") is stopped, and a
fresh rank 0 runs the model on the ranks left (rank 0 and waiter 1: a pipeline split of 2,
in paged exact KV, each rank paging its own layers; each rank's weights its share). Each
reply's greedy tokens equal one process's. A new rank 0 is a new process because MLX's
group is process-global (a second `mx.distributed.init` returns the first group).

The split killed is a pipeline one: in a tensor split each step is 61 collectives, and a
rank lost mid-step leaves rank 0 waiting in the next one MLX's ring takes after failing the
pending ones, which it never fails (docs/cluster.md, "Faults"); rank 0 cannot be freed from
that wait today.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from engine.runtime.cluster import free_ports
from engine.runtime.cluster_find import probe
from tests.engine.runtime.cluster_fixtures import wait_for, waiter_env

REPO = Path(__file__).resolve().parents[3]
TOKENS = 6
PROMPT = "What is the capital of France?"

DRIVER = """
import json, os, signal, sys
from pathlib import Path
from engine.kv import KVSettings
from engine.runtime.cluster import ClusterError
from engine.runtime.cluster_find import probe, start_invited
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.sampling import SamplingParams
model, waiters, kill, tokens, prompt, kvdir = sys.argv[1], sys.argv[2].split(","), \\
    sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
# The run on the ranks left pages its KV (exact, 16-token pages): each rank its own layers.
kv = None if kill == "yes" else KVSettings(mode="exact", page_tokens=16, ram_mb=64,
                                           ssd_dir=Path(kvdir))
greedy = SamplingParams(temperature=0.0)
def reply(lm, n):
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    for ev in generate(lm, ids, greedy, n, prefix_cache=False, drafter="off"):
        if ev.token is not None:
            yield ev.token
import time
t0 = time.perf_counter()
out = {}
cluster = start_invited(model, waiters, timeout=60, kv=kv)
out["t_start"] = time.perf_counter() - t0
out["split"] = [cluster.plan.mode, cluster.plan.ranks]
out["weights"] = [r["weights_bytes"] for r in cluster.ranks]
if kill == "yes":  # rank 2's process killed once the reply has begun
    got = []
    try:
        with cluster:
            for tok in reply(cluster.lm, 2000):
                got.append(tok)
                if len(got) == 3:
                    os.kill(probe(waiters[1]).pid, signal.SIGKILL)
    except ClusterError as exc:
        out["error"] = str(exc)
    out["kept"] = got
    out["t_error"] = time.perf_counter() - t0
    out["one"] = list(reply(LoadedModel.load(model), tokens))  # reloaded on one
    out["t_one"] = time.perf_counter() - t0
else:
    with cluster:
        pc = cluster.lm.new_cache()
        ids = cluster.lm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        out["tokens"] = [ev.token for ev in generate(
            cluster.lm, ids, greedy, tokens, prefix_cache=False, drafter="off",
            prompt_cache=pc) if ev.token is not None]
        out["kinds"] = sorted({type(c).__name__ for c in pc.cache})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def reference(starter_lm: Any) -> dict[str, Any]:
    from engine.runtime.cluster_split import share_bytes
    from engine.runtime.generate import generate
    from engine.runtime.sampling import SamplingParams

    ids = starter_lm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    tokens = [ev.token for ev in generate(starter_lm, ids, SamplingParams(temperature=0.0),
                                          TOKENS, prefix_cache=False, drafter="off")
              if ev.token is not None]
    inner = starter_lm.model.model
    return {"tokens": tokens, "bytes": share_bytes(starter_lm.model),
            "whole": share_bytes(inner.embed_tokens) + share_bytes(inner.norm)}


@pytest.fixture()
def waiters(strata_home: Path) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    env = waiter_env(strata_home)
    with ExitStack() as stack:
        out = []
        for port in free_ports(2):
            proc = stack.enter_context(subprocess.Popen(
                [sys.executable, "-m", "app", "join", "--listen", str(port), "--no-advertise"],
                env=env, cwd=REPO, stdin=subprocess.DEVNULL))
            stack.callback(_stop, proc)
            out.append((f"127.0.0.1:{port}", proc))
        for address, proc in out:
            wait_for(address, proc)
        yield out


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)


def _drive(starter: Any, home: Path, waiters: list[str], kill: bool, kvdir: Path
           ) -> dict[str, Any]:
    env = waiter_env(home)
    if kill:  # see the module docstring: a tensor split's step is 61 collectives
        env["STRATA_CLUSTER_SPLIT"] = "pipeline"
    proc = subprocess.run([sys.executable, "-c", DRIVER, starter["path"], ",".join(waiters),
                           "yes" if kill else "no", str(TOKENS), PROMPT, str(kvdir)],
                          env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _idle(address: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while probe(address).busy:
        assert time.monotonic() < deadline, f"{address} still runs a rank"
        time.sleep(0.1)


def test_after_a_rank_dies_the_model_reloads_on_one_and_on_the_ranks_left(
        starter: Any, strata_home: Path, reference: dict[str, Any], tmp_path: Path,
        waiters: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    addresses = [a for a, _ in waiters]
    tokens = reference["tokens"]
    first = _drive(starter, strata_home, addresses, kill=True, kvdir=tmp_path)
    assert first["split"] == ["pipeline", 3]
    assert first["error"].startswith("the reply stopped after"), first["error"]
    assert "rank 2" in first["error"] and "\n" not in first["error"]
    assert first["kept"] == tokens[:len(first["kept"])] and len(first["kept"]) >= 3
    assert first["one"] == tokens  # the same model on one machine, same process
    for address in addresses:  # both waiters back to waiting: rank 1 lost its group
        _idle(address)
    _stop(waiters[1][1])  # waiter 2's machine is gone
    left = _drive(starter, strata_home, addresses[:1], kill=False, kvdir=tmp_path)
    assert left["split"] == ["pipeline", 2]
    assert left["kinds"] == ["PagedLayerCache"]
    assert left["tokens"] == tokens
    # Weights per rank: rank 0 the embedding, the final norm and 15 layers, rank 1 the other
    # 15 (one machine: the layers are shared equally); the 30 layers are the same size.
    full, whole = reference["bytes"], reference["whole"]
    assert left["weights"] == [whole + (full - whole) // 2, (full - whole) // 2], left

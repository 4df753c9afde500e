"""A model split across local ranks measured (`strata bench cluster`): 1, 2 and 3 ranks, one run.

Contract: `measure(model, ranks, prompt_tokens, max_tokens, split)` runs one greedy reply in a
child process of its own (MLX's distributed group is process-global: one group per process,
so each rank count needs a fresh rank 0) and returns its figures: load seconds, first token,
prefill and decode tokens per second, each rank's weight bytes (its share, as it reports it)
and resident memory after the reply, and the bytes each rank sent per decoded token, both
counted from the tensors (engine.runtime.cluster_split.step_bytes) and measured as the
growth of the TCP bytes each local rank's sockets sent (the kernel's per-socket counters,
read with `ss`; the ring's sockets and the control line) between the first token and the
last. One
rank is the unsplit model. `run(args)` prints a table and writes JSON with --json. The ranks
are local processes on loopback: on one machine they share its cores and memory bandwidth,
so this measures the split's overheads, not a cluster's speed (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from engine.bench.common import REPO, machine_facts, prompt_ids, say
from engine.errors import StrataError


def _sent(pids: list[int]) -> list[int | None]:
    """TCP bytes each process has sent on its open sockets (the kernel's per-socket
    `bytes_sent`, read with iproute2's `ss`); None for all where `ss` is missing."""
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=10,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return [None] * len(pids)
    sent = dict.fromkeys(pids, 0)
    owners: list[int] = []
    for row in out.splitlines():
        if "users:((" in row:  # a socket's first line names its processes
            owners = [int(m.split(",")[0]) for m in row.split("pid=")[1:]]
        elif "bytes_sent:" in row:
            n = int(row.split("bytes_sent:")[1].split()[0])
            for pid in owners:
                if pid in sent:
                    sent[pid] += n
            owners = []
    return [sent[p] for p in pids]


def _child(model: str, ranks: int, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    """One reply on `ranks` ranks (rank 0 here); the figures as `measure` returns them."""
    import psutil  # third-party, only in the measuring child

    # The runtime (and MLX) load only in the measuring child: the parent runs no model.
    from engine.runtime.cluster import start_local  # the child's own MLX group
    from engine.runtime.cluster_split import share_bytes  # as above
    from engine.runtime.generate import LoadedModel, generate  # as above
    from engine.runtime.sampling import SamplingParams  # as above

    t0 = time.perf_counter()
    cluster = start_local(model, ranks) if ranks > 1 else None
    lm = cluster.lm if cluster is not None else LoadedModel.load(model)
    load_s = time.perf_counter() - t0
    pids = [os.getpid()] + ([p.pid for p in cluster.procs] if cluster is not None else [])
    ids = [lm.tokenizer.bos_id or 0] + prompt_ids(lm.tokenizer, prompt_tokens - 1)
    first: tuple[list[int | None], int] | None = None
    last: Any = None
    try:
        for ev in generate(lm, ids, SamplingParams(temperature=0.0), max_tokens,
                           prefix_cache=False, drafter="off"):
            if ev.token is not None and first is None:
                sent = cluster.split.sent_bytes if cluster is not None else 0
                first = (_sent(pids), sent)
            last = ev
        assert last is not None and first is not None
        after = _sent(pids)
        decoded = max(1, last.generated_tokens - 1)
        counted = ((cluster.split.sent_bytes - first[1]) / decoded) if cluster else 0.0
        measured = [None if a is None or b is None else (a - b) / decoded
                    for a, b in zip(after, first[0], strict=True)]
        per_rank = (cluster.ranks if cluster is not None
                    else [{"rank": 0, "weights_bytes": share_bytes(lm.model)}])
        for r, pid in zip(per_rank, pids, strict=True):
            r["rss_after_bytes"] = int(psutil.Process(pid).memory_info().rss)
        return {
            "ranks": ranks, "split": cluster.plan.mode if cluster is not None else "none",
            "load_s": load_s, "ttft_s": last.ttft_s, "prefill_tps": last.prefill_tps,
            "decode_tps": last.decode_tps, "prompt_tokens": last.prompt_tokens,
            "generated_tokens": last.generated_tokens,
            "sent_bytes_per_token_counted": counted,
            "sent_bytes_per_token_measured": measured, "per_rank": per_rank,
        }
    finally:
        if cluster is not None:
            cluster.close()


def measure(model: str, ranks: int, prompt_tokens: int, max_tokens: int,
            split: str | None = None, timeout: float = 900) -> dict[str, Any]:
    """One reply on `ranks` local ranks, in a fresh child process (see the contract)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if split:
        env["STRATA_CLUSTER_SPLIT"] = split
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench.cluster", "--child", model, str(ranks),
         str(prompt_tokens), str(max_tokens)], env=env, cwd=REPO, capture_output=True,
        text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise StrataError(f"bench cluster: {ranks} ranks failed ({tail})")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.0f}"


def run(args: argparse.Namespace) -> int:
    """`strata bench cluster`: the same reply on each of --cluster-ranks (default 1,2,3)."""
    try:
        counts = [int(r) for r in str(args.cluster_ranks).split(",") if r]
    except ValueError as exc:
        raise StrataError(f"--cluster-ranks {args.cluster_ranks}: not a list of numbers"
                          ) from exc
    if not counts or min(counts) < 1:
        raise StrataError(f"--cluster-ranks {args.cluster_ranks}: at least one rank each")
    prompt_tokens = args.prompt_tokens or 128
    max_tokens = args.max_tokens or 32
    results = []
    for n in counts:
        say(f"{n} rank{'s' if n > 1 else ''}: {prompt_tokens} prompt tokens, {max_tokens} "
            "generated")
        results.append(measure(args.model, n, prompt_tokens, max_tokens, args.cluster_split))
    print(f"{'ranks':>5} {'split':8} {'load s':>7} {'first s':>8} {'prefill/s':>9} "
          f"{'decode/s':>8} {'sent B/token (counted; measured per rank)':>44}  "
          "weights MB per rank; RSS MB per rank")
    for r in results:
        measured = ", ".join("-" if m is None else f"{m:.0f}"
                             for m in r["sent_bytes_per_token_measured"])
        weights = "/".join(_mb(p["weights_bytes"]) for p in r["per_rank"])
        rss = "/".join(_mb(p["rss_after_bytes"]) for p in r["per_rank"])
        print(f"{r['ranks']:5d} {r['split']:8} {r['load_s']:7.1f} {r['ttft_s']:8.2f} "
              f"{r['prefill_tps']:9.1f} {r['decode_tps']:8.2f} "
              f"{r['sent_bytes_per_token_counted']:>14.0f}; {measured:<27}  {weights}; {rss}")
    if args.json_out:
        out = {"suite": "cluster", "model": args.model, "prompt_tokens": prompt_tokens,
               "max_tokens": max_tokens, "machine": machine_facts(), "results": results}
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":  # measure's child: one reply, its figures as one JSON line
    if len(sys.argv) != 6 or sys.argv[1] != "--child":
        sys.exit("usage: python -m engine.bench.cluster --child MODEL RANKS PROMPT MAX")
    print(json.dumps(_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                            int(sys.argv[5]))))

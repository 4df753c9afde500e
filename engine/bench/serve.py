"""`strata bench serve`: aggregate generated tokens per second with concurrent streaming clients.

Contract: starts a real `strata serve` (the command next to this Python) on a free loopback
port with the chosen model, and sends the same greedy chat requests (`--requests`, one
question each, `--max-tokens` tokens at most) from 1, 2, 4, 8 (`--clients`) concurrent
clients: the official `openai` client, one thread each, streaming, each client sending its
share of the requests one after another. Aggregate tok/s is all the tokens generated over the
wall time from the first request to the last finish; every configuration does the same
requests, so the ratios against one client compare like with like. Each reply is checked
against one client's (sequential greedy runs): the tokens must be the same. `--trials` rounds,
client counts interleaved (the machine is shared and noisy): medians, min-max, the ratio of
medians and the median of each trial's own ratio.
Prints a table; `--json FILE` keeps everything with the machine's facts.
"""

from __future__ import annotations

import argparse
import os
import re
import selectors
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from engine.bench.common import machine_facts, say
from engine.bench.stats import stat, write_json

QUESTIONS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
    "Describe a walk through a forest in autumn.", "What makes a good breakfast?",
    "Tell me about the history of the printing press.", "How do airplanes fly?",
    "Describe your ideal city.", "Why do people keep pets?",
    "Explain photosynthesis to a child.", "What is the best way to learn a language?",
    "Describe a busy market.", "How is bread made?", "Tell me about the moon.",
    "What should I pack for a trip to the mountains?", "Explain how rain forms.",
    "Describe a day in the life of a baker.",
]
CLIENTS = "1,2,4,8"
MAX_TOKENS = 64
TRIALS = 3
TARGET = 2.5  # the issue's: four clients against one


def _strata() -> list[str]:
    """The `strata` command of this environment."""
    here = Path(sys.executable).parent / "strata"
    found = str(here) if here.exists() else shutil.which("strata")
    if found is None:
        raise SystemExit("strata bench serve: no `strata` command next to this Python")
    return [found]


class _Server:
    """A `strata serve` subprocess on a free loopback port."""

    def __init__(self, model: str, max_batch: int, log: Path) -> None:
        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [*_strata(), "serve", "--port", "0", "--model", model,
                 "--max-batch", str(max_batch)],
                stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ))
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        line = self.proc.stdout.readline() if sel.select(timeout=300) else ""
        match = re.search(r"http://\S+/v1", line)
        if not match:
            self.close()
            raise SystemExit(f"strata serve did not start: {log.read_text()[-1000:]}")
        self.url = match.group(0)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _one(client: Any, model: str, question: str, max_tokens: int) -> tuple[str, int]:
    """One streamed greedy reply: its text and completion tokens (from the usage chunk)."""
    parts, tokens = [], 0
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}],
            max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(parts), tokens


def _round(url: str, model: str, clients: int, questions: list[str], max_tokens: int
           ) -> tuple[float, int, list[str]]:
    """`clients` threads share `questions` (client k takes every clients-th one, in order);
    (wall seconds, tokens generated, replies in question order)."""
    import openai  # the official client: only this suite needs it

    replies: list[str] = [""] * len(questions)
    counts = [0] * len(questions)
    errors: list[BaseException] = []
    gate = threading.Barrier(clients + 1)

    def client(k: int) -> None:
        with openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600) as c:
            gate.wait()
            try:
                for i in range(k, len(questions), clients):
                    replies[i], counts[i] = _one(c, model, questions[i], max_tokens)
            except BaseException as exc:  # noqa: BLE001  (reported after the round)
                errors.append(exc)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"strata bench serve: a request failed: {errors[0]}")
    return wall, sum(counts), replies


def run(args: argparse.Namespace) -> int:
    clients = [int(c) for c in (args.clients or CLIENTS).split(",") if c.strip()]
    max_tokens = args.max_tokens or MAX_TOKENS
    trials = args.trials or TRIALS
    questions = QUESTIONS[: args.requests]
    facts = machine_facts()
    say(f"bench serve: {args.model}, clients {clients}, {len(questions)} requests of at most "
        f"{max_tokens} tokens, {trials} trials; load {facts['load_average']}; "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
        f"STRATA_BATCH_BLAS_THREADS={os.environ.get('STRATA_BATCH_BLAS_THREADS', 'unset')}")
    log = Path(tempfile.mkdtemp(prefix="strata-bench-serve-")) / "serve.log"
    server = _Server(args.model, max(clients), log)
    rows: dict[int, list[float]] = {c: [] for c in clients}
    tokens: dict[int, int] = {}
    same: dict[int, bool] = {c: True for c in clients}
    try:
        _round(server.url, args.model, 1, questions[:1], 4)  # warm: first-call costs
        wall, n, reference = _round(server.url, args.model, 1, questions, max_tokens)
        say(f"  reference (1 client, sequential greedy): {n} tokens in {wall:.1f} s")
        for trial in range(trials):
            for c in clients:
                wall, n, replies = _round(server.url, args.model, c, questions, max_tokens)
                rows[c].append(n / wall)
                tokens[c] = n
                same[c] = same[c] and replies == reference
                say(f"  trial {trial + 1}: {c} clients {n / wall:6.1f} tok/s ({n} tokens, "
                    f"{wall:.1f} s){'' if replies == reference else ', REPLIES DIFFER'}")
    finally:
        server.close()
    base = stat(rows[clients[0]])["median"]
    result: dict[str, Any] = {"suite": "serve", "model": args.model, "max_tokens": max_tokens,
                              "requests": len(questions), "trials": trials,
                              "machine": facts, "load_after": list(os.getloadavg()),
                              "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
                              # unset: the server's batch decodes on one OpenBLAS thread
                              "batch_blas_threads": os.environ.get("STRATA_BATCH_BLAS_THREADS"),
                              "figures": {}}
    print(f"\nstrata bench serve: {args.model}, {len(questions)} greedy streamed requests "
          f"of at most {max_tokens} tokens, {trials} trials")
    print(f"{'clients':>8} {'tok/s median':>13} {'min-max':>14} {'x vs ' + str(clients[0]):>8}"
          f" {'x paired':>9} {'tokens':>7} {'same tokens':>12}")
    for c in clients:
        s = stat(rows[c])
        x = s["median"] / base if base else 0.0
        # Each trial's ratio against the same trial's first configuration (minutes apart,
        # not a whole run): the load of the moment cancels more.
        paired = stat(a / b for a, b in zip(rows[c], rows[clients[0]], strict=True) if b)
        result["figures"][str(c)] = {"aggregate_tps": s, "ratio": x, "paired_ratio": paired,
                                     "tokens": tokens[c], "same_tokens": same[c]}
        print(f"{c:>8} {s['median']:>13.1f} {s['min']:>6.1f}-{s['max']:<7.1f} {x:>8.2f}"
              f" {paired['median']:>9.2f} {tokens[c]:>7} {'yes' if same[c] else 'NO':>12}")
    if 4 in rows and clients[0] == 1:
        x4 = result["figures"]["4"]["ratio"]
        p4 = result["figures"]["4"]["paired_ratio"]["median"]
        print(f"4 clients: x{x4:.2f} one client's aggregate tok/s, x{p4:.2f} paired by trial "
              f"(target x{TARGET})")
    if args.json_out:
        write_json(result, args.json_out)
    return 0 if all(same.values()) else 1

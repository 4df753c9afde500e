"""`strata bench kv`: decode speed of the paged KV cache against mlx-lm's KVCache, same run.

Contract: `run(args)` is the suite. For each context length, one prefill with mlx-lm's
KVCache (or, with --prefill-paged, a second prefill through the paged cache, which checks
prefill exactness); the paged cache is filled with the very same keys and values, then every
mode decodes greedily from the same logits. Reported per mode: generated tok/s, ratio to
mlx-lm, greedy tokens identical to mlx-lm's, first-step max |logit difference|, pages and
bytes read per token, RSS. With --synthetic-fill N every context is instead filled by tiling
one real N-token prefill (engine/bench/fill.py; rows say "synthetic"). --passkey runs the
pass-key table (engine/bench/passkey.py); --context N one long context on the SSD tier
(engine/bench/longrun.py). Ctrl-C prints and writes what finished.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.bench.common import machine_facts, prompt_ids, say, tenths
from engine.bench.fill import doc_kv, paged_cache, tiled_mlx_cache
from engine.bench.longrun import LongOptions, format_long, run_long
from engine.bench.passkey import PasskeyCell, passkey_table, run_passkey, sparse_matches_exact
from engine.bench.system import rss_bytes
from engine.errors import StrataError
from engine.kv import KVSettings, close_caches
from engine.runtime.generate import LoadedModel
from engine.runtime.model import cache_module


def _decode(lm: Any, cache: list[Any], first: Any, n: int,
            settle: Callable[[], None] | None = None) -> tuple[list[int], float, Any]:
    """Greedy decode n tokens from logits `first`; returns tokens, tok/s, first-step logits.
    `settle` runs after the first step, before the timed ones."""
    y = mx.argmax(first, axis=-1)
    toks: list[int] = []
    step1 = None
    t0 = time.perf_counter()
    for i in range(n):
        toks.append(int(y.item()))  # type: ignore[arg-type]
        if i == 1:
            if settle is not None:
                mx.eval(y)
                settle()
            t0 = time.perf_counter()  # the first step pays one-off costs (graph, pool growth)
        logits = lm.model(y[None], cache=cache)[:, -1, :]
        if step1 is None:
            step1 = logits
        y = mx.argmax(logits, axis=-1)
    mx.eval(y)
    dt = time.perf_counter() - t0
    return toks, (n - 1) / dt if dt > 0 else 0.0, step1


def _prefill(lm: Any, cache: list[Any], ids: list[int], progress: Callable[[int, int], None]
             ) -> Any:
    step = 512
    for i in range(0, len(ids) - 1, step):
        chunk = ids[i:min(i + step, len(ids) - 1)]
        lm.model(mx.array(chunk)[None], cache=cache)
        mx.eval([c.state for c in cache])
        progress(i + len(chunk), len(ids))
    out = lm.model(mx.array(ids[-1:])[None], cache=cache)[:, -1, :]
    mx.eval(out)
    return out


def _fill_from(paged: list[Any], ref: list[Any]) -> None:
    """Copy an mlx-lm KVCache's keys and values into the paged cache, chunk by chunk."""
    for p, r in zip(paged, ref, strict=True):
        n = r.offset
        for i in range(0, n, 4096):
            j = min(n, i + 4096)
            p.update_and_fetch(r.keys[..., i:j, :], r.values[..., i:j, :])
        mx.eval(p.state)


def run(args: argparse.Namespace) -> int:
    """The suite: the speed table, or --passkey's table, or --context's long run."""
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("mlx", "exact", "sparse"):
            raise StrataError(f"bench kv: unknown mode {m!r} (mlx, exact, sparse)")
    lm = LoadedModel.load(args.model)
    if args.passkey:
        return _run_passkey(lm, args)
    if args.context:
        return _run_long(lm, args, modes)
    return _run_contexts(lm, args, modes)


def _write_json(args: argparse.Namespace, lm: Any, doc: dict[str, Any]) -> None:
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"schema": "strata-bench-kv/2", "model": lm.manifest["name"],
             "profile": lm.profile.name, "page_tokens": args.page_tokens,
             "kv_bits": args.kv_bits, "command": " ".join(sys.argv),
             "machine": machine_facts(), **doc}, indent=2))


def _run_contexts(lm: Any, args: argparse.Namespace, modes: list[str]) -> int:
    """Decode speed per context and mode (the table); Ctrl-C keeps what finished."""
    rows: list[dict[str, Any]] = []
    doc = None
    fill = "prefill"
    if args.synthetic_fill:
        say(f"synthetic fill: one real prefill of {args.synthetic_fill} tokens with mlx-lm's "
             "KVCache; every context and subject gets its KV tiled to length")
        doc = doc_kv(lm, args.synthetic_fill, args.page_tokens, tenths())
        fill = f"synthetic (tiled real KV of {doc.tokens} tokens)"
    complete = True
    try:
        for ctx in [int(c) for c in args.contexts.split(",") if c]:
            if doc is not None:
                ref_cache, first, prefill_s = tiled_mlx_cache(doc, ctx), doc.logits, 0.0
                ids: list[int] = []
            else:
                ids = prompt_ids(lm.tokenizer, ctx)
                say(f"context {ctx}: prefill with mlx-lm's KVCache")
                t = time.perf_counter()
                ref_cache = cache_module().make_prompt_cache(lm.model)
                first = _prefill(lm, ref_cache, ids, tenths())
                prefill_s = time.perf_counter() - t
            settings = KVSettings(mode="exact", page_tokens=args.page_tokens,
                                  ram_mb=args.kv_ram_mb, bits=args.kv_bits,
                                  budget_tokens=args.kv_budget).validate()
            paged, store = paged_cache(lm.model, settings)
            paged_first = None
            paged_prefill_s = None
            if args.prefill_paged and ids:
                say(f"context {ctx}: prefill through the paged cache")
                t = time.perf_counter()
                paged_first = _prefill(lm, paged, ids, tenths())
                paged_prefill_s = time.perf_counter() - t
            else:
                _fill_from(paged, ref_cache)
            base_tokens: list[int] | None = None
            base_logits = None
            for mode in modes:
                rss0 = rss_bytes()
                if mode == "mlx":
                    cache, start = ref_cache, first
                else:
                    store.settings = settings.with_(mode=mode)
                    for c in paged:
                        c.trim(c.offset - ctx)  # back to the prompt after the previous mode
                        c.follow_settings()     # sparse: no buffer of every position
                    cache, start = paged, (paged_first if paged_first is not None else first)
                before = dict(store.counters)
                # A synthetic fill leaves the SSD writes a real prefill makes as it goes (the
                # pages past the buffer, `write_behind`) to the first decode steps: done
                # before the timed steps, which measure decode at this depth.
                toks, tps, step1 = _decode(lm, cache, start, args.gen,
                                           None if mode == "mlx" or ids else store.flush)
                row: dict[str, Any] = {"context": ctx, "mode": mode, "fill": fill,
                                       "gen_tokens": args.gen, "decode_tps": round(tps, 2),
                                       "rss_bytes": max(rss0, rss_bytes())}
                if mode == "mlx":
                    base_tokens, base_logits = toks, np.array(step1)
                else:
                    reads = store.counters["bytes_read"] - before["bytes_read"]
                    row["ssd_bytes_read_per_token"] = reads / args.gen
                    row["budget_tokens"] = args.kv_budget if mode == "sparse" else ctx
                    attended = min(ctx, args.kv_budget) if mode == "sparse" else ctx
                    row["kv_bytes_attended_per_token"] = attended * store.n_layers * \
                        store.page_bytes // store.P
                if base_tokens is not None and mode != "mlx":
                    same = sum(a == b for a, b in zip(base_tokens, toks, strict=True))
                    row["tokens_same_as_mlx"] = f"{same}/{len(toks)}"
                    row["identical"] = toks == base_tokens
                    row["max_abs_logit_diff_step1"] = float(np.abs(np.array(step1) -
                                                                  base_logits).max())
                rows.append(row)
                say(f"  {ctx} {mode:7} {tps:7.2f} tok/s  {row.get('tokens_same_as_mlx', '')}")
            extra: dict[str, Any] = {"context": ctx, "prefill_s_mlx": round(prefill_s, 1)}
            if paged_first is not None:
                extra["prefill_s_paged"] = round(paged_prefill_s or 0.0, 1)
                extra["prefill_max_abs_logit_diff"] = float(np.abs(np.array(paged_first) -
                                                                   np.array(first)).max())
                extra["prefill_greedy_same"] = bool(mx.argmax(paged_first, -1).item() ==
                                                    mx.argmax(first, -1).item())
            if doc is None:
                rows.append(extra)
            close_caches(paged)
            del ref_cache, paged
    except KeyboardInterrupt:
        complete = False
        say("interrupted: reporting what finished")
    print(format_contexts(rows, lm, args, fill))
    _write_json(args, lm, {"suite": "kv", "complete": complete, "fill": fill,
                           "budget_tokens": args.kv_budget, "gen_tokens": args.gen,
                           "rows": rows})
    return 0 if complete else 130


def format_contexts(rows: list[dict[str, Any]], lm: Any, args: argparse.Namespace,
                    fill: str) -> str:
    """The speed table as text: tok/s per context and mode, ratio to mlx-lm."""
    base = {r["context"]: r["decode_tps"] for r in rows if r.get("mode") == "mlx"}
    out = [f"\nmodel {lm.manifest['name']}, profile {lm.profile.name}, page {args.page_tokens} "
           f"tokens, sparse budget {args.kv_budget}, {args.gen} tokens per subject"
           + ("" if args.kv_bits == 16 else f", paged KV at {args.kv_bits} bits"),
           f"KV fill: {fill}",
           f"{'context':>8} {'mode':7} {'tok/s':>8} {'x mlx':>6} {'same tokens':>12} "
           f"{'max|dlogit|':>12} {'RSS MB':>8}"]
    for r in rows:
        if "mode" not in r:
            rest = {k: v for k, v in r.items() if k != "context"}
            out.append(f"{r['context']:>8} prefill {json.dumps(rest)}")
            continue
        ratio = r["decode_tps"] / base[r["context"]] if base.get(r["context"]) else float("nan")
        out.append(f"{r['context']:>8} {r['mode']:7} {r['decode_tps']:8.2f} {ratio:6.2f} "
                   f"{r.get('tokens_same_as_mlx', '-'):>12} "
                   f"{r.get('max_abs_logit_diff_step1', float('nan')):12.2e} "
                   f"{r['rss_bytes'] / 2**20:8.0f}")
    return "\n".join(out)


def _run_passkey(lm: Any, args: argparse.Namespace) -> int:
    """The pass-key table; cells are kept as they finish, so Ctrl-C still reports them."""
    lengths = [int(x) for x in args.passkey_lengths.split(",") if x]
    depths = [int(x) / 100 for x in args.passkey_depths.split(",") if x]
    cells: list[PasskeyCell] = []

    def on_cell(c: PasskeyCell) -> None:
        cells.append(c)
        say(f"  {c.target:>6} {c.depth:4.0%} {c.mode:6} budget {c.budget_tokens:>5}: "
             f"{'found' if c.found else 'NOT found'} (key {c.key}, answer {c.answer!r})")

    complete = True
    try:
        run_passkey(lm, lengths, depths, ("exact", "sparse"),
                    budget_fraction=args.passkey_fraction, seed=args.seed, on_cell=on_cell)
    except KeyboardInterrupt:
        complete = False
        say("interrupted: reporting what finished")
    goal = sparse_matches_exact(cells)
    print(f"\npass key, model {lm.manifest['name']}, profile {lm.profile.name}; one prefill "
          "per prompt, both modes decode from its pages (the last prompt token and the answer "
          f"are decode steps); pages of 64 tokens, sinks 64, window 128; sparse budget "
          f"{args.passkey_fraction:g} of the prompt in whole pages; Y found, - not found")
    print(passkey_table(cells))
    print(f"sparse finds the key wherever exact does: {'yes' if goal else 'NO'}")
    _write_json(args, lm, {"suite": "kv-passkey", "complete": complete,
                           "sparse_matches_exact": goal,
                           "cells": [c.as_dict() for c in cells]})
    return 0 if complete else 130


def _run_long(lm: Any, args: argparse.Namespace, modes: list[str]) -> int:
    """One long context on the SSD tier (see engine.bench.longrun)."""
    if "mlx" in modes:
        say("mlx: skipped (mlx-lm's KVCache keeps the whole context in memory; this run is "
             "about a context that does not fit)")
    # Sparse first: exact reads every page per token and may take minutes at this length.
    order = [m for m in ("sparse", "exact") if m in modes]
    opts = LongOptions(context=args.context, modes=tuple(order),
                       gen=args.gen, exact_tokens=args.exact_tokens,
                       page_tokens=args.page_tokens, budget_tokens=args.kv_budget,
                       ram_mb=args.kv_ram_mb or 1024, kv_dtype=args.kv_dtype,
                       doc_tokens=args.fill_doc, end_to_end=args.end_to_end, seed=args.seed)
    report = run_long(lm, opts, say)
    print(format_long(report, lm))
    _write_json(args, lm, {"suite": "kv-long", **report})
    return 0 if report.get("complete") else 130

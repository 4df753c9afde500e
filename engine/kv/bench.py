"""`strata bench kv`: decode speed of the paged KV cache against mlx-lm's KVCache, same run.

Contract: for each context length, one prefill with mlx-lm's KVCache (or, with
--prefill-paged, a second prefill through the paged cache, which checks prefill exactness);
the paged cache is filled with the very same keys and values, then every mode decodes greedily
from the same logits. Reported per mode: generated tok/s, ratio to mlx-lm, greedy tokens
identical to mlx-lm's, first-step max |logit difference|, pages and bytes read per token, RSS.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from engine.errors import StrataError


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("kv suite")
    g.add_argument("--contexts", default="4096,16384",
                   help="kv: comma-separated context lengths (default 4096,16384)")
    g.add_argument("--modes", default="mlx,exact,sparse", help="kv: subjects to decode with")
    g.add_argument("--gen", type=int, default=32, help="kv: tokens generated per subject")
    g.add_argument("--kv-budget", type=int, default=2048, help="kv: sparse token budget")
    g.add_argument("--kv-ram-mb", type=int, help="kv: RAM tier budget (default: derived)")
    g.add_argument("--page-tokens", type=int, default=128, help="kv: tokens per page")
    g.add_argument("--prefill-paged", action="store_true",
                   help="kv: also prefill through the paged cache and compare logits")


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _decode(lm: Any, cache: list[Any], first: Any, n: int) -> tuple[list[int], float, Any]:
    """Greedy decode n tokens from logits `first`; returns tokens, tok/s, first-step logits."""
    import mlx.core as mx

    y = mx.argmax(first, axis=-1)
    toks: list[int] = []
    step1 = None
    t0 = time.perf_counter()
    for i in range(n):
        toks.append(int(y.item()))  # type: ignore[arg-type]
        if i == 1:
            t0 = time.perf_counter()  # the first step pays one-off costs (graph, pool growth)
        logits = lm.model(y[None], cache=cache)[:, -1, :]
        if step1 is None:
            step1 = logits
        y = mx.argmax(logits, axis=-1)
    mx.eval(y)
    dt = time.perf_counter() - t0
    return toks, (n - 1) / dt if dt > 0 else 0.0, step1


def _prefill(lm: Any, cache: list[Any], ids: list[int], progress: Any) -> Any:
    import mlx.core as mx

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
    import mlx.core as mx

    for p, r in zip(paged, ref, strict=True):
        n = r.offset
        for i in range(0, n, 4096):
            j = min(n, i + 4096)
            p.update_and_fetch(r.keys[..., i:j, :], r.values[..., i:j, :])
        mx.eval(p.state)


def run_kv(args: argparse.Namespace) -> int:
    import mlx.core as mx
    import numpy as np

    from engine.bench import machine_facts, prompt_ids
    from engine.kv import KVSettings, make_paged_cache
    from engine.kv.cache import close_caches
    from engine.runtime.generate import LoadedModel
    from engine.runtime.model import cache_module

    lm = LoadedModel.load(args.model)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("mlx", "exact", "sparse"):
            raise StrataError(f"bench kv: unknown mode {m!r} (mlx, exact, sparse)")
    rows: list[dict[str, Any]] = []
    for ctx in [int(c) for c in args.contexts.split(",") if c]:
        ids = prompt_ids(lm.tokenizer, ctx)
        print(f"context {ctx}: prefill with mlx-lm's KVCache", file=sys.stderr, flush=True)
        t = time.perf_counter()
        ref_cache = cache_module().make_prompt_cache(lm.model)
        last = [-1]

        def progress(done: int, total: int, last: list[int] = last) -> None:
            if done * 10 // total != last[0]:
                last[0] = done * 10 // total
                print(f"  {done}/{total}", file=sys.stderr, flush=True)

        first = _prefill(lm, ref_cache, ids, progress)
        prefill_s = time.perf_counter() - t
        settings = KVSettings(mode="exact", page_tokens=args.page_tokens, ram_mb=args.kv_ram_mb,
                              budget_tokens=args.kv_budget).validate()
        paged = make_paged_cache(lm.model, settings)
        paged_first = None
        paged_prefill_s = None
        if args.prefill_paged:
            print(f"context {ctx}: prefill through the paged cache", file=sys.stderr, flush=True)
            t = time.perf_counter()
            paged_first = _prefill(lm, paged, ids, progress)
            paged_prefill_s = time.perf_counter() - t
        else:
            _fill_from(paged, ref_cache)
        store = paged[0].store
        base_tokens: list[int] | None = None
        base_logits = None
        for mode in modes:
            rss0 = _rss()
            if mode == "mlx":
                cache, start = ref_cache, first
            else:
                store.settings = settings.with_(mode=mode)
                for c in paged:
                    c.trim(c.offset - ctx)  # back to the prompt after the previous mode
                cache, start = paged, (paged_first if paged_first is not None else first)
            before = dict(store.counters)
            toks, tps, step1 = _decode(lm, cache, start, args.gen)
            row: dict[str, Any] = {"context": ctx, "mode": mode, "gen_tokens": args.gen,
                                   "decode_tps": round(tps, 2), "rss_bytes": max(rss0, _rss())}
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
            print(f"  {mode:7} {tps:7.2f} tok/s  {row.get('tokens_same_as_mlx', '')}",
                  file=sys.stderr, flush=True)
        extra = {"context": ctx, "prefill_s_mlx": round(prefill_s, 1)}
        if paged_first is not None:
            extra["prefill_s_paged"] = round(paged_prefill_s or 0.0, 1)
            extra["prefill_max_abs_logit_diff"] = float(np.abs(np.array(paged_first) -
                                                               np.array(first)).max())
            extra["prefill_greedy_same"] = bool(mx.argmax(paged_first, -1).item() ==
                                                mx.argmax(first, -1).item())
        rows.append(extra)
        close_caches(paged)
        del ref_cache, paged
    base = {r["context"]: r["decode_tps"] for r in rows if r.get("mode") == "mlx"}
    print(f"\nmodel {lm.manifest['name']}, profile {lm.profile.name}, page {args.page_tokens} "
          f"tokens, sparse budget {args.kv_budget}, {args.gen} tokens per subject")
    print(f"{'context':>8} {'mode':7} {'tok/s':>8} {'x mlx':>6} {'same tokens':>12} "
          f"{'max|dlogit|':>12} {'RSS MB':>8}")
    for r in rows:
        if "mode" not in r:
            rest = {k: v for k, v in r.items() if k != "context"}
            print(f"{r['context']:>8} prefill {json.dumps(rest)}")
            continue
        ratio = r["decode_tps"] / base[r["context"]] if base.get(r["context"]) else float("nan")
        print(f"{r['context']:>8} {r['mode']:7} {r['decode_tps']:8.2f} {ratio:6.2f} "
              f"{r.get('tokens_same_as_mlx', '-'):>12} "
              f"{r.get('max_abs_logit_diff_step1', float('nan')):12.2e} "
              f"{r['rss_bytes'] / 2**20:8.0f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"schema": "strata-bench-kv/1", "model": lm.manifest["name"],
             "profile": lm.profile.name, "page_tokens": args.page_tokens,
             "budget_tokens": args.kv_budget, "machine": machine_facts(), "rows": rows},
            indent=2))
    return 0

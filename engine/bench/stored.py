"""`strata bench stored`: a long context stored on the SSD, then a new question after a restart.

Contract: one child process builds the stored context without a forward pass over it (a
synthetic fill, said so in the output: the real KV of a `--fill-doc`-token document
prefill, tiled to `--context` tokens, stored as prefix pages through
`PrefixCache.store_pages`); then, for each KV mode, a fresh child loads the model, asks a
question after that context (prompt = the context's ids, then a chat-templated question) and
reports its first-token time, the cache restore, the tokens restored, its peak RSS and MLX
peak. Positions repeat every fill-doc tokens, so what the model says means nothing; the
figure is the cost of getting a long stored context back. Children print one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.bench.common import run_child
from engine.bench.fill import doc_kv
from engine.kv import KVSettings, settings_from_env
from engine.kv.prefix import PrefixSettings
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.sampling import SamplingParams
from engine.telemetry import Timeline

QUESTION = "What is this text about? Answer in one sentence."


def _ids(lm: Any, doc_ids: list[int], context: int) -> tuple[list[int], list[int]]:
    """The stored context's ids (the document repeated) and the question's."""
    reps = -(-context // len(doc_ids))
    ctx = (doc_ids * reps)[:context]
    q = lm.tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    return ctx, q


def _child(mode: str, job: dict[str, Any]) -> dict[str, Any]:
    # The RAM tier's budget as the user's (STRATA_KV_RAM_MB, else a quarter of memory): pages
    # a step reads from the SSD stay in RAM as far as it allows, which is most of peak RSS.
    kv = KVSettings(mode=job["kv_mode"] if mode == "ask" else "exact",
                    budget_tokens=job["budget"], ssd_dir=Path(job["tmp"]) / "kv",
                    ram_mb=settings_from_env().ram_mb)
    lm = LoadedModel.load(job["model"])
    lm.kv_settings = kv
    pc = lm.enable_prefix_cache(PrefixSettings(folder=Path(job["folder"]),
                                               budget_mb=job["budget_mb"]))
    if mode == "build":
        t = time.perf_counter()
        doc = doc_kv(lm, job["fill_doc"])
        ctx, _ = _ids(lm, doc.ids, job["context"])
        # The askers rebuild the same prompt from the document's ids (no prefill there).
        Path(job["tmp"], "doc-ids.json").write_text(json.dumps(doc.ids))
        plan = pc.lookup(ctx + [0])
        P = pc.P
        per = doc.tokens // P  # pages per repeat of the document
        keys = [np.array(k[0]) for k in doc.keys]
        values = [np.array(v[0]) for v in doc.values]
        start = 0
        while start < len(plan.hashes):
            n = min(per, len(plan.hashes) - start)
            pc.store_pages(ctx, plan, start, [k[:, :n * P] for k in keys],
                           [v[:, :n * P] for v in values])
            pc.flush()
            start += n
        return {"stored_tokens": len(plan.hashes) * P, "doc_prefill_s": doc.prefill_s,
                "build_s": time.perf_counter() - t, "disk_bytes": pc.disk_bytes()}
    doc_ids = json.loads(Path(job["ids"]).read_text())
    ctx, q = _ids(lm, doc_ids, job["context"])
    prompt = ctx + q
    tl = Timeline()
    t0 = time.perf_counter()
    last = None
    text = []
    for ev in generate(lm, prompt, SamplingParams(temperature=0), job["max_tokens"],
                       timeline=tl):
        text.append(ev.text)
        last = ev
    assert last is not None
    phases = {name: round(s, 4) for name, s in tl.durations().items()}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": job["kv_mode"], "ttft_s": last.ttft_s, "wall_s": time.perf_counter() - t0,
            "prompt_tokens": last.prompt_tokens, "cached_tokens": last.cached_tokens,
            "decode_tps": last.decode_tps, "peak_rss_bytes": rss,
            "mlx_peak_bytes": int(mx.get_peak_memory()), "phases": phases,
            "text": "".join(text)}


def _spawn(mode: str, job: dict[str, Any], tmp: Path) -> dict[str, Any]:
    return run_child("engine.bench.stored", job,
                     tmp / f"job-{mode}-{job.get('kv_mode', '')}.json",
                     f"bench stored: the {mode} child", mode)


def run(args: argparse.Namespace) -> int:
    """The suite: build once, ask in each of `--paged-modes` (default sparse,exact)."""
    context = args.context or 131072
    fill = args.fill_doc or 2048
    modes = (args.paged_modes or "sparse").split(",")
    with tempfile.TemporaryDirectory(prefix="strata-stored-") as d:
        tmp = Path(d)
        job: dict[str, Any] = {"model": args.model or "starter", "context": context,
                               "fill_doc": fill, "folder": str(tmp / "px"), "tmp": str(tmp),
                               "budget": args.kv_budget or 2048, "max_tokens": args.gen or 8,
                               "budget_mb": 64 * 1024, "kv_mode": "exact"}
        print(f"bench stored: building {context:,} tokens (synthetic fill of a {fill:,}-token "
              "document)...", file=sys.stderr)
        built = _spawn("build", job, tmp)
        # The document's ids, for the askers to rebuild the same prompt.
        job["ids"] = str(tmp / "doc-ids.json")
        out: dict[str, Any] = {"suite": "stored", "synthetic": True, "context": context,
                               "fill_doc": fill, "build": built, "ask": []}
        for mode in modes:
            res = _spawn("ask", {**job, "kv_mode": mode}, tmp)
            out["ask"].append(res)
            print(f"{mode:>7}: first token {res['ttft_s']:.2f} s, restored "
                  f"{res['cached_tokens']:,} of {res['prompt_tokens']:,} tokens, peak RSS "
                  f"{res['peak_rss_bytes'] / 2**30:.2f} GB, MLX peak "
                  f"{res['mlx_peak_bytes'] / 2**30:.2f} GB, phases {res['phases']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    child_mode, job_file = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(job_file).read_text())
    print(json.dumps(_child(child_mode, spec)))

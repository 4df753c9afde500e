"""`strata bench kvbits`: what quantizing the KV cache's pages (8 or 4 bits) costs in accuracy,
and what it saves in memory, against 16-bit pages on the same model and text.

Contract: `compare(lm, ids, subjects)` runs the same token ids through one paged cache per
subject (a `KVSettings`), in lockstep: a chunked prefill of ids[:context], then teacher-forced
decode steps over the following ids. Each subject's next-token distributions are compared
with the first subject's (the reference): mean KL(reference || subject) and top-1 agreement,
separately for prefill positions that attend to stored pages (past the first chunk) and for
decode steps (every page but the partial tail is stored). Also per subject: KV bytes per token
in the RAM tier and in the SSD records (from the store's own stats), prefill and decode tok/s.
`kernel_timings` times one layer's decode-step attention over quantized pages both ways (decode
then matmul, as the engine does, or mx.quantized_matmul). `run(args)` is the CLI suite over
both; tests call `compare` directly.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.bench.common import REPO, listed, machine_facts, tenths
from engine.bench.fill import paged_cache
from engine.errors import StrataError
from engine.kv import BITS, KVSettings, close_caches
from engine.kv.codec import codec_for
from engine.quant.evaluate import eval_tokens
from engine.runtime.generate import LoadedModel

# The text prefilled when --text is not given: the shared wikitext-2 test set.
DEFAULT_TEXT = REPO.parent / "shared" / "data" / "wikitext-2-test.txt"


@dataclass
class SubjectResult:
    """One subject's figures; KL and agreement are against the reference subject."""

    name: str
    mode: str
    bits: int
    group: int | None
    prefill_kl: float = 0.0
    prefill_top1: float = 1.0
    prefill_positions: int = 0
    decode_kl: float = 0.0
    decode_top1: float = 1.0
    decode_steps: int = 0
    kv_bytes_per_token_ram: float = 0.0
    kv_bytes_per_token_ssd: float = 0.0
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    _sums: dict[str, float] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


def subject_name(s: KVSettings) -> str:
    return f"{s.mode} {s.bits}-bit" + (f" g{s.group()}" if s.bits != 16 else "")


def _kl_top1(ref_lp: Any, lp: Any) -> tuple[Any, Any]:
    """Sums over positions of KL(ref || lp) and of top-1 agreement; (L, V) log-probs."""
    kl = (mx.exp(ref_lp) * (ref_lp - lp)).sum(axis=-1).sum()
    same = (mx.argmax(ref_lp, axis=-1) == mx.argmax(lp, axis=-1)).sum()
    return kl, same


def _logprobs(logits: Any) -> Any:
    x = logits[0].astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def compare(lm: Any, ids: Sequence[int], subjects: Sequence[KVSettings], context: int,
            chunk: int = 512, progress: Callable[[int, int], None] | None = None
            ) -> list[SubjectResult]:
    """See the module docstring. ids[:context] are prefilled, ids[context:] decoded one by
    one (teacher forced, so every subject sees the same tokens); subjects[0] is the
    reference. Caches are closed before returning."""
    if len(subjects) < 2:
        raise StrataError("kvbits: need a reference and at least one subject to compare")
    if not 0 < context < len(ids):
        raise StrataError(f"kvbits: context of {context} tokens needs more than {context} "
                          f"tokens of text (got {len(ids)})")
    paged = [paged_cache(lm.model, s) for s in subjects]
    caches = [c for c, _ in paged]
    rows = [SubjectResult(subject_name(s), s.mode, s.bits,
                          s.group() if s.bits != 16 else None) for s in subjects]
    for r in rows:
        r._sums = {"pkl": 0.0, "ptop": 0.0, "dkl": 0.0, "dtop": 0.0, "pt": 0.0, "dt": 0.0}
    try:
        total = len(ids)
        # Prefill in lockstep; positions of the first chunk attend to no stored page.
        for start in range(0, context, chunk):
            x = mx.array(list(ids[start:min(start + chunk, context)]))[None]
            ref_lp = None
            for i, (cache, row) in enumerate(zip(caches, rows, strict=True)):
                t = time.perf_counter()
                logits = lm.model(x, cache=cache)
                mx.eval(logits, [c.state for c in cache])
                row._sums["pt"] += time.perf_counter() - t
                lp = _logprobs(logits)
                if start == 0:
                    continue
                row.prefill_positions += x.shape[1]
                if i == 0:
                    ref_lp = lp
                    mx.eval(ref_lp)
                else:
                    kl, same = _kl_top1(ref_lp, lp)
                    row._sums["pkl"] += float(kl.item())  # type: ignore[arg-type]
                    row._sums["ptop"] += float(same.item())  # type: ignore[arg-type]
            if progress is not None:
                progress(min(start + chunk, context), total)
        for (_, store), row in zip(paged, rows, strict=True):
            store.flush()
            st = store.stats()
            tokens = store.tables[0].n_pages * store.P or 1  # tokens in pages, every layer
            row.kv_bytes_per_token_ram = st["bytes_ram"] / tokens
            # What the pages take on the SSD, by the record size: a page still in the
            # contiguous buffer is not written until the buffer goes (or a prompt is stored).
            pages = sum(t.n_pages for t in store.tables)
            row.kv_bytes_per_token_ssd = store.record_bytes * pages / tokens
        # Decode: one token at a time; each step timed on its own (the first pays warm-up).
        for step, tok in enumerate(ids[context:]):
            x = mx.array([[tok]])
            ref_lp = None
            for i, (cache, row) in enumerate(zip(caches, rows, strict=True)):
                t = time.perf_counter()
                logits = lm.model(x, cache=cache)
                mx.eval(logits)
                if step:
                    row._sums["dt"] += time.perf_counter() - t
                lp = _logprobs(logits)
                if i == 0:
                    ref_lp = lp
                else:
                    kl, same = _kl_top1(ref_lp, lp)
                    row._sums["dkl"] += float(kl.item())  # type: ignore[arg-type]
                    row._sums["dtop"] += float(same.item())  # type: ignore[arg-type]
                row.decode_steps += 1
            if progress is not None:
                progress(context + step + 1, total)
    finally:
        for cache in caches:
            close_caches(cache)
    for row in rows:
        s = row._sums
        if row.prefill_positions and row is not rows[0]:
            row.prefill_kl = s["pkl"] / row.prefill_positions
            row.prefill_top1 = s["ptop"] / row.prefill_positions
        if row is not rows[0] and row.decode_steps:
            row.decode_kl = s["dkl"] / row.decode_steps
            row.decode_top1 = s["dtop"] / row.decode_steps
        row.prefill_tps = context / s["pt"] if s["pt"] else 0.0
        row.decode_tps = (row.decode_steps - 1) / s["dt"] if s["dt"] else 0.0
    return rows


# -- kernels ------------------------------------------------------------------------------
def kernel_timings(context: int, kv_heads: int, head_dim: int, page_tokens: int,
                   codecs: Sequence[Any], q_per_kv: int = 3, reps: int = 20
                   ) -> list[dict[str, Any]]:
    """Milliseconds per layer for one decode step's attention over `context` tokens of
    random pages: as computed, and per codec decoded then matmul (what the engine does)
    against mx.quantized_matmul on the encoded pages; plus decode alone, ours against
    mx.dequantize. Best of three runs of `reps`."""
    def best(f: Callable[[], Any]) -> float:
        mx.eval(f())
        out = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                mx.eval(f())
            out = min(out, (time.perf_counter() - t) / reps * 1e3)
        return round(out, 3)

    n = max(1, context // page_tokens)
    shape = (n, kv_heads, page_tokens, head_dim)
    k, v = mx.random.normal(shape), mx.random.normal(shape)
    qg = mx.random.normal((kv_heads, q_per_kv, head_dim))

    def attend(kk: Any, vv: Any) -> Any:
        s = qg[None] @ kk.swapaxes(-1, -2)
        p = mx.exp(s - s.max(axis=(0, 3))[None, :, :, None])
        return (p @ vv).sum(axis=0)

    rows: list[dict[str, Any]] = [{"pages": "16-bit", "attention_ms": best(lambda: attend(k, v))}]
    qb = mx.broadcast_to(qg[None], (n, kv_heads, q_per_kv, head_dim))
    for c in codecs:
        kp, vp = c.encode(k), c.encode(v)
        mx.eval(kp, vp)

        def qmm(c: Any = c, kp: Any = kp, vp: Any = vp) -> Any:
            s = mx.quantized_matmul(qb, kp[0], kp[1], kp[2], transpose=True,
                                    group_size=c.group, bits=c.bits)
            p = mx.exp(s - s.max(axis=(0, 3))[None, :, :, None])
            return mx.quantized_matmul(p, vp[0], vp[1], vp[2], transpose=False,
                                       group_size=c.group, bits=c.bits).sum(axis=0)

        def ours(c: Any = c, kp: Any = kp, vp: Any = vp) -> Any:
            return attend(c.decode(kp), c.decode(vp))

        def decode(c: Any = c, kp: Any = kp) -> Any:
            return c.decode(kp)

        def dequantize(c: Any = c, kp: Any = kp) -> Any:
            return mx.dequantize(kp[0], kp[1], kp[2], group_size=c.group, bits=c.bits)

        rows.append({"pages": c.describe(), "attention_ms": best(ours),
                     "quantized_matmul_ms": best(qmm), "decode_ms": best(decode),
                     "mx_dequantize_ms": best(dequantize)})
    return rows


# -- the CLI suite ------------------------------------------------------------------------
def _subjects(args: argparse.Namespace, ssd_dir: Path) -> list[KVSettings]:
    bits = listed(args.bits, "bench kvbits: --bits", int)
    # (No groups: each bit width's default group.)
    groups = listed(args.groups, "bench kvbits: --groups", int) if args.groups.strip() else []
    modes = listed(args.paged_modes, "bench kvbits: --paged-modes", allowed=("exact", "sparse"))
    for b in bits:
        if b not in BITS:
            raise StrataError(f"bench kvbits: KV bits {b} are not supported (16, 8, 4)")
    base = KVSettings(mode="exact", bits=16, ssd_dir=ssd_dir,
                      page_tokens=getattr(args, "page_tokens", 128),
                      budget_tokens=getattr(args, "kv_budget", 2048))
    out = [base.validate()]
    for mode in modes:
        for b in bits:
            for g in ([None] if b == 16 or not groups else groups):
                s = base.with_(mode=mode, bits=b, group_size=g).validate()
                if s != out[0]:
                    out.append(s)
    return out


def format_table(rows: list[SubjectResult]) -> str:
    head = (f"{'subject':22} {'prefill KL':>10} {'top-1':>7} {'decode KL':>10} {'top-1':>7} "
            f"{'KV B/tok RAM':>12} {'SSD':>8} {'prefill t/s':>11} {'decode t/s':>10}")
    lines = [head]
    for r in rows:
        lines.append(f"{r.name:22} {r.prefill_kl:10.5f} {r.prefill_top1:7.3f} "
                     f"{r.decode_kl:10.5f} {r.decode_top1:7.3f} "
                     f"{r.kv_bytes_per_token_ram:12.0f} {r.kv_bytes_per_token_ssd:8.0f} "
                     f"{r.prefill_tps:11.1f} {r.decode_tps:10.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """The suite: the KL table for every subject, then the kernel timings."""
    text = Path(args.text) if args.text else DEFAULT_TEXT
    if args.prefill_tokens < 1 or args.decode_steps < 1:
        raise StrataError("bench kvbits: --prefill-tokens and --decode-steps must be >= 1")
    with tempfile.TemporaryDirectory(prefix="strata-kvbits-") as tmp:
        subjects = _subjects(args, Path(tmp))
        lm = LoadedModel.load(args.model)
        n = args.prefill_tokens + args.decode_steps
        ids = eval_tokens(lm.tokenizer, text, n)
        if len(ids) < n:
            raise StrataError(f"{text}: {len(ids)} tokens, {n} needed")
        t0 = time.perf_counter()
        rows = compare(lm, ids, subjects, args.prefill_tokens, progress=tenths("tokens"))
        wall = time.perf_counter() - t0
        attn = lm.model.layers[0].self_attn
        g = lm.kv_geometry
        kv_heads, head_dim = g.kv_heads, g.head_dim
        codecs = sorted({codec_for(s.bits, s.group(), lm.profile.dtype, head_dim)
                         for s in subjects if s.bits != 16}, key=lambda c: (-c.bits, c.group))
        kernels = kernel_timings(args.prefill_tokens, kv_heads, head_dim,
                                 subjects[0].page_tokens, codecs,
                                 q_per_kv=int(attn.n_heads) // kv_heads)
    print(f"\nmodel {lm.manifest['name']}, profile {lm.profile.name}, text {text.name}"
          f", {args.prefill_tokens} tokens prefilled in chunks of 512, {args.decode_steps} "
          f"decode steps, page {subjects[0].page_tokens} tokens; KL against {rows[0].name}; "
          f"{wall:.0f} s")
    print(format_table(rows))
    print(f"\none layer's decode-step attention over {args.prefill_tokens} tokens of random "
          "pages, ms (best of 3 x 20):")
    print(f"{'pages':18} {'decode+matmul':>13} {'quantized_matmul':>16} {'decode':>8} "
          f"{'mx.dequantize':>13}")
    for k in kernels:
        print(f"{k['pages']:18} {k['attention_ms']:13.3f} "
              f"{k.get('quantized_matmul_ms', float('nan')):16.3f} "
              f"{k.get('decode_ms', float('nan')):8.3f} "
              f"{k.get('mx_dequantize_ms', float('nan')):13.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"schema": "strata-bench-kvbits/1", "model": lm.manifest["name"],
             "profile": lm.profile.name, "text": str(text),
             "prefill_tokens": args.prefill_tokens, "decode_steps": args.decode_steps,
             "page_tokens": subjects[0].page_tokens, "machine": machine_facts(),
             "rows": [r.to_dict() for r in rows], "kernels": kernels}, indent=2))
    return 0

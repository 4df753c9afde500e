"""`strata bench kv --context N`: decode with an N-token context that lives mostly on the SSD.

Contract: `run_long(lm, opts)` fills one paged store (bounded RAM tier, SSD tier on) with N
tokens, either by synthetic fill (the starter's real KV of a shorter document, tiled, written
through the store's writer; every report says so) or, with `end_to_end`, by a real prefill
of a pass-key prompt through the paged cache. It then drops the page files from the OS page
cache and decodes greedily in each mode, sampling process RSS throughout. It returns a report
dict (figures per mode: tok/s, pages and bytes read per token, SSD MB/s; RSS over time).
Progress and results go through `say(line)`; `cancel()` stops between steps, keeping what
finished.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.bench.fill import FillCancelled, doc_kv, fill_paged, paged_cache
from engine.bench.passkey import make_key, passkey_prompt
from engine.bench.system import drop_page_cache, peak_rss_bytes, rss_bytes
from engine.errors import StrataError
from engine.kv import KVSettings, close_caches


@dataclass
class LongOptions:
    context: int
    modes: tuple[str, ...] = ("sparse", "exact")
    gen: int = 16                 # sparse (and any mode without its own count) tokens
    exact_tokens: int = 2         # exact reads every page per token: keep it short
    page_tokens: int = 128
    budget_tokens: int = 2048
    ram_mb: int = 1024
    kv_dtype: str | None = None   # None: the model's compute dtype
    doc_tokens: int = 4096        # synthetic fill: the real document that is tiled
    end_to_end: bool = False
    sample_s: float = 0.5
    seed: int = 0
    keep_files: bool = False
    ssd_dir: Path | None = None   # None: STRATA_HOME/kv


class RssSampler:
    """A thread that records (seconds, phase, rss bytes) every `interval` seconds."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.phase = "start"
        self.samples: list[tuple[float, str, int]] = []
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self._t0, self.phase, rss_bytes()))
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter() - self._t0, self.phase, rss_bytes()))

    def by_phase(self) -> dict[str, int]:
        """The highest sampled RSS per phase, in phase order."""
        out: dict[str, int] = {}
        for _, phase, rss in self.samples:
            out[phase] = max(out.get(phase, 0), rss)
        return out

    def series(self, points: int = 40) -> list[tuple[float, str, int]]:
        """At most `points` samples spread over the run (each the max of its stretch)."""
        s = self.samples
        if len(s) <= points:
            return [(round(t, 1), p, r) for t, p, r in s]
        step = len(s) / points
        out = []
        for i in range(points):
            part = s[int(i * step):int((i + 1) * step)] or s[-1:]
            t, p, r = max(part, key=lambda x: x[2])
            out.append((round(t, 1), p, r))
        return out


def _decode(lm: Any, cache: list[Any], first_token: int, n: int, cancel: Callable[[], bool]
            ) -> tuple[list[int], list[float]]:
    """Greedy decode n tokens feeding `first_token` first; returns tokens and per-step s."""
    y = mx.array([[first_token]])
    toks: list[int] = []
    times: list[float] = []
    for _ in range(n):
        if cancel():
            break
        t = time.perf_counter()
        logits = lm.model(y, cache=cache)[:, -1, :]
        tok = int(mx.argmax(logits, axis=-1).item())  # type: ignore[arg-type]
        times.append(time.perf_counter() - t)
        toks.append(tok)
        y = mx.array([[tok]])
    return toks, times


def run_long(lm: Any, opts: LongOptions, say: Callable[[str], None],
             cancel: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Fill, drop the page cache, decode per mode; see the module docstring."""
    n = opts.context
    settings = KVSettings(mode="exact", page_tokens=opts.page_tokens, ram_mb=opts.ram_mb,
                          budget_tokens=opts.budget_tokens, ssd=True,
                          ssd_dir=opts.ssd_dir, keep_files=opts.keep_files).validate()
    sampler = RssSampler(opts.sample_s)
    report: dict[str, Any] = {"context": n, "page_tokens": opts.page_tokens,
                              "budget_tokens": opts.budget_tokens, "ram_mb": opts.ram_mb,
                              "rss_before_fill": rss_bytes(), "modes": {}, "complete": False}
    caches: list[Any] = []
    try:
        caches, store = paged_cache(lm.model, settings, opts.kv_dtype)
        report["kv_dtype"] = store.np_dtype.name
        report["kv_bytes_per_token"] = store.page_bytes * store.n_layers // store.P
        report["ssd_folder"] = str(store.folder)
        last = [-1]

        def progress(done: int, total: int) -> None:
            if done * 20 // total != last[0]:
                last[0] = done * 20 // total
                s = store.stats()
                say(f"  {done:,}/{total:,} tokens, {s['pages_ssd']:,} pages on SSD, "
                    f"RSS {rss_bytes() >> 20} MB")

        t0 = time.perf_counter()
        if opts.end_to_end:
            first_token, ids, key = _end_to_end_prefill(lm, caches, n, opts, sampler, say,
                                                        progress, cancel, report)
        else:
            sampler.phase = "document prefill"
            say(f"synthetic fill: real prefill of a {opts.doc_tokens:,}-token document with "
                f"mlx-lm's KVCache, its KV tiled to {n:,} tokens")
            dt = None if opts.kv_dtype is None else getattr(mx, opts.kv_dtype)
            doc = doc_kv(lm, opts.doc_tokens, opts.page_tokens, dtype=dt)
            report["fill"] = (f"synthetic: the starter's KV of a real {doc.tokens:,}-token "
                              f"document ({doc.prefill_s:.0f} s prefill), tiled to {n:,} "
                              "tokens and written through the store's writer")
            sampler.phase = "fill"
            t1 = time.perf_counter()
            fill_paged(caches, doc, n, progress, cancel)
            store.flush()
            report["fill_s"] = round(time.perf_counter() - t1, 1)
            first_token = int(mx.argmax(doc.logits, axis=-1).item())  # type: ignore[arg-type]
            ids, key = doc.ids, None
            del doc
        report["setup_s"] = round(time.perf_counter() - t0, 1)
        base = caches[0].offset  # every mode decodes from here
        sampler.phase = "drop page cache"
        pages = sorted(store.folder.glob("*.kvp")) if store.folder else []
        drop = drop_page_cache(pages, sync=True)  # the writer's pages are still dirty
        report["dropped_bytes"] = drop.nbytes if drop.done else 0
        if drop.note:
            report["drop_note"] = drop.note
        st = store.stats()
        report.update(pages_ssd=st["pages_ssd"], pages_ram=st["pages_ram"],
                      bytes_ssd=st["bytes_ssd"], ssd_full=st["ssd_full"],
                      summary_bytes=sum(int(t.kmin.nbytes) + int(t.kmax.nbytes)
                                        for t in store.tables if t.kmin is not None))
        if st["ssd_full"]:
            raise StrataError(f"bench kv: the SSD tier filled up ({st['ssd_full']})")
        say(f"filled: {st['pages_ssd']:,} pages on SSD ({st['bytes_ssd'] / 1e9:.1f} GB), "
            f"{st['pages_ram']:,} in RAM; RSS {rss_bytes() >> 20} MB")
        for mode in opts.modes:
            if cancel():
                break
            count = opts.exact_tokens if mode == "exact" else opts.gen
            if count <= 0:
                report["modes"][mode] = {"skipped": "0 tokens asked"}
                say(f"{mode}: skipped (0 tokens asked)")
                continue
            sampler.phase = f"decode {mode}"
            store.settings = settings.with_(mode=mode)
            for c in caches:
                c.trim(c.offset - base)
                c.follow_settings()  # sparse: no buffer of every position
            before = dict(store.counters)
            t = time.perf_counter()
            toks, times = _decode(lm, caches, first_token, count, cancel)
            wall = time.perf_counter() - t
            report["modes"][mode] = row = _mode_row(store, before, toks, times, wall, n)
            if key is not None:
                # Speed decodes past EOS (as llama-bench does); the answer ends at it.
                cut = next((i for i, t in enumerate(toks) if t in lm.eos_ids), len(toks))
                answer = lm.tokenizer.decode(toks[:cut])
                row.update(answer=answer.strip(), key=key, found=key in answer.replace(" ", ""))
            say(f"{mode}: {row['tokens']} tokens, {row['decode_tps']} tok/s, "
                f"{row['pages_read_per_token']:.0f} pages and "
                f"{row['bytes_read_per_token'] / 2**20:.1f} MiB read per token, SSD "
                f"{row['ssd_mb_s']:.0f} MB/s, RSS {rss_bytes() >> 20} MB")
        report["prompt_tokens"] = len(ids)
        report["complete"] = not cancel()
    except (KeyboardInterrupt, FillCancelled):
        report["interrupted"] = True
    finally:
        sampler.stop()
        if caches:
            close_caches(caches)
        report["rss_by_phase"] = sampler.by_phase()
        report["rss_series"] = sampler.series()
        report["peak_rss"] = peak_rss_bytes()
    return report


def _mode_row(store: Any, before: dict[str, Any], toks: list[int], times: list[float],
              wall: float, n: int) -> dict[str, Any]:
    c = store.counters
    reads = c["ssd_reads"] - before["ssd_reads"]
    nbytes = c["bytes_read"] - before["bytes_read"]
    k = max(1, len(toks))
    # The first step pays one-off costs (reading the sinks and window back into RAM).
    steady = times[1:] or times
    return {"tokens": len(toks), "tokens_ids": toks,
            "decode_tps": round(len(steady) / sum(steady), 3) if steady else 0.0,
            "first_step_s": round(times[0], 2) if times else None,
            "step_s": [round(x, 3) for x in times],
            "pages_read_per_token": reads / k, "bytes_read_per_token": nbytes / k,
            "ram_hits_per_token": (c["ram_hits"] - before["ram_hits"]) / k,
            "ssd_mb_s": nbytes / wall / 1e6 if wall > 0 else 0.0,
            "ssd_read_thread_s": round(c["read_s"] - before["read_s"], 2),
            "evictions": c["evictions"] - before["evictions"], "context": n}


def _end_to_end_prefill(lm: Any, caches: list[Any], n: int, opts: LongOptions,
                        sampler: RssSampler, say: Callable[[str], None],
                        progress: Callable[[int, int], None], cancel: Callable[[], bool],
                        report: dict[str, Any]) -> tuple[int, list[int], str]:
    """A real prefill of an n-token pass-key prompt (key at half depth) through the paged
    cache; per-chunk times give an estimate of the prefill time at 128k tokens."""
    key = make_key(opts.seed, n, 0.5)
    ids = passkey_prompt(lm.tokenizer, n, 0.5, key)
    sampler.phase = "prefill"
    say(f"end to end: real prefill of a {len(ids):,}-token pass-key prompt through the paged "
        "cache")
    chunks: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    body = ids[:-1]
    for i in range(0, len(body), 512):
        if cancel():
            raise FillCancelled(f"prefill stopped at {i} tokens")
        t = time.perf_counter()
        lm.model(mx.array(body[i:i + 512])[None], cache=caches)
        mx.eval([c.state for c in caches])
        chunks.append((i, time.perf_counter() - t))
        progress(min(len(body), i + 512), len(body))
    caches[0].store.flush()
    total = time.perf_counter() - t0
    report["fill"] = f"real prefill of a {len(ids):,}-token pass-key prompt (key at 50%)"
    report["prefill_s"] = round(total, 1)
    report["prefill_tps"] = round(len(body) / total, 1) if total else None
    report["prefill_chunks"] = [(p, round(s, 2)) for p, s in chunks]
    report["estimate_128k_prefill_s"] = estimate_prefill_s(chunks, 131072)
    return ids[-1], ids, key


def estimate_prefill_s(chunks: list[tuple[int, float]], n: int, chunk: int = 512
                       ) -> float | None:
    """Fit chunk time = a + b * position (attention grows linearly with the past; the MLPs
    are constant) over the measured chunks, and sum it over an n-token prefill."""
    if len(chunks) < 3:
        return None
    pos = np.array([p for p, _ in chunks[1:]], float)   # the first chunk pays warm-up
    sec = np.array([s for _, s in chunks[1:]], float)
    b, a = np.polyfit(pos, sec, 1)
    b = max(0.0, float(b))
    starts = np.arange(0, n, chunk, dtype=float)
    return round(float((a + b * starts).sum()), 0)


def format_long(report: dict[str, Any], lm: Any) -> str:
    """The long-context report as text: fill, per-mode figures, RSS by phase."""
    mb = 1 << 20
    out = [f"\nmodel {lm.manifest['name']}, profile {lm.profile.name}; context "
           f"{report['context']:,} tokens; pages of {report['page_tokens']} tokens, "
           f"KV {report.get('kv_dtype', '?')} ({report.get('kv_bytes_per_token', 0):,} "
           f"bytes a token); RAM tier {report['ram_mb']} MB; sparse budget "
           f"{report['budget_tokens']:,}",
           f"KV fill: {report.get('fill', 'not done')}"]
    if "pages_ssd" in report:
        out.append(f"store: {report['pages_ssd']:,} pages on SSD "
                   f"({report['bytes_ssd'] / 1e9:.1f} GB), {report['pages_ram']:,} in RAM; "
                   f"page summaries in RAM {report.get('summary_bytes', 0) / 2**20:.0f} MB; "
                   f"setup {report.get('setup_s', 0):.0f} s; page files dropped from the OS "
                   f"cache before decoding: {report.get('dropped_bytes', 0) / 1e9:.1f} GB")
    if "prefill_s" in report:
        est = report.get("estimate_128k_prefill_s")
        out.append(f"prefill: {report['prefill_s']} s ({report['prefill_tps']} tok/s); "
                   f"estimate for 131,072 tokens: "
                   f"{'n/a' if est is None else f'{est / 3600:.1f} h'}")
    out.append(f"{'mode':7} {'tokens':>6} {'tok/s':>8} {'1st step s':>10} {'pages/tok':>10} "
               f"{'MiB/tok':>8} {'SSD MB/s':>9}  answer")
    for mode, r in report["modes"].items():
        if "skipped" in r:
            out.append(f"{mode:7} skipped: {r['skipped']}")
            continue
        ans = f"{r.get('answer', '')!r} {'found' if r.get('found') else ''}" \
            if "key" in r else ""
        out.append(f"{mode:7} {r['tokens']:>6} {r['decode_tps']:8.3f} "
                   f"{r['first_step_s'] or 0:10.2f} {r['pages_read_per_token']:10.0f} "
                   f"{r['bytes_read_per_token'] / mb:8.1f} {r['ssd_mb_s']:9.0f}  {ans}")
    phases = ", ".join(f"{k} {v / mb:.0f}" for k, v in report.get("rss_by_phase", {}).items())
    out.append(f"RSS by phase (MB, sampled max): {phases}")
    out.append(f"peak RSS (ru_maxrss): {report.get('peak_rss', 0) / mb:.0f} MB")
    if report.get("interrupted"):
        out.append("interrupted: figures above are what finished")
    return "\n".join(out)

"""One benchmark subject in its own process: `python -m engine.bench.worker JOB.json`.

Contract: reads a job (written by `engine.bench.quick.run_subject`), measures one subject ('strata',
'mlx-lm' or 'llama.cpp') on one model and setting, and rewrites the job's `out` file with
everything measured so far after each step, so an interrupted run (SIGINT or SIGTERM) keeps
what finished. Progress goes to stderr as `@progress DONE TOTAL LABEL` lines. Every figure
is measured the same way for every subject, from token arrival times in this process:
ttft_s = prompt in to first token out; prompt_tps = new prompt tokens / ttft_s; decode_tps
= (tokens - 1) / (last token time - first token time). EOS is ignored, as llama-bench does,
so every run generates max_tokens. Steps, in order: cold and warm loads,
one warm-up generation, first-token trials without and with a cached prefix, then for each
context depth a warm-up and `trials` runs of a prompt after `depth` tokens already cached.

Imports: at the top only what every subject shares (no MLX, nothing of the runtime). Each
subject imports its own stack in `prepare()` and `load()`, which is why those imports are
local: `prepare()` times them (`load.imports_s`), the llama.cpp subject's memory figures
must not hold MLX, and mlx-lm's real package must be imported before engine.runtime.model
registers its bare `mlx_lm` module (see engine.runtime.model).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from engine.bench.stats import stat
from engine.bench.system import (
    drop_page_cache,
    footprint_bytes,
    io_bytes,
    peak_rss_bytes,
    rss_bytes,
)
from engine.platform import compute_profile
from engine.telemetry import Timeline

PHASES = ("cache lookup", "prefill", "first decode")


def weight_files(model_dir: Path, gguf: str | None = None) -> list[Path]:
    files = [p for p in sorted(model_dir.iterdir()) if p.is_file()] if model_dir.is_dir() else []
    return files + ([Path(gguf)] if gguf else [])


def memory_figures(mx: Any | None, kv_bytes: int | None,
                   tiers: dict[str, int] | None = None) -> dict[str, Any]:
    return {**(tiers or {}),
        "rss_bytes": rss_bytes(),
        "rss_peak_bytes": peak_rss_bytes(),
        "footprint_bytes": footprint_bytes(),
        "mlx_active_bytes": int(mx.get_active_memory()) if mx is not None else None,
        "mlx_peak_bytes": int(mx.get_peak_memory()) if mx is not None else None,
        "kv_bytes": kv_bytes,
    }


# -- subjects -----------------------------------------------------------------------------
class Subject:
    """A model loaded by one implementation, with a KV cache that keeps a token prefix."""

    name = ""
    uses_mlx = True

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.model_dir = Path(job["model_dir"])
        self.phases: dict[str, float] = {}  # of the last stream()
        self.drafts = (0, 0)  # (accepted, drafted) tokens of the last stream(): Strata drafts

    def files(self) -> list[Path]:
        return weight_files(self.model_dir)

    def prepare(self) -> None:
        """Import what loading needs, so loads time reading weights, not first imports."""

    def load(self) -> dict[str, float]:
        raise NotImplementedError

    def unload(self) -> None:
        raise NotImplementedError

    def new_cache(self) -> Any:
        raise NotImplementedError

    def rewind(self, cache: Any, n: int) -> None:
        """Keep only the first n cached tokens."""
        raise NotImplementedError

    def stream(self, ids: Sequence[int], cache: Any, max_tokens: int) -> Iterator[int]:
        """Greedy tokens for `ids`, reusing the cache's longest shared prefix."""
        raise NotImplementedError

    def kv_bytes(self, cache: Any) -> int | None:
        return None

    def kv_tiers(self, cache: Any) -> dict[str, int] | None:
        """KV bytes in RAM and on the SSD, for caches that have tiers."""
        return None


def _common(held: Sequence[int], ids: Sequence[int]) -> int:
    n, limit = 0, min(len(held), len(ids) - 1)
    while n < limit and held[n] == ids[n]:
        n += 1
    return n


class StrataSubject(Subject):
    name = "strata"
    lm: Any = None

    def prepare(self) -> None:
        import engine.runtime.generate  # noqa: F401  (timed: the loader's first imports)
        import engine.runtime.model  # noqa: F401  (timed, as above)

    def load(self) -> dict[str, float]:
        from engine.runtime.generate import LoadedModel  # imported by prepare(): no cost here

        tl = Timeline()
        self.lm = LoadedModel.load(self.model_dir, profile=compute_profile(self.job["profile"]),
                                   timeline=tl)
        self.lm.eos_ids = set()  # like llama-bench: every run generates max_tokens
        kv_mode = (self.job.get("setting") or {}).get("kv_mode")
        if kv_mode and kv_mode != "mlx":
            from engine.kv import settings_from_env  # only a paged setting loads the KV stack

            self.lm.kv_settings = settings_from_env(mode=kv_mode)
        return tl.durations()

    def unload(self) -> None:
        self.lm = None

    def new_cache(self) -> Any:
        return self.lm.new_cache()

    def rewind(self, cache: Any, n: int) -> None:
        from engine.kv.cache import trimmable  # loaded with LoadedModel by prepare(): no cost

        drop = len(cache.tokens) - n
        if drop <= 0:
            return
        if all(trimmable(c, drop) for c in cache.cache):
            for c in cache.cache:
                c.trim(drop)
            del cache.tokens[n:]
            return
        # A sliding-window layer past its window cannot forget positions: fill the first n
        # tokens again (untimed, as every rewind is), as the engine itself does.
        import mlx.core as mx  # loaded by prepare()

        ids = list(cache.tokens[:n])
        cache.clear()
        for i in range(0, len(ids), 512):
            self.lm.model(mx.array([ids[i:i + 512]]), cache=cache.cache)
            mx.eval([c.state for c in cache.cache])
        cache.tokens.extend(ids)

    def stream(self, ids: Sequence[int], cache: Any, max_tokens: int) -> Iterator[int]:
        # Loaded with the subject's stack by prepare() (see the module docstring).
        from engine.runtime.generate import generate
        from engine.runtime.sampling import SamplingParams

        tl = Timeline()
        self.drafts = (0, 0)
        # Undrafted unless the setting names a drafter (bench quick's "draft=..." rows).
        drafter = (self.job.get("setting") or {}).get("drafter", "off")
        for ev in generate(self.lm, ids, SamplingParams(temperature=0), max_tokens,
                           prompt_cache=cache, timeline=tl, drafter=drafter):
            self.drafts = (ev.accepted_tokens, ev.drafted_tokens)
            if ev.token is not None:
                yield ev.token
        self.phases = tl.durations()

    def kv_bytes(self, cache: Any) -> int | None:
        return int(cache.nbytes)

    def kv_tiers(self, cache: Any) -> dict[str, int] | None:
        from engine.kv import PagedLayerCache  # the Strata subject's stack, loaded by now

        first = cache.cache[0] if cache.cache else None
        if not isinstance(first, PagedLayerCache):  # mlx-lm's KVCache: all of it is in RAM
            return None
        st = first.store.stats()
        return {"kv_ram_bytes": int(st["bytes_ram"]), "kv_ssd_bytes": int(st["bytes_ssd"])}


class MlxLmSubject(Subject):
    """mlx-lm's own load and stream_generate, in Strata's compute profile (same BLAS)."""

    name = "mlx-lm"
    model: Any = None
    tok: Any = None

    def prepare(self) -> None:
        import mlx_lm.utils  # noqa: F401  (first: the real package, before any bare one)

        import engine.runtime.model  # noqa: F401  (after mlx-lm's package; timed with it)

        config = json.loads((self.model_dir / "config.json").read_text())
        importlib.import_module(f"mlx_lm.models.{config.get('model_type', 'llama')}")
        try:
            import transformers  # noqa: F401  (mlx-lm's tokenizer loader)
        except ImportError:
            pass

    def load(self) -> dict[str, float]:
        import mlx.core as mx  # this subject's stack (see the module docstring)
        from mlx_lm import load

        from engine.runtime.model import apply_profile  # imported by prepare(), after mlx-lm

        t0 = time.perf_counter()
        self.model, self.tok = load(str(self.model_dir))[:2]
        apply_profile(self.model, compute_profile(self.job["profile"]))
        mx.eval(self.model.parameters())
        self.tok.eos_token_ids = set()  # like llama-bench: every run generates max_tokens
        return {"weights": time.perf_counter() - t0}

    def unload(self) -> None:
        self.model = self.tok = None

    def new_cache(self) -> Any:
        from mlx_lm.models.cache import make_prompt_cache  # loaded by prepare()

        return {"layers": make_prompt_cache(self.model), "tokens": []}

    def rewind(self, cache: Any, n: int) -> None:
        import mlx.core as mx  # loaded by prepare()
        from mlx_lm.models.cache import (  # loaded by prepare()
            can_trim_prompt_cache,
            make_prompt_cache,
            trim_prompt_cache,
        )

        held = cache["layers"][0].offset
        if held > n and can_trim_prompt_cache(cache["layers"]):
            trim_prompt_cache(cache["layers"], held - n)
        elif held > n:
            # A sliding-window cache past its window cannot forget positions: fill the first
            # n tokens again, as Strata's PromptCache does (clear, then prefill).
            ids = cache["tokens"][:n]
            cache["layers"] = make_prompt_cache(self.model)
            for i in range(0, len(ids), 512):
                self.model(mx.array([ids[i:i + 512]]), cache=cache["layers"])
                mx.eval([c.state for c in cache["layers"]])
        del cache["tokens"][n:]

    def stream(self, ids: Sequence[int], cache: Any, max_tokens: int) -> Iterator[int]:
        from mlx_lm import stream_generate  # loaded by prepare()

        t0 = time.perf_counter()
        # The same prefix reuse as Strata's PromptCache: keep the shared prefix, trim the rest.
        self.rewind(cache, _common(cache["tokens"], ids))
        cached = cache["layers"][0].offset
        self.phases = {"cache lookup": time.perf_counter() - t0}
        out: list[int] = []
        for r in stream_generate(self.model, self.tok, list(ids[cached:]),
                                 max_tokens=max_tokens, prompt_cache=cache["layers"]):
            out.append(int(r.token))
            yield int(r.token)
        held = cache["layers"][0].offset
        cache["tokens"] = (list(ids) + out)[:held]

    def kv_bytes(self, cache: Any) -> int | None:
        return sum(int(getattr(c, "nbytes", 0)) for c in cache["layers"])


class LlamaCppSubject(Subject):
    """llama.cpp through llama-cpp-python on the model's GGUF (its prefix reuse is its own)."""

    name = "llama.cpp"
    uses_mlx = False
    llm: Any = None

    def files(self) -> list[Path]:
        return [Path(self.job["gguf"])]

    def load(self) -> dict[str, float]:
        from llama_cpp import Llama  # an optional extra, and only this subject's

        t0 = time.perf_counter()
        need = max(self.job["depths"] or [0]) + len(self.job["prompt_ids"]) + \
            int(self.job["max_tokens"]) + len(self.job["prefix_ids"]) + 64
        self.llm = Llama(model_path=self.job["gguf"], n_ctx=need,
                         n_threads=os.cpu_count() or 1, seed=int(self.job["seed"]),
                         verbose=False)
        return {"weights": time.perf_counter() - t0}

    def unload(self) -> None:
        self.llm = None

    def new_cache(self) -> Any:
        self.llm.reset()
        return self.llm

    def rewind(self, cache: Any, n: int) -> None:
        self.llm.n_tokens = min(self.llm.n_tokens, n)

    def stream(self, ids: Sequence[int], cache: Any, max_tokens: int) -> Iterator[int]:
        self.phases = {}
        for i, tok in enumerate(self.llm.generate(list(ids), temp=0.0, top_k=1, reset=True)):
            yield int(tok)
            if i + 1 >= max_tokens:
                break


SUBJECTS: dict[str, type[Subject]] = {s.name: s for s in
                                      (StrataSubject, MlxLmSubject, LlamaCppSubject)}


# -- measuring ----------------------------------------------------------------------------
def measure(subject: Subject, ids: Sequence[int], cache: Any, max_tokens: int,
            new_tokens: int) -> dict[str, Any]:
    """One generation timed from token arrival times (see the module docstring)."""
    times: list[float] = []
    tokens: list[int] = []
    t0 = time.perf_counter()
    for tok in subject.stream(ids, cache, max_tokens):
        times.append(time.perf_counter())
        tokens.append(tok)
    if not times:
        raise RuntimeError(f"{subject.name} generated no token")
    ttft = times[0] - t0
    span = times[-1] - times[0]
    return {"ttft_s": ttft, "prompt_tps": new_tokens / ttft if ttft > 0 else 0.0,
            "decode_tps": (len(times) - 1) / span if span > 0 and len(times) > 1 else 0.0,
            "generated_tokens": len(tokens), "tokens": tokens, "phases": dict(subject.phases),
            "accepted_tokens": subject.drafts[0], "drafted_tokens": subject.drafts[1]}


class Runner:
    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.subject = SUBJECTS[job["subject"]](job)
        self.trials = int(job["trials"])
        depths = job["depths"]
        self.total = 2 * int(job["load_trials"]) + 1 + 2 * self.trials + \
            len(depths) * (2 + self.trials)
        self.done = 0
        self.result: dict[str, Any] = {"subject": job["subject"], "status": "partial"}
        self.mx: Any = None

    def step(self, label: str) -> None:
        self.done += 1
        print(f"@progress {self.done} {self.total} {label}", file=sys.stderr, flush=True)

    def save(self) -> None:
        out = Path(self.job["out"])
        tmp = out.with_name(out.name + ".part")
        tmp.write_text(json.dumps(self.result))
        tmp.replace(out)

    def run(self) -> None:
        job, s = self.job, self.subject
        if s.uses_mlx:
            import mlx.core as mx  # not in llama.cpp's process: its memory figures stay its own

            self.mx = mx
            mx.random.seed(int(job["seed"]))
        self.loads()
        self.ttft()
        self.depths()
        self.result["status"] = "complete"
        self.save()

    def loads(self) -> None:
        s = self.subject
        cold: list[float] = []
        warm: list[float] = []
        phases: dict[str, list[float]] = {}
        note = ""
        dropped = True
        t0 = time.perf_counter()
        s.prepare()
        imports_s = time.perf_counter() - t0
        for i in range(int(self.job["load_trials"])):
            for kind in ("cold", "warm"):
                if i or kind == "warm":
                    s.unload()  # before the drop: mapped pages would stay cached
                    gc.collect()
                if kind == "cold":
                    drop = drop_page_cache(s.files())
                    dropped, note = dropped and drop.done, note or drop.note
                t0 = time.perf_counter()
                parts = s.load()
                (cold if kind == "cold" else warm).append(time.perf_counter() - t0)
                if kind == "warm":
                    for k, v in parts.items():
                        phases.setdefault(k, []).append(v)
                self.step(f"load {kind} {i + 1}/{self.job['load_trials']}")
        self.result["load"] = {"cold_s": stat(cold), "warm_s": stat(warm),
                               "phases": {k: stat(v) for k, v in phases.items()},
                               "cache_dropped": dropped, "note": note,
                               "imports_s": imports_s}
        self.result["memory"] = memory_figures(self.mx, None)
        self.save()

    def ttft(self) -> None:
        s, job = self.subject, self.job
        prefix, suffixes = job["prefix_ids"], job["suffix_ids"]
        measure(s, prefix + suffixes[0], s.new_cache(), 2, len(prefix) + len(suffixes[0]))
        self.step("warm-up")
        runs: dict[str, list[dict[str, Any]]] = {"uncached": [], "cached": []}
        for t in range(self.trials):
            cache = s.new_cache()
            for kind, suffix in (("uncached", suffixes[0]), ("cached", suffixes[1])):
                ids = prefix + suffix
                new = len(suffix) if kind == "cached" else len(ids)
                runs[kind].append(measure(s, ids, cache, 1, new))
                self.step(f"first token, {kind} prefix, trial {t + 1}/{self.trials}")
        load = self.result["load"]
        out: dict[str, Any] = {}
        for kind, rs in runs.items():
            names = sorted({k for r in rs for k in r["phases"]})
            phases = {k: stat(r["phases"].get(k, 0.0) for r in rs) for k in names}
            if kind == "uncached":
                phases = {"load": load["cold_s"], **phases}  # the first token after opening
            out[kind] = {"ttft_s": stat(r["ttft_s"] for r in rs), "phases": phases,
                         "prompt_tokens": len(prefix) + len(suffixes[0]),
                         "cached_tokens": len(prefix) if kind == "cached" else 0}
        self.result["ttft"] = out
        self.save()

    def depths(self) -> None:
        s, job, mx = self.subject, self.job, self.mx
        context, prompt = job["depth_ids"], job["prompt_ids"]
        max_tokens = int(job["max_tokens"])
        self.result["depths"] = []
        kv: int | None = None
        tiers: dict[str, int] | None = None
        io0, t_io = io_bytes(), time.perf_counter()
        for d in job["depths"]:
            cache = s.new_cache()
            if d:
                # Fill the context once (untimed), then every run starts from exactly d tokens.
                measure(s, context[:d], cache, 1, d)
            self.step(f"depth {d}: context")
            if mx is not None:
                mx.reset_peak_memory()
            runs = []
            for t in range(self.trials + 1):  # the first run is this depth's warm-up
                s.rewind(cache, d)
                r = measure(s, context[:d] + prompt, cache, max_tokens, len(prompt))
                if t:
                    runs.append(r)
                self.step(f"depth {d}: " + (f"trial {t}/{self.trials}" if t else "warm-up"))
            kv, tiers = s.kv_bytes(cache), s.kv_tiers(cache)
            entry = {**(tiers or {}), "depth": d, "prompt_tokens": len(prompt),
                     "ttft_s": stat(r["ttft_s"] for r in runs),
                     "prompt_tps": stat(r["prompt_tps"] for r in runs),
                     "decode_tps": stat(r["decode_tps"] for r in runs),
                     "generated_tokens": runs[0]["generated_tokens"],
                     # Speculative decoding (Strata's "auto"), summed over the trials.
                     "drafted_tokens": sum(r["drafted_tokens"] for r in runs),
                     "accepted_tokens": sum(r["accepted_tokens"] for r in runs),
                     "mlx_peak_bytes": int(mx.get_peak_memory()) if mx is not None else None,
                     "kv_bytes": kv}
            if d == job["depths"][0]:
                self.result["tokens"] = runs[0]["tokens"]
            self.result["depths"].append(entry)
            del cache
            gc.collect()
            self.result["memory"] = memory_figures(mx, kv, tiers)
            io1 = io_bytes()
            if io0 is not None and io1 is not None:
                # Context fills and trials together: what the sweep asked of the disk.
                secs = time.perf_counter() - t_io
                self.result["io"] = {"read_bytes": io1[0] - io0[0],
                                     "write_bytes": io1[1] - io0[1], "seconds": secs}
            self.save()


def _on_sigterm(_sig: int, _frame: Any) -> None:
    raise KeyboardInterrupt  # Cancel in the app: stop like Ctrl-C, keeping what finished


def main() -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    job = json.loads(Path(sys.argv[1]).read_text())
    runner = Runner(job)
    try:
        runner.run()
    except KeyboardInterrupt:
        # Ctrl-C reaches us and the parent, which then sends SIGTERM: let nothing cut the save.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        runner.result["status"] = "partial"
        runner.save()
        return 130
    except Exception as exc:
        runner.result["status"] = "failed"
        runner.result["error"] = f"{type(exc).__name__}: {exc}"
        runner.save()
        print(f"error: {runner.result['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is in the out file by now. Skip interpreter teardown: once, after a 16k-token
    # mlx-lm run, it hung in native thread-pool shutdown and kept the whole suite waiting.
    sys.stderr.flush()
    os._exit(code)

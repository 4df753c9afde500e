"""`strata bench prefix`: the SSD prefix cache against prefill, mlx-lm's prompt-cache file and
the disk, the cold first token of a chat against mlx_lm.generate, and the first token of each
turn of a 10-turn chat, all in one run (`--prefix-parts` picks some of the three).

Contract: every figure comes from a fresh process (`python -m engine.bench.prefix MODE JOB`)
that prints one JSON line; the parent drops the cache files (and mlx-lm's file) from the page
cache before each restart, so reads are cold. Weights stay in the page cache for every
subject alike. Ratios are taken between figures of this run only (the machine may be shared).
The disk's sequential speed is a 256 MB probe file read once right after it is written; next
to each restart the parent reads it again (older by then) and reads the cache's files
themselves (prefix format 3: one run file for the 2,048-token prefix) into memory touched
beforehand (the restore's I/O floor), cold; the summary compares medians.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

QUESTION = "In one sentence, what is this text about?"
PARTS = ("restore", "chat", "turns")
# The user's side of the multi-turn chat: short questions, so each turn adds a little history.
TURNS = (
    "Who wrote the text above, do you think?",
    "Name one thing it says about the weather.",
    "What would be a good title for it?",
    "Summarize it for a child in one sentence.",
    "Which word in it is the longest?",
    "Is the tone cheerful or gloomy?",
    "What happens at the end?",
    "Give me three keywords for it.",
    "Translate the first sentence into French.",
    "Thank you. What was my first question?",
)


def add_prefix_arguments(p: argparse.ArgumentParser) -> None:
    """Adds 'prefix' to `strata bench`'s suites and its own options."""
    for action in p._actions:  # the suite positional is engine.bench's; extend, do not copy
        if action.dest == "suite" and action.choices is not None:
            action.choices = [*action.choices, "prefix"]  # type: ignore[assignment]
    g = p.add_argument_group("prefix suite")
    g.add_argument("--system-tokens", type=int, default=1500,
                   help="prefix: system prompt length for the cold first-token chat")
    g.add_argument("--prefix-parts", default=",".join(PARTS),
                   help="prefix: which measurements, comma-separated: restore (the 2k-prefix "
                        "restore against prefill, mlx-lm and the disk), chat (cold first "
                        "token), turns (first token of each turn of a multi-turn chat)")
    g.add_argument("--turns", type=int, default=len(TURNS),
                   help=f"prefix: turns of the multi-turn chat (at most {len(TURNS)})")
    g.add_argument("--turn-tokens", type=int, default=32,
                   help="prefix: greedy tokens each reply of the multi-turn chat may have")


def _job_ids(model: str, profile: str | None, prefix_tokens: int, system_tokens: int
             ) -> dict[str, Any]:
    """Token ids for both tests, made once by the engine's own tokenizer."""
    from engine.bench import FILLER, prompt_ids
    from engine.library import Library
    from engine.runtime.tokenizer import Tokenizer

    manifest = Library().get(model)
    tok = Tokenizer.load(Path(manifest["path"]))
    prefix = prompt_ids(tok, prefix_tokens)
    question = tok.encode(" " + QUESTION, add_bos=False)
    system = tok.decode(prompt_ids(tok, system_tokens, FILLER))
    chat = tok.encode_chat([{"role": "system", "content": system},
                            {"role": "user", "content": QUESTION}])
    return {"model_dir": manifest["path"], "profile": profile, "prefix": prefix + question,
            "prefix_tokens": prefix_tokens, "chat": chat, "system": system}


def _drop(paths: list[Path]) -> bool:
    """Drop the files from the page cache; False when the OS kept most of them."""
    from engine.bench.worker import drop_page_cache

    return drop_page_cache([p for p in paths if p.is_file()])[0]


def _sync(paths: list[Path]) -> None:
    for path in paths:
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _spawn(mode: str, job: Path, env: dict[str, str]) -> dict[str, Any]:
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "engine.bench.prefix", mode, str(job)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        from engine.errors import StrataError

        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise StrataError(f"bench prefix {mode} worker failed: {tail}")
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    if "first_token_wall" in out:
        out["cold_first_token_s"] = out["first_token_wall"] - t0
    return out


def write_probe(folder: Path, mb: int = 256) -> Path:
    """The disk probe's file: `mb` MB of random bytes, on the disk (fsync)."""
    path = folder / "disk-probe.bin"
    chunk = 8 << 20
    buf = os.urandom(chunk)
    with open(path, "wb") as f:
        for _ in range(mb * (1 << 20) // chunk):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    return path


def read_probe(path: Path) -> dict[str, float]:
    """One cold sequential read of the probe file in 8 MB reads: buffered, then O_DIRECT."""
    import mmap

    size = path.stat().st_size
    chunk = 8 << 20
    out: dict[str, float] = {}
    _drop([path])
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass
    out["buffered_gbps"] = size / (time.perf_counter() - t) / 1e9
    _drop([path])
    if hasattr(os, "O_DIRECT"):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        m = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
        t = time.perf_counter()
        while os.readv(fd, [m]) > 0:
            pass
        out["direct_gbps"] = size / (time.perf_counter() - t) / 1e9
        os.close(fd)
        m.close()
    return out


def files_read_speed(paths: list[Path]) -> dict[str, float]:
    """The I/O floor of a restore: the same cache files, cold, read whole and in order into
    memory written beforehand (no page faults, no checks, no MLX), after a WILLNEED on all of
    them as the restore does. What the restore adds on top of this is its own cost."""
    sizes = [p.stat().st_size for p in paths]
    buf = bytearray(sum(sizes))
    view = memoryview(buf)
    for i in range(0, len(buf), 4096):  # fault the destination in before the clock starts
        buf[i] = 1
    _drop(paths)
    t = time.perf_counter()
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        advise = getattr(os, "posix_fadvise", None)
        for fd in fds:
            if advise is not None:
                advise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        pos = 0
        for fd, size in zip(fds, sizes, strict=True):
            got = 0
            while got < size:
                n = os.preadv(fd, [view[pos + got:pos + size]], got)
                if n <= 0:
                    break
                got += n
            pos += size
    finally:
        for fd in fds:
            os.close(fd)
    dt = time.perf_counter() - t
    return {"gbps": sum(sizes) / dt / 1e9, "s": dt, "files": len(paths)}


def run_prefix(args: argparse.Namespace) -> int:
    from engine.bench import machine_facts
    from engine.errors import StrataError

    trials = args.trials or 3
    prefix_tokens = args.prefix_tokens or 2048
    parts = [x.strip() for x in str(args.prefix_parts).split(",") if x.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise StrataError(f"--prefix-parts: {','.join(unknown) or 'nothing'} is not one of "
                          f"{','.join(PARTS)}")
    if not 1 <= args.turns <= len(TURNS):
        raise StrataError(f"--turns {args.turns}: must be 1 to {len(TURNS)}")
    with tempfile.TemporaryDirectory(prefix="strata-bench-prefix-") as tmp_s:
        tmp = Path(tmp_s)
        job = tmp / "job.json"
        data = _job_ids(args.model, args.profile, prefix_tokens, args.system_tokens)
        data.update(mlx_file=str(tmp / "mlxlm-prompt-cache.safetensors"), turns=args.turns,
                    turn_tokens=args.turn_tokens)
        job.write_text(json.dumps(data))
        env = dict(os.environ, STRATA_PREFIX_DIR=str(tmp / "prefix"))
        res: dict[str, Any] = {"machine": machine_facts(), "prefix_tokens": prefix_tokens,
                               "system_prompt_tokens": len(data["chat"]), "trials": trials,
                               "parts": parts}
        if "restore" in parts:
            _restore_part(res, job, data, env, tmp, prefix_tokens, trials)
        # The chat's system prompt gets its own cache folder: the restore part's pages are
        # of another prompt, and the turns part reuses what the chat part stored.
        chat_env = dict(env, STRATA_PREFIX_DIR=str(tmp / "prefix-chat"))
        if "chat" in parts:
            _chat_part(res, job, chat_env, tmp, trials)
        if "turns" in parts:
            print(f"prefix: a {args.turns}-turn chat", file=sys.stderr)
            res["turns"] = _spawn("turns", job, chat_env)
    res["summary"] = summarize(res)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=2, sort_keys=True))
    print(json.dumps(res["summary"], indent=2, sort_keys=True))
    return 0


def _restore_part(res: dict[str, Any], job: Path, data: dict[str, Any], env: dict[str, str],
                  tmp: Path, prefix_tokens: int, trials: int) -> None:
    print(f"prefix: building the cache of a {prefix_tokens}-token prefix (uncached)",
          file=sys.stderr)
    res["uncached"] = _spawn("build", job, env)
    pages = sorted((tmp / "prefix").glob("*.kvp"))
    # The build's files are still dirty in the page cache: the OS would neither drop them (the
    # first "cold" read would be warm) nor spare the disk their write-back during the trials.
    _sync([*pages, Path(data["mlx_file"])])
    probe = write_probe(tmp)
    # The goal's yardstick, as in earlier runs: the probe read once, right after it is written.
    res["disk"] = read_probe(probe)
    hits, loads, disks, floors = [], [], [], []
    try:
        for i in range(trials):
            # Next to each restart: the probe again (now as old as the page files are, which
            # reads slower on this VM's disk) and the page files themselves, plain.
            print(f"prefix: restart {i + 1}/{trials}", file=sys.stderr)
            disks.append(read_probe(probe))
            floors.append(files_read_speed(pages))
            cold = _drop(pages)
            hits.append({**_spawn("hit", job, env), "cold": cold})
            _drop([Path(data["mlx_file"])])
            loads.append(_spawn("mlxlm-load", job, env))
    finally:
        probe.unlink()
    res["hit"], res["mlxlm_load"] = hits, loads
    res["disk_again"], res["files_read"] = disks, floors


def _chat_part(res: dict[str, Any], job: Path, chat_env: dict[str, str], tmp: Path,
               trials: int) -> None:
    """Cold first token: a chat with a long system prompt, fresh process each time."""
    print("prefix: cold first token, uncached (builds the chat's cache)", file=sys.stderr)
    res["chat_uncached"] = _spawn("chat", job, chat_env)
    chat_pages = sorted((tmp / "prefix-chat").glob("*.kvp"))
    _sync(chat_pages)  # else the first drop leaves them cached (dirty pages stay)
    cached, peers = [], []
    for i in range(trials):
        print(f"prefix: cold first token {i + 1}/{trials}", file=sys.stderr)
        _drop(chat_pages)
        cached.append(_spawn("chat", job, chat_env))
        peers.append(_spawn("mlxlm-chat", job, chat_env))
    res["chat_cached"], res["chat_mlxlm"] = cached, peers


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "hit" in res:
        restore = _median([h["restore_s"] for h in res["hit"]])
        load = _median([m["load_s"] for m in res["mlxlm_load"]])
        mb = res["hit"][0]["bytes_read"] / 1e6
        disk = res["disk"].get("buffered_gbps", 0.0)
        floor = _median([f["gbps"] for f in res.get("files_read", [])] or [0.0])
        again = _median([d.get("buffered_gbps", 0.0) for d in res.get("disk_again", [])] or [0.0])
        uncached_ttft = res["uncached"]["ttft_s"]
        hit_ttft = _median([h["ttft_s"] for h in res["hit"]])
        out.update({
            "prefix_prefill_s": res["uncached"]["prefill_s"],
            "uncached_ttft_s": uncached_ttft,
            "hit_ttft_s": hit_ttft,
            "hit_speedup_ttft": uncached_ttft / hit_ttft,
            "restore_s": restore,
            "restore_s_all": [h["restore_s"] for h in res["hit"]],
            "restore_vs_prefill_speedup": res["uncached"]["prefill_s"] / restore,
            "restore_mb": mb,
            "restore_gbps": mb / 1e3 / restore,
            "mlxlm_load_s": load,
            "mlxlm_load_s_all": [m["load_s"] for m in res["mlxlm_load"]],
            "restore_over_mlxlm_load": restore / load,
            "mlxlm_file_mb": res["mlxlm_load"][0]["file_bytes"] / 1e6,
            "disk_buffered_gbps": disk,
            "disk_direct_gbps": res["disk"].get("direct_gbps"),
            "restore_fraction_of_disk": (mb / 1e3 / restore) / disk if disk else None,
            "disk_again_buffered_gbps": again or None,
            "disk_again_buffered_gbps_all": [d.get("buffered_gbps")
                                             for d in res.get("disk_again", [])],
            "restore_fraction_of_disk_again": (mb / 1e3 / restore) / again if again else None,
            # Each restart against the probe read just before it, then the median: the
            # yardstick swings 2x within minutes on a shared disk, a pair does not.
            "restore_fraction_of_disk_paired": _median([
                mb / 1e3 / h["restore_s"] / d["buffered_gbps"]
                for h, d in zip(res["hit"], res.get("disk_again", []), strict=False)
                if d.get("buffered_gbps") and h["restore_s"]] or [0.0]) or None,
            "files_read_gbps": floor or None,
            "files_read_gbps_all": [f["gbps"] for f in res.get("files_read", [])],
            "files_read_fraction_of_disk": floor / disk if disk and floor else None,
            "restore_fraction_of_files_read": (mb / 1e3 / restore) / floor if floor else None,
            "tokens_compared": len(res["uncached"]["tokens"]),
            "restores_cold": all(h.get("cold", True) for h in res["hit"]),
            "outputs_equal": all(h["tokens"] == res["uncached"]["tokens"] for h in res["hit"]),
        })
    if "chat_cached" in res:
        chat_cached = _median([c["cold_first_token_s"] for c in res["chat_cached"]])
        chat_peer = _median([c["cold_first_token_s"] for c in res["chat_mlxlm"]])
        out.update({
            "chat_system_tokens": res["system_prompt_tokens"],
            "chat_cold_uncached_s": res["chat_uncached"]["cold_first_token_s"],
            "chat_cold_cached_s": chat_cached,
            "chat_cold_mlxlm_s": chat_peer,
            "chat_cached_over_mlxlm": chat_cached / chat_peer,
            "chat_uncached_over_mlxlm": res["chat_uncached"]["cold_first_token_s"] / chat_peer,
            "chat_cached_tokens": _median([c["cached_tokens"] for c in res["chat_cached"]]),
        })
    if "turns" in res:
        rows = res["turns"]["turns"]
        last = rows[-1]
        later = [r["first_token_s"] for r in rows[1:]] or [rows[0]["first_token_s"]]
        out.update({
            "turns": len(rows),
            "turn_first_token_s": [r["first_token_s"] for r in rows],
            "turn_prompt_tokens": [r["prompt_tokens"] for r in rows],
            "turn_new_tokens": [r["new_tokens"] for r in rows],
            "turn_last_first_token_s": last["first_token_s"],
            "turn_last_over_median_of_turns_2_on": last["first_token_s"] / _median(later),
            "turn_last_without_reuse_s": res["turns"]["last_without_reuse_s"],
            "turn_last_reuse_speedup": (res["turns"]["last_without_reuse_s"]
                                        / last["first_token_s"]),
        })
    return out


# -- workers (each in a fresh process) ----------------------------------------------------
def _strata(job: dict[str, Any], ids: list[int], max_tokens: int, ignore_eos: bool = False
            ) -> dict[str, Any]:
    from engine.platform import compute_profile
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams
    from engine.telemetry import Timeline

    tl = Timeline()
    lm = LoadedModel.load(job["model_dir"], profile=compute_profile(job["profile"]),
                          timeline=tl)
    pc = lm.enable_prefix_cache()
    if ignore_eos:
        # The prefix's first greedy token is EOS: without this, build and hit would both
        # generate nothing and "same output" would compare two empty lists.
        lm.eos_ids = set()
    tokens: list[int] = []
    first_wall = 0.0
    last: Any = None
    cache = lm.new_cache()
    for ev in generate(lm, ids, SamplingParams(temperature=0.0), max_tokens, timeline=tl,
                       prompt_cache=cache):
        if ev.token is not None:
            if not tokens:
                first_wall = time.time()
            tokens.append(ev.token)
        last = ev
    out = {"first_token_wall": first_wall, "tokens": tokens, "ttft_s": last.ttft_s,
           "cached_tokens": last.cached_tokens, "restore_s": pc.stats.restore_s,
           "bytes_read": pc.stats.bytes_read, "timeline": tl.durations(),
           "prefill_s": tl.durations().get("prefill", 0.0)}
    if job.get("save_mlx"):
        from engine.runtime.model import cache_module

        cm = cache_module()
        n = job["prefix_tokens"]
        exact = []
        for c in cache.cache:  # exactly the prefix, no spare capacity: a fair file
            k = cm.KVCache()
            k.keys, k.values, k.offset = c.keys[..., :n, :], c.values[..., :n, :], n
            exact.append(k)
        cm.save_prompt_cache(job["mlx_file"], exact)
    pc.close()
    return out


def chat_turns(lm: Any, system: str, questions: Sequence[str], max_tokens: int
               ) -> tuple[list[dict[str, Any]], Any]:
    """Greedy multi-turn chat in one ChatSession: per turn, the first-token time from the
    call (template and tokenizing included) and the prompt's size; returns (rows, session)."""
    from engine.runtime.generate import ChatSession
    from engine.runtime.sampling import SamplingParams

    session = ChatSession(lm, system=system)
    rows = []
    for i, q in enumerate(questions):
        t0 = time.perf_counter()
        first, last = 0.0, None
        for ev in session.send(q, SamplingParams(temperature=0.0), max_tokens=max_tokens):
            if ev.token is not None and not first:
                first = time.perf_counter()
            last = ev
        assert last is not None
        rows.append({"turn": i + 1, "prompt_tokens": last.prompt_tokens,
                     "cached_tokens": last.cached_tokens,
                     "new_tokens": last.prompt_tokens - last.cached_tokens,
                     "first_token_s": (first or time.perf_counter()) - t0,
                     "ttft_s": last.ttft_s, "generated_tokens": last.generated_tokens})
    return rows, session


def _turns(job: dict[str, Any]) -> dict[str, Any]:
    """The multi-turn chat, then the last turn's prompt once more without any reuse."""
    from engine.platform import compute_profile
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams

    lm = LoadedModel.load(job["model_dir"], profile=compute_profile(job["profile"]))
    pc = lm.enable_prefix_cache()  # as the app has it: the system prompt comes off the SSD
    rows, session = chat_turns(lm, job["system"], TURNS[:job["turns"]], job["turn_tokens"])
    pc.close()
    prompt = lm.tokenizer.encode_chat(session.messages[:-1])  # the last turn's prompt
    t0 = time.perf_counter()
    for ev in generate(lm, prompt, SamplingParams(temperature=0.0), 1, prefix_cache=False):
        if ev.token is not None:
            break
    return {"turns": rows, "last_without_reuse_s": time.perf_counter() - t0,
            "last_prompt_tokens": len(prompt)}


def _worker(mode: str, job_path: str) -> dict[str, Any]:
    job = json.loads(Path(job_path).read_text())
    if mode == "build":
        job["save_mlx"] = True
        return _strata(job, job["prefix"], 4, ignore_eos=True)
    if mode == "hit":
        return _strata(job, job["prefix"], 4, ignore_eos=True)
    if mode == "chat":
        return _strata(job, job["chat"], 1)
    if mode == "turns":
        return _turns(job)
    if mode == "mlxlm-load":
        import mlx.core as mx

        from engine.runtime.model import cache_module

        t = time.perf_counter()
        cache = cache_module().load_prompt_cache(job["mlx_file"])
        mx.eval([c.keys for c in cache] + [c.values for c in cache])
        return {"load_s": time.perf_counter() - t,
                "file_bytes": os.path.getsize(job["mlx_file"])}
    if mode == "mlxlm-chat":
        # The real mlx_lm package first (its load needs it), then the same compute profile.
        import mlx.core as mx
        from mlx_lm import load, stream_generate

        from engine.platform import compute_profile
        from engine.runtime.model import apply_profile

        model, tok = load(job["model_dir"])[:2]
        apply_profile(model, compute_profile(job["profile"]))
        mx.eval(model.parameters())
        for r in stream_generate(model, tok, job["chat"], max_tokens=1):
            return {"first_token_wall": time.time(), "tokens": [int(r.token)]}
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1], sys.argv[2])), flush=True)

"""`strata bench prefix`: the SSD prefix cache against prefill, mlx-lm's prompt-cache file and
the disk, the cold first token of a chat against mlx_lm.generate, and the first token of each
turn of a 10-turn chat, all in one run (`--prefix-parts` picks some of the three).

Contract: `run(args)` is the suite. Every figure comes from a fresh process
(`python -m engine.bench.prefix_worker MODE JOB`, see there) that prints one JSON line; the
parent drops the cache files (and mlx-lm's file) from the page cache before each restart, so
reads are cold. Weights stay in the page cache for every subject alike. Ratios are taken
between figures of this run only (the machine may be shared). The disk's sequential speed is
a 256 MB probe file read once right after it is written; next to each restart the parent
reads it again (older by then) and reads the cache's files themselves (prefix format 3: one
run file for the 2,048-token prefix) into memory touched beforehand (the restore's I/O
floor), cold; the summary compares medians.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from engine.bench.common import FILLER, machine_facts, prompt_ids, say
from engine.bench.prefix_worker import TURNS
from engine.bench.system import drop_page_cache, sync_files
from engine.errors import StrataError
from engine.library import Library
from engine.runtime.tokenizer import Tokenizer

QUESTION = "In one sentence, what is this text about?"
PARTS = ("restore", "chat", "turns")


def _job_ids(model: str, profile: str | None, prefix_tokens: int, system_tokens: int
             ) -> dict[str, Any]:
    """Token ids for both tests, made once by the engine's own tokenizer."""
    manifest = Library().get(model)
    tok = Tokenizer.load(Path(manifest["path"]))
    prefix = prompt_ids(tok, prefix_tokens)
    question = tok.encode(" " + QUESTION, add_bos=False)
    system = tok.decode(prompt_ids(tok, system_tokens, FILLER))
    chat = tok.encode_chat([{"role": "system", "content": system},
                            {"role": "user", "content": QUESTION}])
    return {"model_dir": manifest["path"], "profile": profile, "prefix": prefix + question,
            "prefix_tokens": prefix_tokens, "chat": chat, "system": system}


def _spawn(mode: str, job: Path, env: dict[str, str]) -> dict[str, Any]:
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "engine.bench.prefix_worker", mode, str(job)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
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
    size = path.stat().st_size
    chunk = 8 << 20
    out: dict[str, float] = {}
    drop_page_cache([path])
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass
    out["buffered_gbps"] = size / (time.perf_counter() - t) / 1e9
    drop_page_cache([path])
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
    drop_page_cache(paths)
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


def run(args: argparse.Namespace) -> int:
    """The suite's parts, each figure from a fresh child; the summary on stdout."""
    turns = len(TURNS) if args.turns is None else args.turns
    trials = args.trials or 3
    prefix_tokens = args.prefix_tokens or 2048
    parts = ([x.strip() for x in str(args.prefix_parts).split(",") if x.strip()]
             if args.prefix_parts is not None else list(PARTS))
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise StrataError(f"--prefix-parts: {','.join(unknown) or 'nothing'} is not one of "
                          f"{','.join(PARTS)}")
    if not 1 <= turns <= len(TURNS):
        raise StrataError(f"--turns {turns}: must be 1 to {len(TURNS)}")
    with tempfile.TemporaryDirectory(prefix="strata-bench-prefix-") as tmp_s:
        tmp = Path(tmp_s)
        job = tmp / "job.json"
        data = _job_ids(args.model, args.profile, prefix_tokens, args.system_tokens)
        data.update(mlx_file=str(tmp / "mlxlm-prompt-cache.safetensors"), turns=turns,
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
            say(f"prefix: a {turns}-turn chat")
            res["turns"] = _spawn("turns", job, chat_env)
    res["summary"] = summarize(res)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(res, indent=2, sort_keys=True))
    print(json.dumps(res["summary"], indent=2, sort_keys=True))
    return 0


def _restore_part(res: dict[str, Any], job: Path, data: dict[str, Any], env: dict[str, str],
                  tmp: Path, prefix_tokens: int, trials: int) -> None:
    say(f"prefix: building the cache of a {prefix_tokens}-token prefix (uncached)")
    res["uncached"] = _spawn("build", job, env)
    pages = sorted((tmp / "prefix").glob("*.kvp"))
    # The build's files are still dirty in the page cache: the OS would neither drop them (the
    # first "cold" read would be warm) nor spare the disk their write-back during the trials.
    sync_files([*pages, Path(data["mlx_file"])])
    probe = write_probe(tmp)
    # The goal's yardstick, as in earlier runs: the probe read once, right after it is written.
    res["disk"] = read_probe(probe)
    hits, loads, disks, floors = [], [], [], []
    try:
        for i in range(trials):
            # Next to each restart: the probe again (now as old as the page files are, which
            # reads slower on this VM's disk) and the page files themselves, plain.
            say(f"prefix: restart {i + 1}/{trials}")
            disks.append(read_probe(probe))
            floors.append(files_read_speed(pages))
            cold = drop_page_cache(pages).done
            hits.append({**_spawn("hit", job, env), "cold": cold})
            drop_page_cache([Path(data["mlx_file"])])
            loads.append(_spawn("mlxlm-load", job, env))
    finally:
        probe.unlink()
    res["hit"], res["mlxlm_load"] = hits, loads
    res["disk_again"], res["files_read"] = disks, floors


def _chat_part(res: dict[str, Any], job: Path, chat_env: dict[str, str], tmp: Path,
               trials: int) -> None:
    """Cold first token: a chat with a long system prompt, fresh process each time."""
    say("prefix: cold first token, uncached (builds the chat's cache)")
    res["chat_uncached"] = _spawn("chat", job, chat_env)
    chat_pages = sorted((tmp / "prefix-chat").glob("*.kvp"))
    sync_files(chat_pages)  # else the first drop leaves them cached (dirty pages stay)
    cached, peers = [], []
    for i in range(trials):
        say(f"prefix: cold first token {i + 1}/{trials}")
        drop_page_cache(chat_pages)
        cached.append(_spawn("chat", job, chat_env))
        peers.append(_spawn("mlxlm-chat", job, chat_env))
    res["chat_cached"], res["chat_mlxlm"] = cached, peers


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "hit" in res:
        restore = median([h["restore_s"] for h in res["hit"]])
        load = median([m["load_s"] for m in res["mlxlm_load"]])
        mb = res["hit"][0]["bytes_read"] / 1e6
        disk = res["disk"].get("buffered_gbps", 0.0)
        floor = median([f["gbps"] for f in res.get("files_read", [])] or [0.0])
        again = median([d.get("buffered_gbps", 0.0) for d in res.get("disk_again", [])] or [0.0])
        uncached_ttft = res["uncached"]["ttft_s"]
        hit_ttft = median([h["ttft_s"] for h in res["hit"]])
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
            "restore_fraction_of_disk_paired": median([
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
        chat_cached = median([c["cold_first_token_s"] for c in res["chat_cached"]])
        chat_peer = median([c["cold_first_token_s"] for c in res["chat_mlxlm"]])
        out.update({
            "chat_system_tokens": res["system_prompt_tokens"],
            "chat_cold_uncached_s": res["chat_uncached"]["cold_first_token_s"],
            "chat_cold_cached_s": chat_cached,
            "chat_cold_mlxlm_s": chat_peer,
            "chat_cached_over_mlxlm": chat_cached / chat_peer,
            "chat_uncached_over_mlxlm": res["chat_uncached"]["cold_first_token_s"] / chat_peer,
            "chat_cached_tokens": median([c["cached_tokens"] for c in res["chat_cached"]]),
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
            "turn_last_over_median_of_turns_2_on": last["first_token_s"] / median(later),
            "turn_last_without_reuse_s": res["turns"]["last_without_reuse_s"],
            "turn_last_reuse_speedup": (res["turns"]["last_without_reuse_s"]
                                        / last["first_token_s"]),
        })
    return out

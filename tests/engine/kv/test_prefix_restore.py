"""The prefix cache's fast restore, the multi-turn chat's KV reuse and the weight read-ahead, on
the real starter model and real files: restored keys and values are the prefilled ones bit for
bit, every byte of a page file is covered by its digest, and each chat turn prefills only what
is new."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.bench.prefix_worker import TURNS, chat_turns
from engine.bench.system import drop_page_cache, resident_fraction
from engine.kv.prefix import _PX, _STEP, PrefixCache, _unfilled
from engine.platform import _glibc
from engine.runtime.generate import generate
from engine.runtime.readahead import read_ahead
from engine.runtime.sampling import SamplingParams

TEXT = ("The harbour office kept its ledgers in a tall oak cabinet, one drawer per year, and "
        "the tide tables were pinned beside the door where the pilots could read them. ") * 30




def _ids(lm: Any, n: int) -> list[int]:
    return lm.tokenizer.encode(TEXT, add_bos=False)[:n]


# A fresh process: load the starter; "build" stores 2,048 tokens of random keys and values in
# FOLDER (the memory test needs a restore larger than what glibc keeps by default, not a
# meaningful KV), "restore" restores them and says how many page faults the restore took.
_FAULTS_CHILD = r"""
import json, resource, sys
from pathlib import Path
import mlx.core as mx
from mlx_lm.models.cache import KVCache
from engine.kv.prefix import PrefixCache, PrefixSettings
from engine.runtime.generate import LoadedModel
mode, path, folder = sys.argv[1:4]
lm = LoadedModel.load(path)
pc = lm.new_prefix_cache(PrefixSettings(folder=Path(folder), tails=False))
ids = [(7 * i) % 1000 + 10 for i in range(2049)]
plan = pc.lookup(ids)
out = {"hit": plan.hit_tokens}
if mode == "build":
    caches = [KVCache() for _ in range(pc.n_layers)]
    for c in caches:
        shape = (1, pc.kv_heads, 2048, pc.head_dim)
        c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    pc.store(caches, ids, plan)
    pc.flush()
else:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out["restored"] = pc.restore(lm.new_cache().cache, ids, plan, 0)
    out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
pc.close()
out.update(layers=pc.n_layers, row=pc.kv_heads * pc.head_dim * pc.np_dtype.itemsize)
print(json.dumps(out))
"""


def _first_token(lm: Any, ids: list[int]) -> Any:
    """Generate one token in a fresh PromptCache; returns the cache."""
    cache = lm.new_cache()
    for _ in generate(lm, ids, SamplingParams(temperature=0), 1, prompt_cache=cache):
        pass
    return cache


def test_unfilled_buffers_have_the_shape_and_take_writes(starter_lm: Any) -> None:
    for dt, nd in ((mx.float32, np.dtype(np.float32)), (mx.float16, np.dtype(np.float16)),
                   (mx.uint16, np.dtype(np.uint16))):
        arrs = _unfilled(3, (1, 3, 64, 8), dt, nd)
        mx.eval(arrs)
        assert len(arrs) == 3
        for i, a in enumerate(arrs):
            assert a.shape == (1, 3, 64, 8) and a.dtype == dt
            view = np.asarray(memoryview(a))  # type: ignore[arg-type]
            view[...] = 7 + i
        for i, a in enumerate(arrs):  # separate buffers: no write lands in another array
            assert mx.all(a == 7 + i).item()


def test_restored_kv_equals_prefilled_kv_bit_for_bit(starter_lm: Any, prefix: PrefixCache
                                                     ) -> None:
    ids = _ids(starter_lm, 150)  # 4 full pages of 32, then a partial one
    want = _first_token(starter_lm, ids)  # prefills and stores the pages
    prefix.flush()
    got = _first_token(starter_lm, ids)
    assert prefix.stats.hits == 1 and prefix.stats.restored_tokens == 128
    for a, b in zip(want.cache, got.cache, strict=True):
        assert a.offset == b.offset == len(ids)
        assert mx.array_equal(a.keys[..., :128, :], b.keys[..., :128, :]).item()
        assert mx.array_equal(a.values[..., :128, :], b.values[..., :128, :]).item()
        # The suffix was prefilled on top of the restored pages in their spare capacity.
        assert mx.allclose(a.keys[..., 128:len(ids), :], b.keys[..., 128:len(ids), :],
                           atol=1e-4).item()


@pytest.mark.parametrize("where", ["digest", "last crc", "last value"])
def test_any_byte_of_a_page_is_covered(starter_lm: Any, prefix: PrefixCache, where: str
                                       ) -> None:
    ids = _ids(starter_lm, 70)
    _first_token(starter_lm, ids)
    prefix.flush()
    plan = prefix.lookup(ids)
    assert plan.hit_pages == 2 and len(plan.runs) == 1
    run = plan.runs[0].path
    data = bytearray(run.read_bytes())
    # Page 1 is the run's last record: its page header ends with the digest; the file ends
    # with the last layer's values and then that record's CRC-32.
    page1 = prefix.run_head_bytes(2) + prefix.page_bytes
    pos = {"digest": page1 + _PX.size - 1, "last crc": len(data) - 1,
           "last value": len(data) - 5}
    data[pos[where]] ^= 0x01
    run.write_bytes(bytes(data))
    last = list(generate(starter_lm, ids, SamplingParams(temperature=0), 1))[-1]
    assert last.cached_tokens == 32  # page 0 only
    assert prefix.stats.corrupt_pages == 1
    assert run.stat().st_size == page1  # the run is cut before the bad page
    prefix.flush()
    assert prefix.lookup(ids).hit_pages == 2  # page 1 rewritten by the store after the prefill


def test_each_chat_turn_prefills_only_what_is_new(starter_lm: Any) -> None:
    rows, session = chat_turns(starter_lm, "You answer in a few words.", TURNS[:4], 6)
    assert len(session.messages) == 9  # system + 4 questions + 4 replies
    for prev, row in zip(rows, rows[1:], strict=False):
        assert row["prompt_tokens"] > prev["prompt_tokens"]
        # The previous turn's prompt and most of its reply come from the KV kept in memory.
        assert row["cached_tokens"] >= prev["prompt_tokens"]
        assert row["new_tokens"] < 40
        assert row["first_token_s"] > 0


def test_read_ahead_brings_files_into_the_page_cache(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    files = []
    for i in range(2):
        f = tmp_path / f"model-{i}.safetensors"
        f.write_bytes(np.random.default_rng(i).bytes(4 << 20))
        files.append(f)
    dropped = drop_page_cache(files).done
    monkeypatch.setenv("STRATA_READAHEAD", "0")
    assert read_ahead(files) is None
    monkeypatch.delenv("STRATA_READAHEAD")
    t = read_ahead(files)
    assert t is not None
    t.join(timeout=30)
    assert not t.is_alive()
    if dropped:  # where the OS let us drop them, they must come back (the reads are async)
        deadline = time.monotonic() + 30
        while (resident_fraction(files) or 0) < 0.9 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (resident_fraction(files) or 0) >= 0.9


@pytest.mark.skipif(_glibc() is None, reason="the allocator tuning is glibc's (Linux)")
def test_a_restore_after_a_load_reuses_the_memory_the_load_freed(starter: Any, tmp_path: Path
                                                                 ) -> None:
    """With keep_freed_memory (the default) a 94 MB restore's buffers are memory the model
    load freed, already faulted in; with STRATA_KEEP_FREED=0 most of them are fresh memory,
    faulted in page by page during the read (~17,500 faults on this VM)."""
    def child(mode: str, **env: str) -> dict[str, Any]:
        r = subprocess.run([sys.executable, "-c", _FAULTS_CHILD, mode, starter["path"],
                            str(tmp_path / "px")], capture_output=True, text=True,
                           env={**os.environ, **env}, timeout=300)
        assert r.returncode == 0, r.stderr
        return dict(json.loads(r.stdout.strip().splitlines()[-1]))

    assert child("build")["hit"] == 0
    kept, fresh = child("restore"), child("restore", STRATA_KEEP_FREED="0")
    assert kept["restored"] == fresh["restored"] == 2048
    cap = -(-(2048 + 1) // _STEP) * _STEP
    pages = 2 * kept["layers"] * cap * kept["row"] // 4096  # the restore's new buffers
    assert fresh["faults"] > pages // 3, fresh
    assert kept["faults"] < pages // 10, kept


_RELEASE_CHILD = r"""
import json, sys
import mlx.core as mx
from engine.platform import release_freed_memory
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.sampling import SamplingParams
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
lm = LoadedModel.load(sys.argv[1])
for _ in generate(lm, [1, 2, 3, 4], SamplingParams(temperature=0), 1):
    pending = lm.release_pending
kv = [mx.zeros((1, 3, 2304, 64)) for _ in range(60)]  # 106 MB, as a dropped chat's KV
mx.eval(kv)
held = rss()
del kv
mx.clear_cache()
freed = release_freed_memory()
print(json.dumps({"pending_during": pending, "pending_after": lm.release_pending,
                  "returned": held - rss(), "freed": freed}))
"""


@pytest.mark.skipif(_glibc() is None, reason="the allocator tuning is glibc's (Linux)")
def test_freed_memory_goes_back_after_the_first_reply_and_on_release(starter: Any) -> None:
    """The heap keeps what the load freed until the first reply is done; after that, memory
    freed in bulk (a dropped chat's KV) goes back to the OS when the app releases it."""
    r = subprocess.run([sys.executable, "-c", _RELEASE_CHILD, starter["path"]],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["pending_during"] is True and out["pending_after"] is False
    assert out["freed"] and out["returned"] > 80e6, out

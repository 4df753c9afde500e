"""KV bits 8 and 4: quantized pages in both tiers and in the page records (checksums, foreign
formats refused), byte counts, and the starter model's answers (its KL against 16 bits is the
kvbits bench's, tests/engine/bench/test_kvbits.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engine  # noqa: F401  (BLAS shim before mlx)
from engine.errors import StrataError
from engine.kv import KVSettings, cpu_kernels, cpu_select
from engine.kv.attention import attend
from engine.kv.cache import PagedLayerCache
from engine.kv.codec import PageCodec
from engine.kv.pagefile import PageCorrupt, RecordFile, codec_record_size
from engine.kv.store import KVStore

H, D, P, REP = 2, 64, 8, 3
REPO = Path(__file__).resolve().parents[3]


def _settings(tmp_path: Path, **kw: Any) -> KVSettings:
    base: dict[str, Any] = dict(mode="exact", page_tokens=P, ssd_dir=tmp_path / "kv",
                                sink_tokens=P, window_tokens=2 * P, budget_tokens=6 * P)
    base.update(kw)
    return KVSettings(**base).validate()


def _pages(seed: int, n: int = 3) -> list[Any]:
    import mlx.core as mx

    mx.random.seed(seed)
    return [mx.random.normal((H, P, D)) * 4 for _ in range(n)]


# -- records ------------------------------------------------------------------------------
@pytest.mark.parametrize(("bits", "group"), [(8, 64), (8, 32), (4, 32), (4, 64)])
def test_quantized_pages_round_trip_through_records(tmp_path: Path, bits: int, group: int
                                                    ) -> None:
    import mlx.core as mx

    codec = PageCodec(bits, group, "float32")
    f = RecordFile(tmp_path / "l.kvp", 0, H, D, P, np.dtype(np.float32), bits, group)
    assert f.size == codec_record_size(codec, H, D, P)
    assert f.size < codec_record_size(PageCodec(16), H, D, P) * (bits + 2) / 16
    pages = _pages(bits + group)
    encoded = [(codec.encode(k), codec.encode(-k)) for k in pages]
    for i, (kp, vp) in enumerate(encoded):
        f.write_parts(i, i * P, tuple(np.array(a) for a in kp), tuple(np.array(a) for a in vp))
    for i, (kp, vp) in enumerate(encoded):
        head, rk, rv = f.read_parts(i)
        assert (head.kv_bits, head.group, head.tokens) == (bits, group, P)
        for a, b in zip(kp + vp, rk + rv, strict=True):
            assert np.array_equal(np.array(a), b)
        # Decoding is mx.dequantize's, and close to the page as computed.
        got = codec.decode(tuple(mx.array(a) for a in rk))
        want = mx.dequantize(*kp, group_size=group, bits=bits)
        assert bool(mx.array_equal(got, want))
        step = float((pages[i].max() - pages[i].min()) / (2 ** bits - 1))
        assert float(mx.abs(got - pages[i]).max()) <= step
    # The checksum covers every byte: a flipped bit in the last value bias is refused.
    with open(f.path, "r+b") as fh:
        at = 2 * f.size - 5
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(PageCorrupt, match="page 1: checksum mismatch"):
        f.read_parts(1)
    f.read_parts(0)
    f.close()


def test_records_of_another_format_are_refused(tmp_path: Path) -> None:
    import mlx.core as mx

    k = np.ones((H, P, D), np.float32)
    full = RecordFile(tmp_path / "f.kvp", 0, H, D, P, np.dtype(np.float32))
    full.write(0, 0, k, k)
    codec = PageCodec(8, 64)
    q8 = RecordFile(tmp_path / "q.kvp", 0, H, D, P, np.dtype(np.float32), 8, 64)
    parts = tuple(np.array(a) for a in codec.encode(mx.array(k)))
    q8.write_parts(0, 0, parts, parts)
    q8.write_parts(1, P, parts, parts)
    # Format 1 read as 8-bit, 8-bit read as 16-bit: the format is named, nothing misread.
    as_q = RecordFile(full.path, 0, H, D, P, np.dtype(np.float32), 8, 64)
    with pytest.raises(PageCorrupt, match="format 1, expected format 2"):
        as_q.read_parts(0)
    as_full = RecordFile(q8.path, 0, H, D, P, np.dtype(np.float32))
    with pytest.raises(PageCorrupt, match="format 2, expected format 1"):
        as_full.read(0)
    # Same format, other bits or group: the header does not match, the page is not used.
    for bits, group in ((4, 32), (4, 64), (8, 32)):
        other = RecordFile(q8.path, 0, H, D, P, np.dtype(np.float32), bits, group)
        with pytest.raises(PageCorrupt) as err:
            other.read_parts(0)
        assert "\n" not in str(err.value)
        other.close()
    for f in (full, q8, as_q, as_full):
        f.close()


# -- the store ----------------------------------------------------------------------------
def _reference(q: Any, ks: list[Any], vs: list[Any]) -> Any:
    import mlx.core as mx

    k, v = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
    L, T = q.shape[2], k.shape[2]
    mask = (mx.arange(L)[:, None] + T - L) >= mx.arange(T)[None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)


def _attend_run(store: KVStore, seed: int = 0) -> tuple[list[Any], float]:
    """Chunks of keys and values through one layer; outputs and the worst error against
    attention over the values as computed."""
    import mlx.core as mx

    mx.random.seed(seed)
    cache = PagedLayerCache(store, 0)
    ks, vs, outs, worst = [], [], [], 0.0
    for n in [13, 8, 40, 1, 1, 1, 30, 1, 1]:
        k, v = mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))
        q = mx.random.normal((1, H * REP, n, D))
        ks.append(k)
        vs.append(v)
        k2, v2 = cache.update_and_fetch(k, v)
        out = attend(cache, q, k2, v2, D ** -0.5)
        outs.append(out)
        worst = max(worst, float(mx.abs(out - _reference(q, ks, vs)).max()))
    return outs, worst


@pytest.mark.parametrize(("bits", "bound"), [(16, 1e-5), (8, 0.03), (4, 0.6)])
@pytest.mark.parametrize("mode", ["exact", "sparse"])
def test_quantized_store_same_from_ram_and_ssd(tmp_path: Path, bits: int, bound: float,
                                               mode: str) -> None:
    import mlx.core as mx

    # Sparse: a budget of 5 of the 12 pages, so pages are picked and gathered per head.
    s = _settings(tmp_path, bits=bits, mode=mode, budget_tokens=5 * P)
    hot = KVStore(s, 1, H, D)
    ref, worst = _attend_run(hot)
    if mode == "exact":  # quantized: close to the values as computed, not equal
        assert worst < bound and (bits == 16 or worst > 1e-4)
    cold = KVStore(s, 1, H, D)
    # Most pages are read back from the records; sparse steps pick more pages than the 5
    # slots hold (sink, window and 2 per head), so they are read for the step only.
    cold.max_slots = 5
    outs, _ = _attend_run(cold)
    for a, b in zip(ref, outs, strict=True):  # other kernels (fused, page-wise): rounding
        assert float(mx.abs(a - b).max()) < 1e-5
    # The SSD tier gives back exactly the encoded bytes the RAM tier held.
    table = cold.tables[0]
    assert (table.slot_of[:table.n_pages] < 0).sum() >= 5
    for i in range(table.n_pages):
        for a, b in zip(hot.page_np(0, i), cold.page_np(0, i), strict=True):
            assert bool(mx.array_equal(a, b))
    st = cold.stats()
    assert st["ssd_reads"] > 0 and st["evictions"] > 0
    # Byte counts are the encoded sizes, and the records on disk are that size.
    codec = PageCodec(bits, s.group())
    assert cold.page_bytes == 2 * H * P * codec.vector_bytes(D)
    assert st["bytes_ram"] == st["pages_ram"] * cold.page_bytes
    cold.flush()
    size = (cold.folder / "layer-00.kvp").stat().st_size  # type: ignore[operator]
    assert size == cold.tables[0].n_pages * codec_record_size(codec, H, D, P)
    assert cold.stats()["bytes_ssd"] == cold.tables[0].n_on_disk * codec_record_size(
        codec, H, D, P)
    for s in (hot, cold):
        s.close()


def test_summaries_come_from_keys_before_quantization(tmp_path: Path) -> None:
    import mlx.core as mx

    store = KVStore(_settings(tmp_path, bits=4), 1, H, D)
    pages = _pages(3)
    for k in pages:
        store.commit(0, k, k)
    table = store.tables[0]
    for i, k in enumerate(pages):
        assert bool(mx.array_equal(table.kmax[i], k.max(axis=1)))
        assert bool(mx.array_equal(table.kmin[i], k.min(axis=1)))
        got, _ = store.page_np(0, i)
        assert not bool(mx.array_equal(got, k))  # what is stored is quantized
    store.close()


def test_corrupted_quantized_page_is_refused(tmp_path: Path) -> None:
    import mlx.core as mx

    store = KVStore(_settings(tmp_path, bits=8), 1, H, D)
    store.max_slots = 4
    cache = PagedLayerCache(store, 0)
    cache.update_and_fetch(mx.random.normal((1, H, 10 * P, D)),
                           mx.random.normal((1, H, 10 * P, D)))
    store.flush()
    cold = int(np.flatnonzero(store.tables[0].slot_of[:10] < 0)[0])
    f = store._file(0)
    with open(f.path, "r+b") as fh:  # a byte of the key codes
        fh.seek(cold * f.size + 100)
        b = fh.read(1)
        fh.seek(cold * f.size + 100)
        fh.write(bytes([b[0] ^ 0x10]))
    q = mx.random.normal((1, H * REP, 1, D))
    k1 = mx.random.normal((1, H, 1, D))
    k2, v2 = cache.update_and_fetch(k1, k1)
    with pytest.raises(PageCorrupt, match=f"page {cold}: checksum mismatch"):
        mx.eval(attend(cache, q, k2, v2, D ** -0.5))
    store.close()


def test_restart_reads_pages_of_its_own_bits_only(tmp_path: Path) -> None:
    import mlx.core as mx

    s8 = _settings(tmp_path, bits=8, keep_files=True)
    a = KVStore(s8, 1, H, D, session="restart")
    pages = _pages(5, 4)
    for k in pages:
        a.commit(0, k, -k)
    want = [a.page_np(0, i) for i in range(4)]
    a.save_manifest(4 * P)
    a.close()
    b = KVStore(s8, 1, H, D, session="restart")
    b.adopt(0, 4)
    for i in range(4):
        k, v = b.page_np(0, i)
        assert bool(mx.array_equal(k, want[i][0])) and bool(mx.array_equal(v, want[i][1]))
    b.close()
    for other in (s8.with_(bits=16), s8.with_(bits=4), s8.with_(group_size=32)):
        c = KVStore(other, 1, H, D, session="restart")
        with pytest.raises(PageCorrupt):
            c.adopt(0, 4)
        c.close()


def test_bad_kv_bits_settings_are_one_line_errors(tmp_path: Path) -> None:
    cases = [dict(mode="mlx", bits=8), dict(bits=3), dict(mode="exact", bits=8, group_size=16)]
    for kw in cases:
        with pytest.raises(StrataError) as err:
            KVSettings(**kw).validate()  # type: ignore[arg-type]
        assert "\n" not in str(err.value)
    assert "paged KV cache" in _message(dict(mode="mlx", bits=4))
    # A head dim no supported group divides: refused when the store is made.
    with pytest.raises(StrataError, match="head dim 16 is not a multiple of 32"):
        KVStore(_settings(tmp_path, bits=8), 1, H, 16)
    KVStore(_settings(tmp_path, bits=16), 1, H, 16).close()


def _message(kw: dict[str, Any]) -> str:
    try:
        KVSettings(**kw).validate()
    except StrataError as exc:
        return str(exc)
    return ""


# -- the starter model --------------------------------------------------------------------
def test_8_and_4_bit_pages_answer_like_16(starter_lm: Any, tmp_path: Path) -> None:
    from engine.runtime.generate import generate
    from engine.runtime.sampling import SamplingParams

    lm = starter_lm
    prompt = lm.tokenizer.encode_chat([{"role": "user",
                                        "content": "What is the capital of France?"}])
    greedy = SamplingParams(temperature=0.0)
    texts: dict[tuple[str, int], str] = {}
    try:
        for mode, bits in (("exact", 16), ("exact", 8), ("sparse", 8), ("exact", 4)):
            # 16-token pages: all but the prompt's last few tokens are in quantized pages.
            lm.kv_settings = KVSettings(mode=mode, bits=bits, page_tokens=16, sink_tokens=16,
                                        window_tokens=16, budget_tokens=48,
                                        ssd_dir=tmp_path).validate()
            pc = lm.new_cache()
            texts[mode, bits] = "".join(e.text for e in generate(lm, prompt, greedy,
                                                                 max_tokens=12,
                                                                 prompt_cache=pc))
            store = pc.cache[0].store
            assert store.codec.bits == bits and store.tables[0].n_pages >= len(prompt) // 16
            pc.close()
    finally:
        lm.kv_settings = None
    assert "Paris" in texts["exact", 16]
    assert texts["exact", 8] == texts["exact", 16]
    assert texts["sparse", 8] == texts["exact", 16]
    # 4-bit keys move this prompt's first token (KL 0.06 at that step; docs/benchmarks.md):
    # it answers, not necessarily the same words.
    assert texts["exact", 4].strip()


@pytest.mark.skipif(not cpu_kernels.available(), reason="numba not installed here")
@pytest.mark.parametrize("bits", [8, 4])
def test_exact_decode_reads_codes_as_mlx_decodes_them(starter_lm: Any, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      bits: int) -> None:
    # Exact decode over quantized pages in RAM (past FUSED_DECODE_PAST, from DENSE_MIN_KEYS
    # keys on; both lowered here to this prompt's): the compiled loop reading codes answers
    # what MLX's decoded pages do.
    from engine.kv import attention
    from engine.runtime.generate import generate
    from engine.runtime.sampling import SamplingParams

    lm = starter_lm
    prompt = lm.tokenizer.encode_chat([{"role": "user",
                                        "content": "Name three colours of the rainbow."}])
    monkeypatch.setattr(cpu_select, "DENSE_MIN_KEYS", 32)
    monkeypatch.setattr(attention, "FUSED_DECODE_PAST", 0)
    calls: list[int] = []
    loop = cpu_kernels.dense_pages_q
    monkeypatch.setattr(cpu_kernels, "dense_pages_q",
                        lambda *a: calls.append(1) or loop(*a))  # counts, then runs it
    texts = []
    try:
        for loops in (True, False):
            with monkeypatch.context() as mp:
                if not loops:
                    mp.setitem(cpu_kernels._state, "loops", None)  # MLX decodes the pages
                lm.kv_settings = KVSettings(mode="exact", bits=bits, page_tokens=16,
                                            ssd_dir=tmp_path / str(loops)).validate()
                pc = lm.new_cache()
                texts.append("".join(e.text for e in generate(
                    lm, prompt, SamplingParams(temperature=0.0), max_tokens=12,
                    prompt_cache=pc)))
                pc.close()
            if loops:
                assert calls, "the loop never ran"
                n = len(calls)
        assert len(calls) == n  # not without the loops
    finally:
        lm.kv_settings = None
    assert texts[0].strip() and texts[0] == texts[1]


def test_cli_generate_with_4_bit_pages(starter: Any) -> None:
    import json

    # A system prompt long enough that the first 128-token page is stored at 4 bits.
    system = ("You are a helpful assistant who answers questions about geography briefly "
              "and accurately. " + "Always answer in one short sentence and name the place "
              "plainly. " * 12)
    out = subprocess.run([sys.executable, "-m", "app", "generate", "--system", system,
                          "--prompt", "What is the capital of France?", "--kv-mode", "exact",
                          "--kv-bits", "4", "--max-tokens", "12", "--temp", "0", "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["prompt_tokens"] > 128
    assert "Paris" in doc["text"]  # as 16 and 8 bits answer (measured on this prompt)


def test_cli_refuses_bits_without_paged_mode(starter: Any) -> None:
    # (Without --kv-mode the default is the paged exact mode, which takes bits.)
    for extra in (["--kv-mode", "mlx"],):
        out = subprocess.run([sys.executable, "-m", "app", "generate", "--prompt", "x",
                              "--kv-bits", "8", *extra], capture_output=True, text=True,
                             cwd=REPO, timeout=120)
        assert out.returncode == 1
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "KV bits 8" in lines[0] and "--kv-mode" in lines[0]


def test_prefix_cache_key_includes_kv_bits(starter_lm: Any) -> None:
    from engine.kv import KVSettings

    keys = set()
    try:
        for b in (16, 8, 4):
            starter_lm.kv_settings = KVSettings(mode="exact", bits=b)
            keys.add(starter_lm.prefix_key())
    finally:
        starter_lm.kv_settings = None
    assert len(keys) == 3

"""Property-based fuzzing of every reader of untrusted bytes: GGUF headers, safetensors
headers, KV page records and prefix-cache files.

Contract checked: a mutated, truncated or random file never crashes, hangs or allocates
beyond a bound; a model file is imported or refused with an ImportFailed of one line; a KV
or prefix page is either rejected or returns exactly the bytes that were written. CI runs a
few hundred examples; docs/reliability.md records longer runs (STRATA_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import os
import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import ImportFailed
from engine.importers import import_path
from engine.importers.gguf import read_metadata
from engine.kv.pagefile import PageCorrupt, RecordFile
from engine.library.store import Library
from tests.reliability.common import (
    HEAD_DIM,
    KV_HEADS,
    PAGE,
    new_prefix_cache,
    page_arrays,
    prefix_pages,
    prefix_prompt,
    read_prefix_page,
    time_limit,
    write_prefix_pages,
    write_tiny_gguf,
)

SCALE = int(os.environ.get("STRATA_FUZZ_EXAMPLES", "0"))  # 0: the CI sizes below


def examples(ci: int) -> int:
    return SCALE or ci


FUZZ = dict(deadline=None, derandomize=not SCALE, database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture,
                                   HealthCheck.too_slow, HealthCheck.data_too_large])
HUGE = [2**63 - 1, 2**64 - 1, 2**40, 2**32 + 7, 2**31, 0xFFFFFFFF, 10**9, 0]
MEMORY_BOUND = 64 << 20  # bytes any one read may allocate (tracemalloc peak)


class Mutated(bytes):
    """File bytes with a short repr (hypothesis prints examples; whole files are too long)."""

    def __repr__(self) -> str:
        return f"<{len(self)} mutated bytes>"


def one_line_rejection(exc: BaseException) -> None:
    text = str(exc)
    assert text and "\n" not in text, f"not a one-line message: {text!r}"


# -- GGUF -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny valid GGUF, the end of its header and the offsets of every count it claims."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    reader = gguf.GGUFReader(str(path))  # the gguf package's reader exposes field offsets
    counts = [8, 16]  # tensor count, metadata count
    types = []
    for name, fld in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        counts.append(int(fld.offset))  # the key's length
        vtype = int(fld.offset) + 8 + len(name.encode())
        types.append(vtype)
        if len(fld.types) > 1:  # an array: item type after key and value type, then count
            types.append(vtype + 4)
            counts.append(vtype + 8)
    for t in reader.tensors:
        counts.append(int(t.field.offset))
        counts.append(int(t.field.offset) + 8 + len(t.name.encode()) + 4)  # first dim
    return {"path": path, "data": path.read_bytes(), "header_end": int(reader.data_offset),
            "counts": counts, "types": types}


@st.composite
def gguf_mutation(draw: Any, base: dict[str, Any]) -> Mutated:
    data = bytearray(base["data"])
    end = base["header_end"]
    for _ in range(draw(st.integers(0, 3))):  # claim huge counts and sizes
        pos = draw(st.sampled_from(base["counts"]))
        fmt = draw(st.sampled_from(["<Q", "<I"]))
        value = draw(st.sampled_from(HUGE)) % (2 ** (8 * struct.calcsize(fmt)))
        struct.pack_into(fmt, data, pos, value)
    for _ in range(draw(st.integers(0, 2))):  # change value types (arrays of other items)
        struct.pack_into("<I", data, draw(st.sampled_from(base["types"])),
                         draw(st.integers(0, 13)))
    for _ in range(draw(st.integers(0, 6))):  # flip header bytes
        data[draw(st.integers(4, end - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):  # truncate
        del data[draw(st.integers(4, len(data))):]
    return Mutated(data)


def read_guarded(path: Path) -> None:
    """read_metadata under a hang guard and a memory bound; ImportFailed is fine."""
    tracemalloc.start()
    try:
        with time_limit(20):
            read_metadata(path)
    except ImportFailed as exc:
        one_line_rejection(exc)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, f"reading a {path.stat().st_size}-byte file took {peak} bytes"


def test_gguf_header_mutations_are_read_or_refused(gguf_base: dict[str, Any],
                                                   tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"

    @settings(max_examples=examples(150), **FUZZ)  # type: ignore[arg-type]
    @given(data=gguf_mutation(gguf_base))
    def check(data: bytes) -> None:
        path.write_bytes(data)
        read_guarded(path)

    check()


def test_random_gguf_headers_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.gguf"

    @settings(max_examples=examples(150), **FUZZ)  # type: ignore[arg-type]
    @given(version=st.sampled_from([2, 3, 3 << 16, 1, 7]), counts=st.tuples(
        st.sampled_from(HUGE + [1, 2]), st.sampled_from(HUGE + [1, 2])),
        rest=st.binary(max_size=512))
    def check(version: int, counts: tuple[int, int], rest: bytes) -> None:
        path.write_bytes(b"GGUF" + struct.pack("<IQQ", version, *counts) + rest)
        read_guarded(path)

    check()


def test_mutated_gguf_imports_or_is_refused_and_library_stays_whole(
        gguf_base: dict[str, Any], tmp_path: Path) -> None:
    library = Library(tmp_path / "home")
    path = tmp_path / "m.gguf"
    seen = {"imported": 0, "refused": 0}

    @settings(max_examples=examples(60), **FUZZ)  # type: ignore[arg-type]
    @given(data=gguf_mutation(gguf_base))
    def check(data: bytes) -> None:
        path.write_bytes(data)
        try:
            with time_limit(60):
                m = import_path(library, path, name="fuzzed", replace=True)
            seen["imported"] += 1
            assert (Path(m["path"]) / "manifest.json").is_file()
        except ImportFailed as exc:
            one_line_rejection(exc)
            seen["refused"] += 1
        assert not [p for p in library.models_dir.iterdir() if p.name.startswith(".tmp-")]

    check()
    assert seen["refused"] > 0


# -- safetensors ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.hf_factory import write_hf_llama

    folder = tmp_path_factory.mktemp("hf") / "tiny-hf"
    write_hf_llama(folder, layers=1)
    return folder


@st.composite
def safetensors_mutation(draw: Any, data: bytes) -> Mutated:
    n = struct.unpack_from("<Q", data)[0]
    out = bytearray(data)
    kind = draw(st.sampled_from(["flip", "length", "truncate", "header"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 6))):
            out[draw(st.integers(0, 8 + n - 1))] = draw(st.integers(0, 255))
    elif kind == "length":
        struct.pack_into("<Q", out, 0, draw(st.sampled_from(HUGE + [n + 1, n - 1, 1])))
    elif kind == "truncate":
        del out[draw(st.integers(0, len(out) - 1)):]
    else:
        header = draw(st.one_of(
            st.binary(max_size=200),
            st.builds(lambda shape, offs, dtype: (
                f'{{"model.embed_tokens.weight": {{"dtype": "{dtype}", "shape": {shape}, '
                f'"data_offsets": {offs}}}}}').encode(),
                st.sampled_from(["[320, 64]", "[4611686018427387904, 4]", "[-1]", "[]",
                                 "[1, 2, 3, 4, 5, 6, 7, 8, 9]", '"x"']),
                st.sampled_from(["[0, 81920]", "[0, 1099511627776]", "[5, 1]", "[-8, 0]"]),
                st.sampled_from(["F32", "F16", "BF16", "I64", "F8_E4M3", "BOGUS"]))))
        out = bytearray(struct.pack("<Q", len(header)) + header + bytes(out[8 + n:]))
    return Mutated(out)


def test_mutated_safetensors_header_is_refused_in_one_line(hf_base: Path,
                                                           tmp_path: Path) -> None:
    """mx.load parses the header in C++: run it in this process, so a crash fails the test
    run (a 2,000-case subprocess probe found none; docs/reliability.md)."""
    library = Library(tmp_path / "home")
    folder = tmp_path / "tiny-hf"
    shutil.copytree(hf_base, folder)
    weights = (hf_base / "model.safetensors").read_bytes()

    @settings(max_examples=examples(60), **FUZZ)  # type: ignore[arg-type]
    @given(data=safetensors_mutation(weights))
    def check(data: bytes) -> None:
        (folder / "model.safetensors").write_bytes(data)
        try:
            with time_limit(60):
                import_path(library, folder, name="fuzzed-hf", replace=True)
        except ImportFailed as exc:
            one_line_rejection(exc)
        assert not [p for p in library.models_dir.iterdir() if p.name.startswith(".tmp-")]

    check()


# -- KV page records --------------------------------------------------------------------------
PAGES = 4
SHAPE = (KV_HEADS, PAGE, HEAD_DIM)


def test_mutated_kv_page_records_are_rejected_or_exact(tmp_path: Path) -> None:
    good = tmp_path / "good.kvp"
    f = RecordFile(good, 0, KV_HEADS, HEAD_DIM, PAGE, np.dtype(np.float32))
    for i in range(PAGES):
        f.write(i, i * PAGE, *page_arrays(0, i, 0, SHAPE))
    f.close()
    data = good.read_bytes()
    path = tmp_path / "m.kvp"

    @settings(max_examples=examples(200), **FUZZ)  # type: ignore[arg-type]
    @given(flips=st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)),
                          max_size=8),
           cut=st.one_of(st.none(), st.integers(0, len(data))))
    def check(flips: list[tuple[int, int]], cut: int | None) -> None:
        out = bytearray(data)
        for pos, value in flips:
            out[pos] = value
        path.write_bytes(bytes(out[:cut]))
        r = RecordFile(path, 0, KV_HEADS, HEAD_DIM, PAGE, np.dtype(np.float32))
        try:
            for i in range(PAGES + 1):
                try:
                    head, k, v = r.read(i)
                except PageCorrupt as exc:
                    one_line_rejection(exc)
                    continue
                want_k, want_v = page_arrays(0, i, 0, SHAPE)
                assert head.index == i
                assert np.array_equal(k, want_k) and np.array_equal(v, want_v)
        finally:
            r.close()

    check()


# -- prefix cache files -----------------------------------------------------------------------
def test_mutated_prefix_runs_are_rejected_and_cut_or_exact(tmp_path: Path) -> None:
    """Any flips, cut or growth of a run file of two pages: each page read is either the
    bytes written or rejected, and a rejected page is never found again (its run is cut)."""
    cache = new_prefix_cache(tmp_path / "prefix")
    prompt = prefix_prompt(2)
    write_prefix_pages(cache, prompt, 2)
    (run,) = cache.folder.glob("*.kvp")
    data = run.read_bytes()
    ks, vs = prefix_pages(2)

    @settings(max_examples=examples(200), **FUZZ)  # type: ignore[arg-type]
    @given(depth=st.integers(0, 1), flips=st.lists(st.tuples(st.integers(0, 10**6),
                                                           st.integers(0, 255)), max_size=6),
           cut=st.one_of(st.none(), st.integers(0, 10**6)), grow=st.binary(max_size=8))
    def check(depth: int, flips: list[tuple[int, int]], cut: int | None, grow: bytes) -> None:
        out = bytearray(data)
        for pos, value in flips:
            out[pos % len(out)] = value
        out = out[:cut] + grow
        run.write_bytes(bytes(out))
        ok, got_k, got_v = read_prefix_page(cache, prompt, depth)
        if ok:
            sl = slice(depth * PAGE, (depth + 1) * PAGE)
            for layer in range(len(ks)):
                assert np.array_equal(got_k[layer][0], ks[layer][:, sl])
                assert np.array_equal(got_v[layer][0], vs[layer][:, sl])
        else:
            assert cache.lookup(prompt).hit_pages <= depth, "a bad page must not be found again"
        run.write_bytes(data)

    try:
        check()
    finally:
        cache.close()

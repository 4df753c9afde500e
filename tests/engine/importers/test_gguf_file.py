"""The GGUF reader: the same metadata and tensors as the `gguf` package's reader, a prompt
refusal of an architecture Strata cannot run, split files, and headers that disagree.

Files are written with `gguf.GGUFWriter` (llama.cpp's own writer); split ones with its
`split_max_tensors`, named as llama.cpp's gguf-split names them.
"""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from engine.errors import ImportFailed
from engine.importers import import_path
from engine.importers.gguf_file import read_gguf
from engine.library import Library
from tests.engine.gguf_factory import ModelSpec, Vocab, bpe_vocab, write_gguf
from tests.helpers import run_strata

SPEC = ModelSpec(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-file")


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return bpe_vocab()[0]


@pytest.fixture(scope="module")
def whole(workdir: Path, vocab: Vocab) -> Path:
    return write_gguf(workdir / "whole.gguf", SPEC, "Q8_0", vocab, seed=3).path


def rewrite(src: Path, dest: Path, split_max_tensors: int = 0,
            change: dict[str, Any] | None = None) -> list[Path]:
    """Copy a GGUF through GGUFWriter (optionally split into parts, or with metadata values
    changed); the paths written, in order."""
    reader = gguf.GGUFReader(str(src))
    dest.parent.mkdir(parents=True, exist_ok=True)
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dest), arch, split_max_tensors=split_max_tensors)
    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (change or {}).get(key, fld.contents())
        sub = fld.types[-1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, fld.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if not split_max_tensors:
        return [dest]
    return sorted(dest.parent.glob(f"{dest.stem}-*-of-*.gguf"))


def test_metadata_and_tensors_equal_the_gguf_packages_reader(whole: Path) -> None:
    ours = read_gguf(whole)
    theirs = gguf.GGUFReader(str(whole))
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.meta == want
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.shape == tuple(int(x) for x in b.shape)
        assert a.tensor_type == b.tensor_type
        assert a.data_offset == int(b.data_offset) and a.n_bytes == int(b.n_bytes)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)


def test_an_unknown_architecture_is_refused_within_a_second_of_the_header(
        workdir: Path, tmp_path: Path) -> None:
    """A 262,144-entry vocabulary (Gemma's size) behind an architecture Strata cannot run:
    refused with the name and the list, before the vocabulary costs anything."""
    path = workdir / "big-vocab.gguf"
    w = gguf.GGUFWriter(str(path), "rwkv7")
    w.add_block_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"tok{i}" for i in range(262_144)])
    w.add_token_scores([0.0] * 262_144)
    w.add_tensor("token_embd.weight", np.zeros((262_144, 8), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lib = Library(tmp_path / "home")
    start = time.perf_counter()
    with pytest.raises(ImportFailed) as err:
        import_path(lib, path)
    elapsed = time.perf_counter() - start
    text = str(err.value)
    assert "unsupported architecture 'rwkv7'" in text and "supported: " in text
    assert "llama" in text.split("supported: ")[1] and "\n" not in text
    assert elapsed < 1.0, f"refused after {elapsed:.2f} s"
    assert lib.manifests() == []


def test_the_whole_vocabulary_reads_in_well_under_a_second(workdir: Path) -> None:
    """The reader itself on the 262,144 strings (the `gguf` package's reader: about 23 s)."""
    start = time.perf_counter()
    f = read_gguf(workdir / "big-vocab.gguf")
    assert len(f.meta["tokenizer.ggml.tokens"]) == 262_144
    assert f.meta["tokenizer.ggml.tokens"][262_143] == "tok262143"
    assert time.perf_counter() - start < 1.0


@pytest.fixture(scope="module")
def split(workdir: Path, whole: Path) -> list[Path]:
    parts = rewrite(whole, workdir / "split" / "model.gguf", split_max_tensors=8)
    assert len(parts) >= 3, parts
    return parts


def test_a_split_gguf_reads_as_the_whole_file(whole: Path, split: list[Path]) -> None:
    one = read_gguf(whole)
    for given in (split[0], split[-1]):  # any part opens the whole model
        parts = read_gguf(given)
        assert parts.path == split[0] and parts.parts == split
        assert [t.name for t in parts.tensors] == [t.name for t in one.tensors]
        for a, b in zip(parts.tensors, one.tensors, strict=True):
            np.testing.assert_array_equal(a.data, b.data)


def test_a_split_gguf_imports_like_the_whole_file(tmp_path: Path, whole: Path,
                                                  split: list[Path]) -> None:
    import mlx.core as mx

    lib = Library(tmp_path / "home")
    a = import_path(lib, whole, name="whole")
    b = import_path(lib, split[0])
    assert b["name"] == "model"  # the split's name, without -00001-of-0000N
    wa = mx.load(str(Path(a["path"]) / "model.safetensors"))
    wb = mx.load(str(Path(b["path"]) / "model.safetensors"))
    assert isinstance(wa, dict) and isinstance(wb, dict) and wa.keys() == wb.keys()
    for k, v in wa.items():
        assert mx.array_equal(v, wb[k]), k


def test_a_missing_split_part_is_named(tmp_path: Path, split: list[Path]) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    for p in split:
        if p != split[1]:
            (folder / p.name).write_bytes(p.read_bytes())
    home = tmp_path / "home"
    with pytest.raises(ImportFailed, match=f"part 2 of {len(split)} is missing .*"
                       f"{split[1].name}"):
        import_path(Library(home), folder / split[0].name)
    (folder / split[0].name).unlink()
    with pytest.raises(ImportFailed, match=f"part 1 of this split GGUF is missing "
                       f".{split[0].name}"):
        read_gguf(folder / split[2].name)
    # Through the command line: one line, non-zero exit, nothing in the library.
    done = run_strata("import", str(folder / split[2].name), home=home, timeout=120)
    assert done.returncode != 0
    assert "missing" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not list((home / "models").glob("*")) if (home / "models").exists() else True


def test_split_parts_that_disagree_on_the_tensor_count(tmp_path: Path,
                                                       split: list[Path]) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    for p in split:
        (folder / p.name).write_bytes(p.read_bytes())
    first = folder / split[0].name
    data = bytearray(first.read_bytes())
    key = b"split.tensors.count"
    at = data.index(key) + len(key)
    (vtype,) = struct.unpack_from("<I", data, at)
    fmt = {4: "<I", 5: "<i", 2: "<H", 3: "<h"}[vtype]
    (count,) = struct.unpack_from(fmt, data, at + 4)
    struct.pack_into(fmt, data, at + 4, count + 1)
    first.write_bytes(bytes(data))
    with pytest.raises(ImportFailed, match=f"hold {count} tensors, its metadata says "
                       f"{count + 1}"):
        read_gguf(first)


def test_a_vocabulary_that_disagrees_with_itself_or_the_embedding(
        tmp_path: Path, whole: Path, vocab: Vocab) -> None:
    short_types = rewrite(whole, tmp_path / "types.gguf",
                          change={"tokenizer.ggml.token_type": vocab.types[:-3]})[0]
    with pytest.raises(ImportFailed, match=f"{len(vocab.tokens)} tokens, "
                       f"{len(vocab.tokens) - 3} entries in tokenizer.ggml.token_type"):
        import_path(Library(tmp_path / "home"), short_types)
    fewer = rewrite(whole, tmp_path / "embd.gguf",
                    change={"tokenizer.ggml.tokens": vocab.tokens[:-1],
                            "tokenizer.ggml.token_type": vocab.types[:-1]})[0]
    with pytest.raises(ImportFailed, match=f"has {len(vocab.tokens) - 1} tokens but "
                       f"token_embd has {len(vocab.tokens)} rows"):
        import_path(Library(tmp_path / "home"), fewer)
    assert Library(tmp_path / "home").manifests() == []

"""Reading a GGUF file (llama.cpp's format): header, metadata and tensor index, in one pass.

Contract: `read_gguf(path)` parses the header of `path` (and of every other part of a split
GGUF, found by llama.cpp's `-NNNNN-of-NNNNN.gguf` names) and returns a `GGUFFile`: `meta`
(key -> Python value: numbers, str, bool, lists), `tensors` (in file order; each with `.name`,
`.shape` (GGUF order, ne0 first), `.tensor_type`, `.n_elements`, `.n_bytes`, `.data_offset` and
`.data`, a read-only memory map shaped like the `gguf` package's ReaderTensor.data) and
`architecture`. `on_architecture`, when given, is called with `general.architecture` as soon as
the header has been read and before any tensor is mapped, so that an unsupported file is
refused at once. Every count the header claims is checked against the bytes that remain before
anything is allocated for it; a file that lies (truncated, corrupt, a missing or disagreeing
split part, a tensor past the end, a vocabulary whose lists disagree) raises ImportFailed with
one line naming the file and the reason.

Why not `gguf.GGUFReader`: it builds a numpy array per field part, about 23 s for a
262,144-entry vocabulary on these machines; this reader takes well under a second.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ImportFailed

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2

# GGUF value types (gguf.GGUFValueType): fixed-size ones by struct code; 8 STRING, 9 ARRAY.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8",
          11: "i8", 12: "f8"}
_STRING, _ARRAY = 8, 9
_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# Tensor types that keep their element dtype in ReaderTensor.data (others: uint8 block rows).
_ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                   "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file, its bytes mapped on first use."""

    name: str
    shape: tuple[int, ...]  # GGUF order: ne0 (the contiguous row) first
    tensor_type: Any  # gguf.GGMLQuantizationType
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in `part`
    part: Path

    @cached_property
    def data(self) -> np.ndarray:
        """The stored values (float types) or block bytes (quantized types), read-only."""
        import gguf  # heavy (numpy-backed constants): only once a tensor is read

        mm = np.memmap(self.part, dtype=np.uint8, mode="r", offset=self.data_offset,
                       shape=(self.n_bytes,))
        dims = tuple(reversed(self.shape))
        dtype = _ELEMENT_DTYPES.get(self.tensor_type.name)
        if dtype is not None:
            return mm.view(dtype).reshape(dims)
        return mm.reshape(gguf.quants.quant_shape_to_byte_shape(dims, self.tensor_type))


@dataclass
class GGUFFile:
    """A GGUF file (all parts of a split one): metadata and tensor index."""

    path: Path
    version: int
    meta: dict[str, Any]
    tensors: list[GGUFTensor] = field(default_factory=list)
    parts: list[Path] = field(default_factory=list)

    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture", ""))


class _Header:
    """A bounds-checked cursor over one part's header bytes."""

    def __init__(self, path: Path, buf: mmap.mmap, size: int, order: str) -> None:
        self.path, self.buf, self.size, self.off = path, buf, size, 0
        self.order = order
        self.u32, self.u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")

    def fail(self, what: str) -> ImportFailed:
        return ImportFailed(f"{self.path}: corrupt or truncated GGUF header ({what})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.off + n > self.size:
            raise self.fail(f"{what} claims {n} bytes at offset {self.off}, file has "
                            f"{self.size}")

    def uint32(self, what: str) -> int:
        self.need(4, what)
        (v,) = self.u32.unpack_from(self.buf, self.off)
        self.off += 4
        return int(v)

    def uint64(self, what: str) -> int:
        self.need(8, what)
        (v,) = self.u64.unpack_from(self.buf, self.off)
        self.off += 8
        return int(v)

    def string(self, what: str) -> str:
        n = self.uint64(what)
        self.need(n, what)
        raw = self.buf[self.off:self.off + n]
        self.off += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ImportFailed(f"{self.path}: unreadable text in {what} ({exc.reason} at "
                               f"byte {exc.start})") from exc

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        code = _SCALARS.get(vtype)
        if code is not None:
            n = struct.calcsize(code)
            self.need(n, what)
            (v,) = struct.unpack_from(self.order + code, self.buf, self.off)
            self.off += n
            return v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
            itype = self.uint32(what)
            count = self.uint64(what)
            if itype in _NUMPY:
                width = np.dtype(_NUMPY[itype]).itemsize
                self.need(count * width, f"{what} ({count} items)")
                dtype = np.dtype(self.order + _NUMPY[itype])
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.off)
                self.off += count * width
                return arr.tolist()
            if itype == _STRING:
                self.need(count * 8, f"{what} ({count} items)")
                return self._strings(count, what)
            if itype == _ARRAY:
                self.need(count * 12, f"{what} ({count} items)")
                return [self.value(_ARRAY, what, depth + 1) for _ in range(count)]
            raise self.fail(f"{what}: unknown array item type {itype}")
        raise self.fail(f"{what}: unknown value type {vtype}")

    def _strings(self, count: int, what: str) -> list[str]:
        # The hot loop of a big vocabulary: locals only, one bounds check per item.
        buf, size, unpack, off = self.buf, self.size, self.u64.unpack_from, self.off
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                if off + 8 > size:
                    raise IndexError
                (n,) = unpack(buf, off)
                off += 8
                end = off + n
                if end > size:
                    raise IndexError
                append(buf[off:end].decode("utf-8"))
                off = end
        except IndexError:
            self.off = off
            raise self.fail(f"{what}: string {len(out)} of {count} runs past the end") from None
        except UnicodeDecodeError as exc:
            raise ImportFailed(f"{self.path}: unreadable text in {what}, item {len(out)} "
                               f"({exc.reason})") from exc
        self.off = off
        return out


def _read_part(path: Path, on_architecture: Callable[[str], None] | None = None
               ) -> tuple[int, dict[str, Any], list[GGUFTensor]]:
    """(version, metadata, tensors) of one GGUF file."""
    import gguf  # heavy (numpy-backed constants): only when a GGUF is opened

    if not path.exists():
        raise ImportFailed(f"{path}: no such file")
    if not path.is_file():
        raise ImportFailed(f"{path}: not a file")
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
        if magic != MAGIC:
            raise ImportFailed(f"{path}: not a GGUF file (bad magic {magic!r})")
        if size < 24:
            raise ImportFailed(f"{path}: truncated GGUF header ({size} bytes)")
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        (version,) = struct.unpack_from("<I", buf, 4)
        order = "<"
        if version & 0xFFFF == 0:  # written on a big-endian machine
            order, version = ">", struct.unpack_from(">I", buf, 4)[0]
        if version not in VERSIONS:
            raise ImportFailed(f"{path}: GGUF version {version} is not supported "
                               f"(supported: {', '.join(map(str, VERSIONS))})")
        h = _Header(path, buf, size, order)
        h.off = 8
        n_tensors = h.uint64("tensor count")
        n_kv = h.uint64("metadata count")
        h.need(n_kv * 13, f"{n_kv} metadata fields")
        meta: dict[str, Any] = {}
        for i in range(n_kv):
            key = h.string(f"metadata field {i}")
            what = f"metadata field {_label(key, i)}"
            vtype = h.uint32(what)
            meta[key] = h.value(vtype, what)
            if key == "general.architecture" and on_architecture is not None:
                on_architecture(str(meta[key]))
        h.need(n_tensors * 24, f"{n_tensors} tensors")
        infos = []
        names: set[str] = set()
        for i in range(n_tensors):
            name = h.string(f"tensor {i} name")
            what = f"tensor {_label(name, i)}"
            n_dims = h.uint32(what)
            if n_dims > MAX_DIMS:
                raise h.fail(f"{what} claims {n_dims} dimensions")
            dims = tuple(h.uint64(what) for _ in range(n_dims))
            ttype = h.uint32(what)
            offset = h.uint64(what)
            if name in names:
                raise ImportFailed(f"{path}: {what} appears twice")
            names.add(name)
            infos.append((_label(name, i), name, dims, ttype, offset))
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ImportFailed(f"{path}: general.alignment {alignment!r} is not a power of two")
        start = -(-h.off // alignment) * alignment
    finally:
        with contextlib.suppress(BufferError):  # a traceback may still hold an array view
            buf.close()
    tensors = []
    for label, name, dims, ttype, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(ttype)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as exc:
            raise ImportFailed(f"{path}: tensor {label} has unknown type {ttype}") from exc
        elems = 1
        for d in dims:
            elems *= d
        if not dims or (dims[0] % block) or elems > size * 8:
            raise ImportFailed(f"{path}: corrupt GGUF (tensor {label} has shape {list(dims)}, "
                               f"which does not fit type {qtype.name})")
        n_bytes = elems // block * type_size
        end = start + offset + n_bytes
        if end > size:
            raise ImportFailed(f"{path}: truncated: tensor {label} needs bytes up to {end}, "
                               f"file has {size}")
        tensors.append(GGUFTensor(name, dims, qtype, elems, n_bytes, start + offset, path))
    return int(version), meta, tensors


def _label(name: str, index: int) -> str:
    """A key or tensor name fit for a one-line message (a corrupt one: its index)."""
    return name if name.isprintable() and len(name) <= 120 else f"#{index}"


def split_parts(path: Path, meta: dict[str, Any]) -> list[Path]:
    """Every part of a split GGUF, in order (just `path` for a whole file)."""
    count = int(meta.get("split.count", 1) or 1)
    if count <= 1:
        return [path]
    m = _SPLIT_NAME.match(path.name)
    if m is None or int(m["count"]) != count:
        raise ImportFailed(f"{path}: part of a {count}-part split GGUF, but its name does not "
                           f"say which (expected NAME-{1:05d}-of-{count:05d}.gguf)")
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


def read_gguf(path: Path, on_architecture: Callable[[str], None] | None = None) -> GGUFFile:
    """Parse a GGUF file (every part, if split); see the module docstring."""
    path = Path(path)
    version, meta, tensors = _read_part(path, on_architecture)
    parts = split_parts(path, meta)
    if len(parts) > 1:
        first = parts[0]
        if first != path:  # the user gave a later part: metadata lives in the first
            if not first.is_file():
                raise ImportFailed(f"{path}: part 1 of this split GGUF is missing "
                                   f"({first.name})")
            version, meta, tensors = _read_part(first, on_architecture)
        for i, part in enumerate(parts[1:], start=2):
            if not part.is_file():
                raise ImportFailed(f"{first}: split GGUF part {i} of {len(parts)} is missing "
                                   f"({part.name})")
            _, part_meta, part_tensors = _read_part(part)
            if int(part_meta.get("split.no", -1)) != i - 1:
                raise ImportFailed(f"{part}: says it is split part "
                                   f"{int(part_meta.get('split.no', -1)) + 1}, expected {i}")
            tensors.extend(part_tensors)
        want = int(meta.get("split.tensors.count", len(tensors)))
        if want != len(tensors):
            raise ImportFailed(f"{first}: the split GGUF's parts hold {len(tensors)} tensors, "
                               f"its metadata says {want}")
        seen: set[str] = set()
        for t in tensors:
            if t.name in seen:
                raise ImportFailed(f"{first}: tensor {t.name} appears in two split parts")
            seen.add(t.name)
        path = first
    check_vocabulary(path, meta, tensors)
    return GGUFFile(path, version, meta, tensors, parts)


def check_vocabulary(path: Path, meta: dict[str, Any], tensors: list[GGUFTensor]) -> None:
    """The vocabulary's lists agree with each other and with the embedding's rows."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens[:16]):
        raise ImportFailed(f"{path}: tokenizer.ggml.tokens is not a list of strings")
    n = len(tokens)
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        values = meta.get(key)
        if values is not None and (not isinstance(values, list) or len(values) != n):
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise ImportFailed(f"{path}: vocabulary disagrees with itself ({n} tokens, "
                               f"{got} entries in {key})")
    for t in tensors:
        if t.name == "token_embd.weight" and len(t.shape) == 2 and t.shape[1] != n:
            raise ImportFailed(f"{path}: the vocabulary has {n} tokens but token_embd has "
                               f"{t.shape[1]} rows")

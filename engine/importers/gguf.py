"""GGUF (llama.cpp) files to an MLX-format folder that mlx_lm.load can open.

Contract: `import_gguf(path, dest, progress, cancel)` validates the file (magic, version,
truncation, architecture, tensor types) before writing anything, then writes config.json,
model*.safetensors and tokenizer files into `dest` (a temporary folder owned by the library).
Q4_0, Q4_1 and Q8_0 are repacked exactly into MLX affine triples (group 32); K-quants and
Q5 types are dequantized with the `gguf` package and requantized at the nearest MLX width;
F32/F16/BF16 stay as they are. Llama Q/K rows are un-permuted to the Hugging Face layout.
`model_config(path)` is the Hugging Face-style config a file describes, from its metadata alone
(no tensor read); a malformed file is an ImportFailed from either.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import Cancelled, ImportFailed
from engine.importers import (
    gguf_arch,
    gguf_moe,  # noqa: F401  (registers the mixture-of-experts families)
)
from engine.importers.gguf_arch import Arch, arch_for, hf_name
from engine.importers.gguf_types import GROUP, SUPPORTED_TYPES, convert_tensor
from engine.importers.vocab import write_tokenizer
from engine.library.manifest import weight_class
from engine.telemetry import CancelFlag, Progress

SHARD_BYTES = 2 << 30

@dataclass
class GGUFImport:
    """What an import produced, for the manifest."""

    config: dict[str, Any]
    tensor_formats: dict[str, set[str]] = field(default_factory=dict)
    params: int = 0
    stored_bits: int = 0
    tokenizer: dict[str, Any] = field(default_factory=dict)


# -- header bounds --------------------------------------------------------------------------
# GGUF value types (gguf.GGUFValueType) by fixed size; 8 is STRING, 9 is ARRAY.
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ARRAY_DEPTH = 2


def check_header(path: Path) -> None:
    """Walk the GGUF header with every count checked against the bytes that remain.

    The `gguf` reader trusts the counts a header claims: an array that claims more items
    than the file holds makes it loop (and allocate) without end, and deep nesting
    overflows its recursion. This walk costs at most one step per 8 bytes of header and
    allocates nothing in proportion to a claimed count; ImportFailed names the first lie.
    """
    import mmap
    import struct

    import gguf  # heavy (numpy-backed reader): only when a GGUF is opened

    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if size < 24:
            raise ImportFailed(f"{path}: truncated GGUF header ({size} bytes)")
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        (version,) = struct.unpack_from("<I", buf, 4)
        order = ">" if version & 0xFFFF == 0 else "<"
        u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
        off = 8

        def need(n: int, what: str) -> None:
            if n < 0 or off + n > size:
                raise ImportFailed(f"{path}: corrupt or truncated GGUF header ({what} claims "
                                   f"{n} bytes at offset {off}, file has {size})")

        def string(what: str) -> None:
            nonlocal off
            need(8, what)
            (n,) = u64.unpack_from(buf, off)
            off += 8
            need(n, what)
            off += n

        def value(vtype: int, what: str, depth: int) -> None:
            nonlocal off
            if vtype in _VALUE_SIZES:
                need(_VALUE_SIZES[vtype], what)
                off += _VALUE_SIZES[vtype]
            elif vtype == _STRING:
                string(what)
            elif vtype == _ARRAY:
                if depth >= _MAX_ARRAY_DEPTH:
                    raise ImportFailed(f"{path}: corrupt GGUF header ({what}: arrays nested "
                                       f"deeper than {_MAX_ARRAY_DEPTH})")
                need(12, what)
                (itype,), (count,) = u32.unpack_from(buf, off), u64.unpack_from(buf, off + 4)
                off += 12
                least = _VALUE_SIZES.get(itype, 8 if itype == _STRING else 12)
                if itype not in _VALUE_SIZES and itype not in (_STRING, _ARRAY):
                    raise ImportFailed(f"{path}: corrupt GGUF header ({what}: unknown "
                                       f"array item type {itype})")
                need(count * least, f"{what} ({count} items)")
                if itype in _VALUE_SIZES:
                    off += count * least
                else:
                    for _ in range(count):
                        value(itype, what, depth + 1)
            else:
                raise ImportFailed(f"{path}: corrupt GGUF header ({what}: unknown value "
                                   f"type {vtype})")

        need(16, "counts")
        (n_tensors,), (n_kv,) = u64.unpack_from(buf, off), u64.unpack_from(buf, off + 8)
        off += 16
        need(n_kv * 13, f"{n_kv} metadata fields")
        for i in range(n_kv):
            string(f"metadata field {i}")
            need(4, f"metadata field {i}")
            (vtype,) = u32.unpack_from(buf, off)
            off += 4
            value(vtype, f"metadata field {i}", 0)
        need(n_tensors * 24, f"{n_tensors} tensors")
        for i in range(n_tensors):
            string(f"tensor {i} name")
            need(4, f"tensor {i}")
            (n_dims,) = u32.unpack_from(buf, off)
            off += 4
            if n_dims > _MAX_DIMS:
                raise ImportFailed(f"{path}: corrupt GGUF header (tensor {i} claims "
                                   f"{n_dims} dimensions)")
            need(8 * n_dims + 12, f"tensor {i}")
            dims = [u64.unpack_from(buf, off + 8 * d)[0] for d in range(n_dims)]
            off += 8 * n_dims
            (ttype,) = u32.unpack_from(buf, off)
            off += 12
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
            except (ValueError, KeyError) as exc:
                raise ImportFailed(f"{path}: corrupt GGUF header (tensor {i} has unknown "
                                   f"type {ttype})") from exc
            elems = 1
            for d in dims:
                elems *= d
            if elems % block or elems // block * type_size > size:
                raise ImportFailed(f"{path}: corrupt or truncated GGUF (tensor {i} claims "
                                   f"{elems} elements of type {ttype}, file has {size} bytes)")
    finally:
        buf.close()


def read_metadata(path: Path) -> tuple[Any, dict[str, Any]]:
    """Open a GGUF with the `gguf` reader and check it is whole; (reader, metadata dict)."""
    if not path.exists():
        raise ImportFailed(f"{path}: no such file")
    if not path.is_file():
        raise ImportFailed(f"{path}: not a file")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ImportFailed(f"{path}: not a GGUF file (bad magic {magic!r})")
    check_header(path)
    import gguf  # heavy (numpy-backed reader): only when a GGUF is opened

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, MemoryError) as exc:
        raise ImportFailed(f"{path}: corrupt or truncated GGUF ({exc})") from exc
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = fld.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise ImportFailed(f"{path}: unreadable metadata field {key} ({exc})") from exc
    size = os.path.getsize(path)
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ImportFailed(
                f"{path}: truncated: tensor {t.name} needs bytes up to {end}, file has {size}"
            )
    return reader, meta


def model_config(path: Path) -> dict[str, Any]:
    """The config a GGUF file describes (see arch_config), from its metadata: no tensor read."""
    with _malformed(path):
        reader, meta = read_metadata(path)
        return arch_config(path, meta, reader)[1]


def arch_config(path: Path, meta: dict[str, Any], reader: Any) -> tuple[Arch, dict[str, Any]]:
    """The file's architecture and the config.json mlx-lm's ModelArgs read."""
    by_name = {t.name: t for t in reader.tensors}
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    arch, m = arch_for(path, meta, shapes,
                       lambda name: np.asarray(by_name[name].data, dtype=np.float32))
    return arch, gguf_arch.model_config(arch, m)


def import_gguf(
    path: Path,
    dest: Path,
    progress: Progress | None = None,
    cancel: CancelFlag | None = None,
) -> GGUFImport:
    """Convert a GGUF file into `dest`. See the module docstring."""
    with _malformed(path):
        return _convert(path, dest, progress, cancel)


@contextlib.contextmanager
def _malformed(path: Path) -> Iterator[None]:
    """Metadata of the wrong type or shapes that do not add up: ImportFailed, one line."""
    try:
        yield
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, OverflowError
            ) as exc:
        text = " ".join(str(exc).split())[:200]
        raise ImportFailed(f"{path}: malformed GGUF ({type(exc).__name__}: {text})") from exc


def _convert(
    path: Path,
    dest: Path,
    progress: Progress | None,
    cancel: CancelFlag | None,
) -> GGUFImport:
    import mlx.core as mx  # heavy: only while converting

    reader, meta = read_metadata(path)
    arch, config = arch_config(path, meta, reader)
    if not reader.tensors:
        raise ImportFailed(f"{path}: no tensors")
    plan = []
    for t in reader.tensors:
        if t.name in arch.skip:
            continue
        hf = hf_name(arch, t.name)
        if hf is None:
            raise ImportFailed(f"{path}: unexpected tensor {t.name} for {config['model_type']}")
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise ImportFailed(
                f"{path}: unsupported tensor type {qtype} in {t.name} "
                f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})"
            )
        plan.append((t, hf, qtype))

    result = GGUFImport(config=config)
    meta["context_length"] = config["max_position_embeddings"]
    result.tokenizer = write_tokenizer(meta, dest)
    quant: dict[str, Any] = {"group_size": GROUP, "bits": 4}
    shard: dict[str, Any] = {}
    shard_bytes = 0
    shards: list[dict[str, Any]] = []
    for i, (t, hf, qtype) in enumerate(plan):
        if cancel is not None and cancel():
            raise Cancelled("import")
        raw = np.asarray(t.data)
        for reverse in arch.reverse:
            raw = reverse(config, hf, raw)
        n = int(np.prod([int(x) for x in t.shape]))
        module = hf.rsplit(".", 1)[0]
        shape = tuple(reversed([int(x) for x in t.shape]))
        try:
            conv = convert_tensor(hf, raw, qtype, shape)
        except ImportFailed as exc:
            raise ImportFailed(f"{path}: {exc}") from exc
        arrays = conv.arrays
        fmt = conv.label
        if conv.quant is not None:
            quant[module] = conv.quant
        result.tensor_formats.setdefault(weight_class(hf), set()).add(fmt)
        result.params += n
        result.stored_bits += sum(a.nbytes for a in arrays.values()) * 8
        shard.update(arrays)
        shard_bytes += sum(a.nbytes for a in arrays.values())
        if shard_bytes >= SHARD_BYTES:
            shards.append(shard)
            shard, shard_bytes = {}, 0
        if progress is not None:
            progress(i + 1, len(plan))
    if shard:
        shards.append(shard)
    per_module = [v for v in quant.values() if isinstance(v, dict)]
    if per_module:
        bits_seen = [v["bits"] for v in per_module]
        quant["bits"] = max(set(bits_seen), key=bits_seen.count)
        config["quantization"] = quant
        config["quantization_config"] = quant
    for k, arrays in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else (
            f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        mx.save_safetensors(str(dest / name), arrays, metadata={"format": "mlx"})
    return result

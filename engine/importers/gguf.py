"""GGUF (llama.cpp) files to an MLX-format folder that mlx_lm.load can open.

Contract: `import_gguf(path, dest, progress, cancel)` validates the file (magic, version,
truncation, split parts, architecture, tensor types) before writing anything, then writes
config.json, model*.safetensors and tokenizer files into `dest` (a temporary folder owned by
the library). The pieces: gguf_file reads the header (an unsupported architecture is refused
as soon as the header names it), gguf_arch/gguf_moe say what each architecture is in mlx-lm's
terms (names, value changes reversed, config), gguf_types converts each tensor type, vocab
writes the tokenizer. `model_config(path)` is the config a file describes, from its metadata
alone (no tensor read); a malformed file is an ImportFailed from either.
"""

from __future__ import annotations

import contextlib
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
from engine.importers.gguf_file import GGUFFile, read_gguf
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


def read_metadata(path: Path) -> tuple[GGUFFile, dict[str, Any]]:
    """Read a GGUF's header (every part, if split) and check it is whole; (file, metadata).

    An architecture Strata cannot run is refused as soon as the header names it, before the
    vocabulary and tensor index are read."""
    def supported(name: str) -> None:
        if name not in gguf_arch.ARCHS:
            raise ImportFailed(f"{path}: unsupported architecture {name!r} "
                               f"(supported: {', '.join(gguf_arch.supported())})")

    f = read_gguf(path, on_architecture=supported)
    return f, f.meta


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
    result.tokenizer = write_tokenizer(meta, dest, source=path)
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
        if qtype in ("F32", "F16"):
            # A reverse may reshape a float tensor (qwen2moe's 1-D shared-expert gate).
            shape = tuple(raw.shape)
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

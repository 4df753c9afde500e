"""Models already on this Mac: LM Studio's folder, Ollama's store, the Hugging Face cache.

Contract: `scan(roots=None)` lists what the other apps keep on disk, as `Found` entries (app,
label, kind "gguf" | "mlx" | "hf", path, bytes, a suggested library name), reading only
directory listings, Ollama's JSON manifests and the first bytes of files; nothing is written.
`Roots.from_env()` says where it looks: LM Studio's ~/.lmstudio/models and
~/.cache/lm-studio/models (STRATA_LMSTUDIO_MODELS), Ollama's ~/.ollama/models (OLLAMA_MODELS,
STRATA_OLLAMA_MODELS) and the Hugging Face hub cache (HF_HUB_CACHE, HF_HOME/hub,
STRATA_HF_CACHE); each STRATA_ variable is a list of folders (os.pathsep between them).
`install_linked(library, folder, name, source)` adds an MLX folder to the library without a
second copy of its weights where the file system allows: each *.safetensors is placed by
`place(src, dest)`: a copy-on-write clone (FICLONE on Linux, clonefile on macOS), else a hard
link (same file system), else a symbolic link (a reference: the library records the external
path, and the model breaks if the other app deletes it). The small files (config, tokenizer)
are copied. The manifest says which was used (`placement`) and where it came from
(`found_in`, `external_path`); its fields are read from the safetensors headers, as an import
reads them from the arrays. A GGUF cannot be run in place (the library holds MLX folders): the
caller converts it with the importers. Floor 1: file-system logic only, no MLX.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import math
import os
import re
import shutil
import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ImportFailed
from engine.library.manifest import manifest_fields, weight_stats
from engine.library.store import Library, Manifest, check_name, clean_name

LM_STUDIO, OLLAMA, HF_CACHE = "LM Studio", "Ollama", "Hugging Face cache"
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
PLACEMENTS = ("clone", "hardlink", "reference")
# Files of a model folder copied beside the linked weights (small: configs and tokenizers).
_SMALL_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
_SMALL_LIMIT = 64 << 20
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                       "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
                       "BOOL": "bool"}


# -- where to look --------------------------------------------------------------------------
def _paths(var: str, defaults: list[Path]) -> list[Path]:
    value = os.environ.get(var)
    if value:
        return [Path(p).expanduser() for p in value.split(os.pathsep) if p]
    return defaults


@dataclass(frozen=True)
class Roots:
    """The folders `scan` reads, one list per app."""

    lmstudio: list[Path] = field(default_factory=list)
    ollama: list[Path] = field(default_factory=list)
    hf_cache: list[Path] = field(default_factory=list)

    @classmethod
    def from_env(cls) -> Roots:
        home = Path.home()
        ollama = os.environ.get("OLLAMA_MODELS")
        hf_hub = os.environ.get("HF_HUB_CACHE")
        hf_home = os.environ.get("HF_HOME")
        hf_default = (Path(hf_hub) if hf_hub else Path(hf_home) / "hub" if hf_home
                      else home / ".cache" / "huggingface" / "hub")
        return cls(
            lmstudio=_paths("STRATA_LMSTUDIO_MODELS", [home / ".lmstudio" / "models",
                                                       home / ".cache" / "lm-studio" / "models"]),
            ollama=_paths("STRATA_OLLAMA_MODELS",
                          [Path(ollama) if ollama else home / ".ollama" / "models"]),
            hf_cache=_paths("STRATA_HF_CACHE", [hf_default]),
        )


@dataclass(frozen=True)
class Found:
    """One model another app keeps on disk."""

    app: str  # LM_STUDIO, OLLAMA or HF_CACHE
    label: str  # how that app names it: publisher/repo/file.gguf, llama3.2:3b, owner/name
    kind: str  # "gguf", "mlx" (runs as it is) or "hf" (float weights: quantized at import)
    path: Path  # the .gguf file (an Ollama blob) or the folder
    bytes: int
    name: str  # a library name for it

    @property
    def linkable(self) -> bool:
        """Whether it can join the library without a second copy (an MLX folder)."""
        return self.kind == "mlx"


# -- scanning -------------------------------------------------------------------------------
def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def _size(path: Path) -> int:
    with contextlib.suppress(OSError):
        if path.is_file():
            return path.stat().st_size
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return 0


def _folder_kind(folder: Path) -> str | None:
    """'mlx' or 'hf' for a folder with config.json and safetensors weights, else None."""
    config = folder / "config.json"
    if not config.is_file() or not any(folder.glob("*.safetensors")):
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return "mlx" if "quantization" in data else "hf"


def _main_ggufs(folder: Path) -> list[Path]:
    """A folder's model GGUFs: vision projectors (mmproj) and later split parts left out."""
    out = []
    for f in sorted(folder.glob("*.gguf")):
        low = f.name.lower()
        if low.startswith("mmproj") or "-mmproj" in low:
            continue
        if "-of-" in low and not low.rsplit("-of-", 1)[0].endswith("-00001"):
            continue
        if _is_gguf(f):
            out.append(f)
    return out


def _gguf_name(f: Path) -> str:
    return clean_name(re.sub(r"-\d{5}-of-\d{5}$", "", f.stem))


def _scan_lmstudio(root: Path) -> Iterator[Found]:
    """models/<publisher>/<repo>/ holding .gguf files or an MLX folder."""
    for publisher in sorted(p for p in root.iterdir() if p.is_dir()):
        for repo in sorted(p for p in publisher.iterdir() if p.is_dir()):
            kind = _folder_kind(repo)
            label = f"{publisher.name}/{repo.name}"
            if kind is not None:
                yield Found(LM_STUDIO, label, kind, repo, _size(repo), clean_name(repo.name))
            for f in _main_ggufs(repo):
                yield Found(LM_STUDIO, f"{label}/{f.name}", "gguf", f, _size(f), _gguf_name(f))


def _scan_ollama(root: Path) -> Iterator[Found]:
    """manifests/<registry>/<namespace>/<model>/<tag>: JSON whose model layer names a blob."""
    manifests = root / "manifests"
    for tag_file in sorted(manifests.glob("*/*/*/*")):
        if not tag_file.is_file():
            continue
        registry, namespace, model, tag = tag_file.relative_to(manifests).parts
        try:
            data = json.loads(tag_file.read_text())
            layers = data["layers"]
            digest = next(str(layer["digest"]) for layer in layers
                          if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
        except (OSError, ValueError, KeyError, TypeError, StopIteration):
            continue  # not a model manifest (or one Ollama itself would not read)
        blob = root / "blobs" / digest.replace(":", "-")
        if not _is_gguf(blob):
            continue
        label = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
        if registry != "registry.ollama.ai":
            label = f"{registry}/{label}"
        yield Found(OLLAMA, label, "gguf", blob, _size(blob), clean_name(f"{model}-{tag}"))


def _snapshot(repo: Path) -> Path | None:
    """The snapshot refs/main names, else the newest one."""
    snapshots = repo / "snapshots"
    with contextlib.suppress(OSError):
        commit = (repo / "refs" / "main").read_text().strip()
        if commit and (snapshots / commit).is_dir():
            return snapshots / commit
    found = [s for s in snapshots.iterdir() if s.is_dir()] if snapshots.is_dir() else []
    return max(found, key=lambda s: s.stat().st_mtime) if found else None


def _scan_hf_cache(root: Path) -> Iterator[Found]:
    """models--<owner>--<name>/snapshots/<commit>/: a model folder, or GGUF files."""
    for repo in sorted(root.glob("models--*")):
        snap = _snapshot(repo) if repo.is_dir() else None
        if snap is None:
            continue
        parts = repo.name.split("--")
        label = "/".join(parts[1:])
        kind = _folder_kind(snap)
        if kind is not None:
            yield Found(HF_CACHE, label, kind, snap, _size(snap), clean_name(parts[-1]))
        for f in _main_ggufs(snap):
            yield Found(HF_CACHE, f"{label}/{f.name}", "gguf", f, _size(f), _gguf_name(f))


def scan(roots: Roots | None = None) -> list[Found]:
    """Every model found under `roots` (default Roots.from_env()); unreadable folders skipped."""
    roots = roots or Roots.from_env()
    out: list[Found] = []
    for paths, scanner in ((roots.lmstudio, _scan_lmstudio), (roots.ollama, _scan_ollama),
                           (roots.hf_cache, _scan_hf_cache)):
        for root in paths:
            with contextlib.suppress(OSError):  # a folder that vanished or is not ours to read
                if root.is_dir():
                    out.extend(scanner(root))
    return out


def added(found: Found, manifests: list[Manifest]) -> str | None:
    """The library model that came from `found` (its external path), if any."""
    where = str(found.path.resolve())
    for m in manifests:
        if where in (m.get("external_path"), m.get("source")):
            return str(m["name"])
    return None


# -- placing files without copying them -----------------------------------------------------
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def _clone(src: Path, dest: Path) -> bool:
    """A copy-on-write clone of `src` at `dest` (shares blocks until either is written)."""
    if sys.platform == "darwin":
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.clonefile(os.fsencode(src), os.fsencode(dest), 0) == 0:
                return True
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(src, "rb") as s, open(dest, "xb") as d:
            fcntl.ioctl(d.fileno(), _FICLONE, s.fileno())
        return True
    except OSError:
        with contextlib.suppress(OSError):
            dest.unlink()
        return False


def place(src: Path, dest: Path) -> str:
    """Put `src` at `dest` without copying its bytes: 'clone', 'hardlink' or 'reference'."""
    src = src.resolve()  # the Hugging Face cache's snapshot files are links to its blobs
    if _clone(src, dest):
        return "clone"
    try:
        os.link(src, dest)
        return "hardlink"
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP,
                             errno.EACCES):
            raise
    os.symlink(src, dest)
    return "reference"


# -- the manifest from safetensors headers --------------------------------------------------
@dataclass(frozen=True)
class _Header:
    """What weight_stats reads of an array: its size, bytes and dtype."""

    size: int
    nbytes: int
    dtype: str


def safetensors_headers(files: list[Path]) -> dict[str, _Header]:
    """name -> (elements, bytes, dtype) of every tensor in `files`, from their JSON headers."""
    out: dict[str, _Header] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > 100 << 20:
                    raise ValueError(f"header of {size} bytes")
                header = json.loads(fh.read(size))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                out[name] = _Header(math.prod(int(x) for x in info["shape"]),
                                    int(end) - int(start),
                                    _SAFETENSORS_DTYPES.get(str(info["dtype"]),
                                                            str(info["dtype"]).lower()))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise ImportFailed(f"{f}: unreadable safetensors header ({exc})") from exc
    return out


def safetensors_items(folder: Path) -> dict[str, tuple[int, int, str]]:
    """name -> (elements, bytes, dtype) of every tensor of a folder's *.safetensors, from their
    JSON headers; ImportFailed for one that has none."""
    return {name: (h.size, h.nbytes, h.dtype) for name, h in
            safetensors_headers(sorted(folder.glob("*.safetensors"))).items()}


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ImportFailed(f"{index}: unreadable ({exc})") from exc
        if any(Path(n).name != n for n in names):
            raise ImportFailed(f"{index}: names weight files outside the folder")
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def install_linked(library: Library, folder: Path, name: str, source: str | None = None,
                   found_in: str = "", aliases: list[str] | None = None) -> Manifest:
    """Add MLX folder `folder` to the library, its weights placed (see `place`), not copied.

    The caller checks the model first (engine.importers.open_source: architecture, config);
    here the folder must hold config.json with a quantization entry, a tokenizer and every
    weight file, or ImportFailed says which is missing. Atomic (Library.install)."""
    folder = folder.resolve()
    name = check_name(name)
    if _folder_kind(folder) != "mlx":
        raise ImportFailed(f"{folder}: not an MLX model folder (config.json with a "
                           "quantization entry, and *.safetensors)")
    if not ((folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()):
        raise ImportFailed(f"{folder}: no tokenizer (tokenizer.json or tokenizer.model)")
    weights = _weight_files(folder)
    missing = [f.name for f in weights if not f.is_file()]
    if missing:
        raise ImportFailed(f"{folder}: weight files missing ({', '.join(missing[:3])})")
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    headers = safetensors_headers(weights)
    tokenizer = ({"tokenizer": "tokenizers"} if (folder / "tokenizer.json").is_file()
                 else {"tokenizer": "sentencepiece"})

    def build(tmp: Path) -> Manifest:
        how = set()
        for f in weights:
            how.add(place(f, tmp / f.name))
        for f in sorted(folder.iterdir()):
            if (f.is_file() and f.suffix in _SMALL_SUFFIXES and f.name != "manifest.json"
                    and f.stat().st_size <= _SMALL_LIMIT):
                shutil.copyfile(f, tmp / f.name)
        formats, bpw, params = weight_stats(headers, config)
        manifest = manifest_fields(config, "mlx", source or str(folder), formats, bpw, params,
                                   tokenizer)
        # One word for the folder: the weakest placement any weight file got.
        placement = max(how, key=PLACEMENTS.index) if how else "reference"
        manifest.update(placement=placement, external_path=str(folder), found_in=found_in)
        return manifest

    return library.install(name, build, aliases=aliases)


def placement_text(manifest: Mapping[str, Any]) -> str:
    """How a model's weights sit in the library, in words for its details pane."""
    where = manifest.get("found_in") or "its folder"
    return {
        "clone": f"a copy-on-write clone of {where}'s files: no second copy on disk",
        "hardlink": f"hard links to {where}'s files: no second copy on disk",
        "reference": f"a reference to {where}'s files (kept there; deleting them there breaks "
                     "this model)",
        "converted": f"converted from {where}'s GGUF into MLX weights: a second copy",
    }.get(str(manifest.get("placement") or ""), "")

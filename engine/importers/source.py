"""Open a model source as a typed object, its weights read only on demand.

Contract: `open_source(where, library=None)` opens a .gguf file (or a folder holding exactly one),
a Hugging Face or MLX folder, or, given the library, a library model by name or alias, as a
`Source`: its kind, absolute path, model config (a GGUF's built from its metadata) and a label.
It reads no weight; a source that cannot be imported or quantized is a StrataError with one
line that names it. `Source.float_weights(progress, cancel)` reads the weights expanded to
float32 (quantized ones dequantized exactly) as MLX arrays named as mlx-lm's model class names
its parameters, with the folder that holds the tokenizer files (a GGUF is converted into a
temporary folder first, which `FloatWeights.close()` removes). `Source.weight_sizes()` and
`Source.preflight(profile, context)` say, from the config and the weights' sizes alone (a GGUF's
tensor table, safetensors headers: no tensor is read), whether the model would fit in this
machine's memory once imported and loaded (engine.runtime.fit.Fit). A Source is plain data:
`to_job()` writes it as JSON that `reopen` turns back into one, so a calibrated quantization
reopens it in a child process. engine.quant.source says what quantization needs of a source;
this class is one, structurally.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ImportFailed, LoadFailed, StrataError
from engine.importers.gguf import import_gguf, model_config, read_metadata
from engine.importers.gguf_types import PLANS, Plan
from engine.importers.hf import (
    DEFAULT_RECIPE,
    TOKENIZER_FILES,
    check_config,
    read_folder,
)
from engine.library.found import safetensors_items
from engine.library.store import MANIFEST, Library, clean_name
from engine.platform import ComputeProfile
from engine.runtime.fit import Fit, WeightSizes, estimate
from engine.runtime.model import apply_profile, load_weights_into_model, read_config
from engine.telemetry import CancelFlag, Progress

KINDS = ("gguf", "hf", "mlx", "library")
GGUF_FLOATS = ("F32", "F16", "BF16", "F64")  # GGUF tensor types kept as floats
# Every stored weight dequantized (exactly, for affine and GGUF Q4_0/Q4_1/Q8_0) into float32.
EXPAND = ComputeProfile("expand-f32", dequantize=True, dtype="float32")
# Files of a model folder that are not the tokenizer's (the weights are *.safetensors).
_NOT_TOKENIZER = {MANIFEST, "config.json", "recipe.toml"}


def detect(path: Path) -> str:
    """'gguf', 'mlx' or 'hf' for a path that holds a model; ImportFailed otherwise."""
    if not path.exists():
        raise ImportFailed(f"{path}: no such file or folder")
    if path.is_file():
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic == b"GGUF":
            return "gguf"
        raise ImportFailed(f"{path}: not a model file (expected GGUF, found {magic!r})")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf"
        raise ImportFailed(f"{path}: not a model folder (no config.json)")
    if not list(path.glob("*.safetensors")):
        raise ImportFailed(f"{path}: folder has no weights (*.safetensors)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ImportFailed(f"{path / 'config.json'}: unreadable ({exc})") from exc
    if not isinstance(config, dict):
        raise ImportFailed(f"{path / 'config.json'}: not a JSON object")
    return "mlx" if "quantization" in config else "hf"


@dataclass
class FloatWeights:
    """A source's weights in float32, open until close()."""

    arrays: dict[str, Any]  # parameter path -> float32 MLX array (integer arrays as stored)
    config: dict[str, Any]
    folder: Path  # holds the tokenizer files (engine.runtime.tokenizer.Tokenizer.load reads it)
    tokenizer: dict[str, Any]  # the manifest's tokenizer entry
    tmp: Path | None = field(default=None, repr=False)  # removed by close()

    def tokenizer_files(self) -> list[Path]:
        """The folder's files a model made from these weights needs besides them and config."""
        return [f for f in sorted(self.folder.iterdir()) if f.is_file()
                and f.name not in _NOT_TOKENIZER and not f.name.endswith(".safetensors")
                and not f.name.startswith(".")]

    def close(self) -> None:
        self.arrays = {}
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


@dataclass(frozen=True)
class Source:
    """An opened model source (see the module docstring); no weight is read until asked."""

    kind: str  # one of KINDS
    path: Path  # absolute: the .gguf file, or the folder
    config: dict[str, Any]  # the model config, without reading weights
    label: str  # how a quantized model's manifest names where it came from

    def to_job(self) -> dict[str, Any]:
        """This source as plain JSON data for a child process, with the function that reopens
        it there (`reopen`, named so that the child's side never names this package)."""
        return {"reopen": f"{__name__}:reopen", "kind": self.kind, "path": str(self.path),
                "config": self.config, "label": self.label}

    @property
    def default_name(self) -> str:
        """The library name an import gives it: the file's stem (a split GGUF's without its
        -00001-of-00003 part), or the folder's name."""
        if self.kind == "gguf":
            return clean_name(re.sub(r"-\d{5}-of-\d{5}$", "", self.path.stem))
        return clean_name(self.path.resolve().name)

    def tokenizer_bytes(self) -> int:
        """Bytes of the tokenizer files a folder holds (a GGUF's are written at import: 0)."""
        if self.kind == "gguf":
            return 0
        return sum((self.path / n).stat().st_size for n in TOKENIZER_FILES
                   if (self.path / n).is_file())

    def default_option(self) -> dict[str, Any]:
        """What an import without a recipe does, for the import dialog's first entry:
        {"label", "description", "bits_per_weight", "bytes"} (None where not known before)."""
        if self.kind == "hf":
            r = DEFAULT_RECIPE
            return {"label": "importer default",
                    "description": f"{r['bits']}-bit g{r['group_size']}, embeddings and head "
                                   f"{r['high_bits']}-bit",
                    "bits_per_weight": None, "bytes": None}
        weights = [self.path] if self.path.is_file() else list(self.path.glob("*.safetensors"))
        return {"label": "as stored",
                "description": "the source's own quantization, repacked for MLX without "
                               "requantizing" if self.kind == "gguf"
                               else "the folder's weights, copied",
                "bits_per_weight": None, "bytes": sum(f.stat().st_size for f in weights)}

    def weight_sizes(self) -> WeightSizes:
        """The weights by how they are stored (engine.runtime.fit.WeightSizes), from the GGUF's
        tensor table or the safetensors headers; no tensor is read (and they are read once).
        A Hugging Face folder's are counted as the importer's default quantization stores
        them."""
        return self._sizes

    @functools.cached_property
    def _sizes(self) -> WeightSizes:
        if self.kind == "gguf":
            reader, _ = read_metadata(self.path)
            qp = qb = fp = kept = 0
            for t in reader.tensors:
                n = math.prod(int(x) for x in t.shape)
                qtype = getattr(t.tensor_type, "name", str(t.tensor_type))
                if qtype in GGUF_FLOATS:
                    fp += n
                else:
                    qp, qb = qp + n, qb + int(t.n_bytes)
                    kept += _packable(n, PLANS.get(qtype))
            return WeightSizes(qp, qb, fp, 0, kept)
        items = safetensors_items(self.path)
        if self.kind != "hf":
            return WeightSizes.from_items(self.config, items)
        # The importer's default: 2-D weights at its bits (embeddings and head at the higher
        # ones) with a float16 scale and bias per group, everything else in float16.
        r = DEFAULT_RECIPE
        qp = qb = fp = kept = 0
        for key, (n, _, _) in items.items():
            if key.endswith("rotary_emb.inv_freq"):
                continue  # an old checkpoint's RoPE buffer: mlx-lm's sanitize drops it
            quantizable = key.endswith(".weight") and n % (r["group_size"] * 8) == 0
            if quantizable and not key.endswith("norm.weight"):
                bits = r["high_bits"] if ("embed" in key or "lm_head" in key) else r["bits"]
                qp, qb = qp + n, qb + int(n * (bits + 32 / r["group_size"]) / 8)
                kept += _packable(n, Plan("affine", bits, r["group_size"], "requantize"))
            else:
                fp += n
        return WeightSizes(qp, qb, fp, 0, kept)

    def preflight(self, profile: ComputeProfile, context: int | None = None, *,
                  stored_bytes: int | None = None, kv_bits: int = 16,
                  kv_group: int | None = None, kv_ram_limit: int | None = None,
                  freed_bytes: int = 0) -> Fit:
        """Would this model fit once imported and loaded in `profile` at `context` (None: the
        chosen context, engine.runtime.fit.chosen_context)? `stored_bytes`: the size an import
        option (a recipe) would give the weights on disk; the rest as engine.runtime.fit's
        estimate takes them."""
        return estimate(self.config, self.weight_sizes(), profile, context,
                        stored_bytes=stored_bytes, kv_bits=kv_bits, kv_group=kv_group,
                        kv_ram_limit=kv_ram_limit, freed_bytes=freed_bytes)

    def float_weights(self, progress: Progress | None = None,
                      cancel: CancelFlag | None = None) -> FloatWeights:
        """Read every weight, expanded to float32; see the module docstring."""
        if self.kind == "gguf":
            tmp = Path(tempfile.mkdtemp(prefix="strata-quant-"))
            try:
                result = import_gguf(self.path, tmp, progress, cancel)
                (tmp / "config.json").write_text(json.dumps(result.config, indent=2))
                model, config = load_weights_into_model(tmp, EXPAND)
                return FloatWeights(_arrays(model), config, tmp, tokenizer_info(tmp), tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        if self.kind in ("library", "mlx"):
            model, config = load_weights_into_model(self.path, EXPAND)
            return FloatWeights(_arrays(model), config, self.path, tokenizer_info(self.path))
        config, model, _, _ = read_folder(self.path, "hf")
        # Expanded like every other kind: a checkpoint's packed layers (gpt-oss's MXFP4
        # experts) become float32, so its config no longer names them quantized.
        apply_profile(model, EXPAND)
        config = {k: v for k, v in config.items()
                  if k not in ("quantization", "quantization_config")}
        return FloatWeights(_arrays(model), config, self.path, tokenizer_info(self.path))


def open_source(where: str | Path, library: Library | None = None) -> Source:
    """Open `where` (with `library`: a library model's name or alias first); see the module."""
    if library is not None:
        m = library.find(str(where))
        if m is not None:
            folder = Path(m["path"]).absolute()
            return Source("library", folder, read_config(folder), str(folder))
    path = Path(where).expanduser().absolute()
    if library is not None and not path.exists():
        known = ", ".join(x["name"] for x in library.manifests()) or "none"
        raise StrataError(f"{str(where)!r} is neither a library model (have: {known}) "
                          "nor a file or folder")
    kind = detect(path)
    if kind == "gguf":
        if path.is_dir():
            path = sorted(path.glob("*.gguf"))[0]
        return Source(kind, path, model_config(path), f"{path} (GGUF, dequantized)")
    try:
        config = read_config(path)
    except LoadFailed as exc:
        raise ImportFailed(str(exc)) from exc
    if kind == "hf":
        check_config(config, str(path))
    return Source(kind, path, config, str(path))


def tokenizer_info(folder: Path) -> dict[str, Any]:
    """The manifest's tokenizer entry for a model folder: a library model's own, else by file."""
    try:
        info = json.loads((folder / MANIFEST).read_text()).get("tokenizer")
        if isinstance(info, dict):
            return info
    except (OSError, ValueError, AttributeError):
        pass
    if (folder / "tokenizer.json").is_file():
        return {"tokenizer": "tokenizers"}
    return {"tokenizer": "sentencepiece"}


def _arrays(model: Any) -> dict[str, Any]:
    from mlx.utils import tree_flatten  # heavy: MLX loads only when weights are read

    flat: Any = tree_flatten(model.parameters())
    return dict(flat)


def reopen(job: Mapping[str, Any]) -> Source:
    """The source `Source.to_job` described, in a child process (no weight is read)."""
    return Source(str(job["kind"]), Path(job["path"]), dict(job["config"]), str(job["label"]))


def _packable(n: int, plan: Plan | None) -> int:
    """What n weights stored as `plan` keep beside their float32 copy where decode steps read
    the codes (engine.runtime.fit.WeightSizes.packable_bytes): 4- and 8-bit affine codes, a
    float32 scale and bias per group."""
    if plan is None or plan.mode != "affine" or plan.bits not in (4, 8) or plan.group % 32:
        return 0
    return n * plan.bits // 8 + n // plan.group * 8

"""Quantize a model by recipe into a new library model.

Contract: `quantize(library, source, recipe, name, ...)` reads SOURCE (a library model, an MLX
or Hugging Face folder, or a GGUF file), expands its weights to float32 (dequantizing quantized
ones), quantizes every tensor as the recipe plans it (round to nearest in MLX's affine format,
float16 scales and biases, grid chosen per group by engine.quant.rounding) and installs the
result atomically with Library.install. The recipe, the name and the source are checked before
any weight is read; on any error nothing is written. `recipe="auto"` with `target_bpw`
measures sensitivities on calibration text first (engine.quant.sensitivity). The saved folder
holds recipe.toml, the recipe that made it. Progress is reported per chunk and per tensor; the
cancel flag is checked between them. `method="imatrix"` measures activation importance on
calibration text (engine.quant.importance) and rounds every covered tensor by the
importance-weighted grid search (engine.quant.rounding), in this process; with "auto" the
sensitivities are measured with that rounding too. gptq, awq and dwq calibrate the rounding with
mlx-lm's quant module on calibration text, in a child process (engine.quant.calibrated); the
method and recipe are checked together before any work starts.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import Cancelled, ImportFailed, StrataError
from engine.library.store import Library, Manifest, check_name
from engine.quant.recipes import (
    Format,
    Recipe,
    RecipeError,
    plan_model,
    plan_to_recipe,
    quantizable,
    resolve_recipe,
    tensor_class,
)

if TYPE_CHECKING:
    from engine.quant.importance import Importance

Progress = Callable[[int, int], None]
CancelFlag = Callable[[], bool]
_SKIP_FILES = {"manifest.json", "config.json", "recipe.toml"}


@dataclass
class FloatSource:
    """A source model expanded to float32, with where to copy its tokenizer files from."""

    model: Any
    config: dict[str, Any]
    folder: Path
    label: str
    tmp: Path | None = None

    def close(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def tokenizer_files(self) -> list[Path]:
        return [f for f in sorted(self.folder.iterdir()) if f.is_file()
                and f.name not in _SKIP_FILES and not f.name.endswith(".safetensors")
                and not f.name.startswith(".")]


def source_kind(library: Library, source: str) -> tuple[str, Path]:
    """('library' | 'mlx' | 'hf' | 'gguf', path); StrataError when SOURCE is none of them."""
    m = library.find(source)
    if m is not None:
        return "library", Path(m["path"])
    path = Path(source).expanduser()
    if not path.exists():
        known = ", ".join(x["name"] for x in library.manifests()) or "none"
        raise StrataError(f"{source!r} is neither a library model (have: {known}) "
                          "nor a file or folder")
    from engine.importers import detect

    kind = detect(path)
    if kind == "gguf" and path.is_dir():
        path = sorted(path.glob("*.gguf"))[0]
    return kind, path


def source_config(kind: str, path: Path) -> dict[str, Any]:
    """The model config of a source without reading its weights (GGUF: from its metadata)."""
    from engine.runtime.model import read_config

    if kind == "gguf":
        from engine.importers.gguf import _arch_config, read_metadata

        reader, meta = read_metadata(path)
        return _arch_config(path, meta, {t.name for t in reader.tensors})
    config = read_config(path)
    if kind == "hf":
        from engine.importers.hf import check_config

        check_config(config, str(path))
    return config


def _float_model(config: dict[str, Any]) -> Any:
    """An unquantized model skeleton for a config (no weights are materialised)."""
    from engine.runtime.model import build_model

    bare = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    return build_model(bare)


def load_float(kind: str, path: Path, progress: Progress | None = None,
               cancel: CancelFlag | None = None) -> FloatSource:
    """Read a source and expand every weight to float32."""
    import mlx.core as mx

    from engine.platform import ComputeProfile
    from engine.runtime.model import load_weights_into_model

    expand = ComputeProfile("expand-f32", dequantize=True, dtype="float32")
    if kind == "gguf":
        from engine.importers.gguf import import_gguf

        tmp = Path(tempfile.mkdtemp(prefix="strata-quant-"))
        try:
            result = import_gguf(path, tmp, progress, cancel)
            (tmp / "config.json").write_text(json.dumps(result.config, indent=2))
            model, config = load_weights_into_model(tmp, expand)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return FloatSource(model, config, tmp, f"{path} (GGUF, dequantized)", tmp)
    if kind in ("library", "mlx"):
        model, config = load_weights_into_model(path, expand)
        return FloatSource(model, config, path, str(path))
    # A Hugging Face folder: the importer's loader, kept in float32 without quantizing.
    from engine.importers.hf import INDEX_FILE, _check_tokenizer, select_weight_files
    from engine.runtime.model import build_model, read_config

    _check_tokenizer(path)
    config = read_config(path)
    weights: dict[str, Any] = {}

    index = path / INDEX_FILE
    for n in select_weight_files([f.name for f in path.glob("*.safetensors")],
                                 index.read_text() if index.is_file() else None):
        try:
            loaded: Any = mx.load(str(path / n))
        except (RuntimeError, ValueError) as exc:
            raise ImportFailed(f"{path / n}: unreadable safetensors") from exc
        weights.update(loaded)
    model = build_model(config)
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ImportFailed(f"{path}: weights do not match config.json ({exc})") from exc
    from mlx.utils import tree_map

    model.update(tree_map(lambda a: a.astype(mx.float32)
                          if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))
    return FloatSource(model, config, path, str(path))


# -- quantizing -----------------------------------------------------------------------------
def apply_plan(model: Any, plan: dict[str, Format], progress: Progress | None = None,
               cancel: CancelFlag | None = None, dtype: str = "float16",
               importance: Importance | None = None) -> None:
    """Quantize `model` in place as planned; every float parameter ends `dtype`.

    With `importance` (engine.quant.importance), tensors it covers are rounded by the
    importance-weighted grid search of engine.quant.rounding."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map

    def predicate(path: str, module: Any) -> bool | dict[str, Any]:
        f = plan.get(path)
        if f is None or not f.quantized:
            return False
        return {"bits": f.bits, "group_size": f.group_size}

    from engine.quant.rounding import affine_quantize

    modules = dict(model.named_modules())
    originals = {p: modules[p].weight for p, f in plan.items() if f.quantized}
    nn.quantize(model, class_predicate=predicate)
    # MLX's layers, with codes from engine.quant.rounding (the better of two grids per group).
    modules = dict(model.named_modules())
    for i, (path, w) in enumerate(originals.items()):
        if cancel is not None and cancel():
            raise Cancelled("quantize")
        if progress is not None:
            progress(i, len(originals))
        f = plan[path]
        mod = modules[path]
        imp = importance.get(path) if importance is not None else None
        mod.weight, mod.scales, mod.biases = affine_quantize(w, f.bits, f.group_size, imp)
        mx.eval(mod.weight, mod.scales, mod.biases)
    target = getattr(mx, dtype)
    model.update(tree_map(lambda a: a.astype(target)
                          if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters()))


def quantized_config(config: dict[str, Any], recipe: Recipe, plan: dict[str, Format]
                     ) -> dict[str, Any]:
    out = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    per_path = {p: {"group_size": f.group_size, "bits": f.bits}
                for p, f in plan.items() if f.quantized}
    if per_path:
        quant: dict[str, Any] = {"group_size": recipe.group_size,
                                 "bits": recipe.bits if recipe.bits != 16 else 8, **per_path}
        out["quantization"] = quant
        out["quantization_config"] = quant
    out["torch_dtype"] = "float16"
    return out


def class_summary(plan: dict[str, Format]) -> dict[str, dict[str, int]]:
    """Tensor class -> {format label: tensor count}: what the recipe did, for the manifest."""
    out: dict[str, dict[str, int]] = {}
    for path, f in plan.items():
        cls, _ = tensor_class(path)
        d = out.setdefault(cls, {})
        d[f.label()] = d.get(f.label(), 0) + 1
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


@dataclass
class Prepared:
    """A checked quantize job: recipe resolved, name free, source readable, plan valid."""

    kind: str
    path: Path
    recipe: Recipe | None  # None for "auto" (planned after measuring)
    config: dict[str, Any]
    name: str
    plan: dict[str, Format] | None = None  # None for "auto"


def prepare(library: Library, source: str, recipe_spec: str, name: str,
            target_bpw: float | None = None, replace: bool = False,
            calibration: Path | None = None, method: str = "rtn") -> Prepared:
    """Every check that needs no weights; raises StrataError with one line, writes nothing."""
    from engine.quant.calibrated import NEEDS_CALIBRATION, check_method

    check_method(method, {}, recipe_spec, None)  # an unknown method fails first
    if method in NEEDS_CALIBRATION:
        if calibration is None:
            raise RecipeError(f"method {method!r} needs calibration text (--calibration FILE)")
        if not Path(calibration).is_file():
            raise RecipeError(f"{calibration}: no such calibration text")
    recipe = None
    if recipe_spec == "auto":
        if target_bpw is None:
            raise RecipeError("recipe 'auto' needs a target: --bpw BITS (e.g. 3.6)")
        from engine.quant.sensitivity import check_target

        check_target(target_bpw)
        if calibration is None:
            raise RecipeError("recipe 'auto' needs calibration text (--calibration FILE)")
        if not Path(calibration).is_file():
            raise RecipeError(f"{calibration}: no such calibration text")
    else:
        if target_bpw is not None:
            raise RecipeError("--bpw applies only to --recipe auto")
        recipe = resolve_recipe(recipe_spec)
    check_name(name)
    if library.find(name) is not None and not replace:
        raise ImportFailed(f"a model named {name!r} is already in the library")
    kind, path = source_kind(library, source)
    config = source_config(kind, path)
    plan = None
    if recipe is not None:
        plan = plan_model(recipe, _float_model(config), config)  # raises if a rule matches none
    check_method(method, plan, recipe_spec if recipe is None else recipe.name,
                 config.get("model_type"))
    return Prepared(kind, path, recipe, config, name, plan)


def expected_sizes(library: Library, source: str, recipe_specs: list[str]
                   ) -> dict[str, tuple[float, int]]:
    """Recipe -> (bits per weight, bytes) that it would give SOURCE, from the shapes of the
    source's tensors (its config and model class; no weight is read). Bits per weight count
    every stored tensor (weights, scales, biases, float16 others) over the parameter count,
    as the manifest does. Bytes are those of the weights; a folder source's tokenizer files
    are added (a GGUF's are written at import from its metadata, and not counted)."""
    from mlx.utils import tree_flatten

    kind, path = source_kind(library, source)
    config = source_config(kind, path)
    model = _float_model(config)
    flat: Any = tree_flatten(model.parameters())
    sizes = [(key.rsplit(".", 1)[0], key.endswith(".weight"), int(arr.size)) for key, arr in flat]
    params = sum(n for _, _, n in sizes)
    extra = 0
    if kind != "gguf":
        from engine.importers.hf import TOKENIZER_FILES

        extra = sum((path / n).stat().st_size for n in TOKENIZER_FILES if (path / n).is_file())
    out = {}
    for spec in recipe_specs:
        plan = plan_model(resolve_recipe(spec), model, config)
        bits = 0.0
        for module, is_weight, n in sizes:
            f = plan.get(module)
            quantized = f is not None and f.quantized and is_weight
            bits += n * (f.bits_per_weight if quantized and f is not None else 16)
        out[spec] = (bits / max(params, 1), int(bits // 8) + extra)
    return out


def import_options(library: Library, path: Path) -> dict[str, Any]:
    """What an import of `path` can do, for the import dialog: {"kind", "options"}, each
    option {"recipe" (None: as stored), "label", "description", "bits_per_weight", "bytes"}.
    Sizes of recipes come from expected_sizes; recipes that cannot apply are left out."""
    from engine.importers import detect
    from engine.quant.recipes import builtin_names

    path = Path(path).expanduser()
    kind = detect(path)
    file = sorted(path.glob("*.gguf"))[0] if kind == "gguf" and path.is_dir() else path
    names = []
    for n in builtin_names():
        try:
            expected_sizes(library, str(file), [n])
            names.append(n)
        except RecipeError:
            continue  # a rule matches no tensor of this model
    sizes = expected_sizes(library, str(file), names)
    stored: dict[str, Any]
    if kind == "hf":
        from engine.importers.hf import DEFAULT_RECIPE

        stored = {"label": "importer default",
                  "description": f"{DEFAULT_RECIPE['bits']}-bit g{DEFAULT_RECIPE['group_size']}"
                                 f", embeddings and head {DEFAULT_RECIPE['high_bits']}-bit",
                  "bits_per_weight": None, "bytes": None}
    else:
        weights = [file] if file.is_file() else list(file.glob("*.safetensors"))
        stored = {"label": "as stored", "description": "the source's own quantization, "
                  "repacked for MLX without requantizing" if kind == "gguf"
                  else "the folder's weights, copied",
                  "bits_per_weight": None, "bytes": sum(f.stat().st_size for f in weights)}
    options: list[dict[str, Any]] = [{"recipe": None, **stored}]
    for n in names:
        bpw, size = sizes[n]
        options.append({"recipe": n, "label": n, "description": resolve_recipe(n).description,
                        "bits_per_weight": round(bpw, 3), "bytes": size})
    return {"kind": kind, "path": str(file), "options": options}


def quantize(
    library: Library,
    source: str,
    recipe_spec: str,
    name: str,
    target_bpw: float | None = None,
    calibration: Path | None = None,
    calibration_tokens: int = 2048,
    progress: Progress | None = None,
    cancel: CancelFlag | None = None,
    replace: bool = False,
    method: str = "rtn",
    in_child: bool = False,
) -> Manifest:
    """Quantize SOURCE by recipe into library model `name`. See the module docstring.

    A calibrated `method` runs in a child process (`in_child` is set there)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    job = prepare(library, source, recipe_spec, name, target_bpw, replace, calibration,
                  method)
    from engine.quant.calibrated import CALIBRATED, run_child

    if method in CALIBRATED and not in_child:
        # The child runs elsewhere (cwd): paths travel resolved.
        recipe_file = Path(recipe_spec).expanduser()
        spec = {"home": str(library.home.resolve()),
                "source": source if job.kind == "library" else str(job.path.resolve()),
                "recipe": str(recipe_file.resolve()) if recipe_file.is_file() else recipe_spec,
                "name": name, "target_bpw": target_bpw, "method": method,
                "calibration": str(Path(calibration).resolve()) if calibration else None,
                "calibration_tokens": calibration_tokens, "replace": replace}
        return run_child(library.home, spec, progress, cancel)
    cancel = cancel or (lambda: False)
    src = load_float(job.kind, job.path, None, cancel)
    try:
        if cancel():
            raise Cancelled("quantize")
        sens_info: dict[str, Any] = {}
        importance: Importance | None = None
        if method == "imatrix":
            from engine.quant.importance import activation_importance
            from engine.quant.sensitivity import calibration_tokens as read_tokens
            from engine.runtime.tokenizer import Tokenizer

            assert calibration is not None
            ids = read_tokens(Tokenizer.load(src.folder), calibration, calibration_tokens)
            importance = activation_importance(src.model, ids, progress=progress,
                                               cancel=cancel)
            sens_info.update(method=method, calibration=calibration.name,
                             calibration_tokens=len(ids))
        if job.recipe is None:
            from engine.quant.sensitivity import allocate, measure

            assert target_bpw is not None and calibration is not None
            from engine.runtime.tokenizer import Tokenizer

            tok = Tokenizer.load(src.folder)
            errors = measure(src.model, tok, calibration, calibration_tokens,
                             progress=progress, cancel=cancel, importance=importance)
            plan = allocate(errors, quantizable(src.model), target_bpw)
            recipe = plan_to_recipe(f"auto-{target_bpw:g}", plan,
                                    f"sensitivity-guided for {target_bpw:g} bits per weight, "
                                    f"calibrated on {calibration.name}")
            sens_info.update(target_bpw=target_bpw, calibration=calibration.name,
                             calibration_tokens=calibration_tokens)
        else:
            recipe = job.recipe
            plan = plan_model(recipe, src.model, src.config)
        if method in ("rtn", "imatrix"):
            apply_plan(src.model, plan, progress, cancel, importance=importance)
        else:
            from engine.quant.calibrated import apply_method, calibration_batches
            from engine.runtime.tokenizer import Tokenizer

            assert calibration is not None
            data = calibration_batches(Tokenizer.load(src.folder), calibration,
                                       calibration_tokens, method)
            apply_method(method, src.model, src.config, plan, data, progress, cancel)
            sens_info.update(method=method, calibration=calibration.name,
                             calibration_tokens=int(data.size))
        weights = dict(tree_flatten(src.model.parameters()))
        mx.eval(weights)
        config = quantized_config(src.config, recipe, plan)
        if cancel():
            raise Cancelled("quantize")

        def build(tmp: Path) -> Manifest:
            from engine.importers import manifest_fields
            from engine.importers.hf import _stats

            mx.save_safetensors(str(tmp / "model.safetensors"), weights,
                                metadata={"format": "mlx"})
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            (tmp / "recipe.toml").write_text(recipe.to_toml())
            for f in src.tokenizer_files():
                shutil.copy2(f, tmp / f.name)
            formats, bpw, params = _stats(weights, config)
            tokenizer = _tokenizer_info(src.folder)
            manifest = manifest_fields(config, "quantized", f"quantize:{src.label}", formats,
                                       bpw, params, tokenizer)
            manifest["recipe"] = {"name": recipe.name, "tensors": class_summary(plan),
                                  **sens_info}
            return manifest

        manifest = library.install(name, build, replace=replace)
    finally:
        src.close()
    if progress is not None:
        progress(1, 1)
    return manifest


def _tokenizer_info(folder: Path) -> dict[str, Any]:
    try:
        m = json.loads((folder / "manifest.json").read_text())
        info = m.get("tokenizer")
        if isinstance(info, dict):
            return info
    except (OSError, ValueError):
        pass
    if (folder / "tokenizer.json").is_file():
        return {"tokenizer": "tokenizers"}
    return {"tokenizer": "sentencepiece"}

"""Quantize a model by recipe into a new library model.

Contract: `quantize(library, source, recipe, name, ...)` takes a source the caller opened (a
QuantSource, engine.quant.source: engine.importers.open_source makes them from a library model,
an MLX or Hugging Face folder, or a GGUF file), reads its weights expanded to float32
(dequantizing quantized ones), quantizes every tensor as the recipe plans it (round to nearest
in MLX's affine format, float16 scales and biases, grid chosen per group by
engine.quant.rounding) and installs the result atomically with Library.install. The recipe and
the name are checked before any weight is read (the source's config was read when it was
opened); on any error or cancel nothing is written. `recipe="auto"` with `target_bpw` measures
sensitivities on calibration text first (engine.quant.sensitivity). The saved folder holds
recipe.toml, the recipe that made it. Progress is reported per chunk and per tensor; the cancel
flag is checked between them. `method="imatrix"` measures activation importance on calibration
text (engine.quant.importance) and rounds every covered tensor by the importance-weighted grid
search (engine.quant.rounding), in this process; with "auto" the sensitivities are measured
with that rounding too. gptq, awq and dwq calibrate the rounding with mlx-lm's quant module on
calibration text, in a child process (engine.quant.methods.run_child runs
engine.quant.calibrated, which calls `quantize` again with its `calibrate`); the method and
recipe are checked together before any work starts.

`Requantize(recipe, method, ...)` is that job as a value: `import_path(library, path,
requantize=Requantize("q4-g64"))` (engine.importers) is an import with a recipe, composed by the
caller. `expected_sizes(source, recipes)` and `import_options(source)` say what each recipe
would give, from the source's config alone, for the import dialog.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engine.errors import Cancelled, ImportFailed
from engine.library.manifest import manifest_fields, weight_stats
from engine.library.store import Library, Manifest, check_name
from engine.quant.importance import Importance, activation_importance
from engine.quant.methods import (
    CALIBRATED,
    NEEDS_CALIBRATION,
    check_method,
    encode_source,
    run_child,
)
from engine.quant.recipes import (
    Format,
    Recipe,
    RecipeError,
    builtin_names,
    plan_model,
    plan_to_recipe,
    quantizable,
    resolve_recipe,
    tensor_class,
)
from engine.quant.rounding import affine_quantize
from engine.quant.sensitivity import allocate, check_target, measure
from engine.quant.sensitivity import calibration_tokens as text_tokens
from engine.quant.source import FloatWeights, QuantSource
from engine.runtime.model import build_model
from engine.runtime.tokenizer import Tokenizer
from engine.telemetry import CancelFlag, Progress

AWQ_GRID = 20  # AWQ's search points: mlx-lm's default --n-grid


class Calibrate(Protocol):
    """The calibrated rounding (gptq, awq, dwq), given by the child process that runs it
    (engine.quant.calibrated.calibrate): quantizes `model` in place as `plan` says, on
    `n_tokens` tokens of `text`; returns the number of tokens it used."""

    def __call__(self, method: str, model: Any, config: dict[str, Any],
                 plan: dict[str, Format], tokenizer: Any, text: Path, n_tokens: int,
                 progress: Progress | None, cancel: CancelFlag | None, *,
                 awq_grid: int = ...) -> int: ...


def _float_model(config: dict[str, Any]) -> Any:
    """An unquantized model skeleton for a config (no weights are materialised)."""
    bare = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    return build_model(bare)


def float_model(weights: FloatWeights) -> Any:
    """The float32 mlx-lm model of a source's float weights (the arrays are shared, not copied)."""
    model = _float_model(weights.config)
    arrays = dict(weights.arrays)
    # mlx-lm's own renames and drops (gemma3's tied lm_head) before the strict load.
    arrays = model.sanitize(arrays) if hasattr(model, "sanitize") else arrays
    model.load_weights(list(arrays.items()), strict=True)
    model.eval()
    return model


# -- quantizing -----------------------------------------------------------------------------
def apply_plan(model: Any, plan: dict[str, Format], progress: Progress | None = None,
               cancel: CancelFlag | None = None, dtype: str = "float16",
               importance: Importance | None = None) -> None:
    """Quantize `model` in place as planned; every float parameter ends `dtype`.

    With `importance` (engine.quant.importance), tensors it covers are rounded by the
    importance-weighted grid search of engine.quant.rounding."""
    import mlx.core as mx  # heavy: MLX loads only when weights are quantized
    import mlx.nn as nn
    from mlx.utils import tree_map

    def predicate(path: str, module: Any) -> bool | dict[str, Any]:
        f = plan.get(path)
        if f is None or not f.quantized:
            return False
        return {"bits": f.bits, "group_size": f.group_size}

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
    """A checked quantize job: recipe resolved, name free, plan valid for the source."""

    recipe: Recipe | None  # None for "auto" (planned after measuring)
    config: dict[str, Any]
    name: str
    plan: dict[str, Format] | None = None  # None for "auto"


def prepare(library: Library, source: QuantSource, recipe_spec: str, name: str,
            target_bpw: float | None = None, replace: bool = False,
            calibration: Path | None = None, method: str = "rtn") -> Prepared:
    """Every check that needs no weights; raises StrataError with one line, writes nothing."""
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
    config = source.config
    plan = None
    if recipe is not None:
        plan = plan_model(recipe, _float_model(config), config)  # raises if a rule matches none
    check_method(method, plan, recipe_spec if recipe is None else recipe.name,
                 config.get("model_type"))
    return Prepared(recipe, config, name, plan)


def expected_sizes(source: QuantSource, recipe_specs: list[str]
                   ) -> dict[str, tuple[float, int]]:
    """Recipe -> (bits per weight, bytes) that it would give SOURCE, from the shapes of the
    source's tensors (its config and model class; no weight is read). Bits per weight count
    every stored tensor (weights, scales, biases, float16 others) over the parameter count,
    as the manifest does. Bytes are those of the weights; a folder source's tokenizer files
    are added (a GGUF's are written at import from its metadata, and not counted)."""
    from mlx.utils import tree_flatten  # heavy: MLX loads only when a model is built

    config = source.config
    model = _float_model(config)
    flat: Any = tree_flatten(model.parameters())
    sizes = [(key.rsplit(".", 1)[0], key.endswith(".weight"), int(arr.size)) for key, arr in flat]
    params = sum(n for _, _, n in sizes)
    extra = source.tokenizer_bytes()
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


def import_options(source: QuantSource) -> dict[str, Any]:
    """What an import of SOURCE can do, for the import dialog: {"kind", "path", "options"},
    each option {"recipe" (None: the import's own default, source.default_option()), "label",
    "description", "bits_per_weight", "bytes"}. Sizes of recipes come from expected_sizes;
    recipes that cannot apply are left out."""
    names = []
    for n in builtin_names():
        try:
            expected_sizes(source, [n])
            names.append(n)
        except RecipeError:
            continue  # a rule matches no tensor of this model
    sizes = expected_sizes(source, names)
    options: list[dict[str, Any]] = [{"recipe": None, **source.default_option()}]
    for n in names:
        bpw, size = sizes[n]
        options.append({"recipe": n, "label": n, "description": resolve_recipe(n).description,
                        "bits_per_weight": round(bpw, 3), "bytes": size})
    return {"kind": source.kind, "path": str(source.path), "options": options}


def quantize(
    library: Library,
    source: QuantSource,
    recipe_spec: str,
    name: str,
    target_bpw: float | None = None,
    calibration: Path | None = None,
    calibration_tokens: int = 2048,
    progress: Progress | None = None,
    cancel: CancelFlag | None = None,
    replace: bool = False,
    method: str = "rtn",
    calibrate: Calibrate | None = None,
    awq_grid: int = AWQ_GRID,
) -> Manifest:
    """Quantize SOURCE by recipe into library model `name`. See the module docstring.

    A calibrated `method` runs in a child process, which passes its `calibrate`. `awq_grid`:
    the points AWQ's scale and clip searches try (mlx-lm's --n-grid), method awq only."""
    import mlx.core as mx  # heavy: MLX loads only when weights are quantized
    from mlx.utils import tree_flatten

    if awq_grid != AWQ_GRID and method != "awq":
        raise RecipeError(f"an AWQ grid ({awq_grid}) applies only to method 'awq', "
                          f"not {method!r}")
    if awq_grid < 2:
        raise RecipeError(f"AWQ grid {awq_grid} is too small: it needs at least 2 points")
    job = prepare(library, source, recipe_spec, name, target_bpw, replace, calibration,
                  method)
    if method in CALIBRATED and calibrate is None:
        # The child runs elsewhere (cwd): paths travel resolved, the source as it was opened.
        recipe_file = Path(recipe_spec).expanduser()
        spec = {"home": str(library.home.resolve()), "source": encode_source(source),
                "recipe": str(recipe_file.resolve()) if recipe_file.is_file() else recipe_spec,
                "name": name, "target_bpw": target_bpw, "method": method,
                "calibration": str(Path(calibration).resolve()) if calibration else None,
                "calibration_tokens": calibration_tokens, "replace": replace,
                "awq_grid": awq_grid}
        return run_child(library.home, spec, progress, cancel)
    cancel = cancel or (lambda: False)
    weights = source.float_weights(None, cancel)
    try:
        model = float_model(weights)
        if cancel():
            raise Cancelled("quantize")
        sens_info: dict[str, Any] = {}
        importance: Importance | None = None
        if method == "imatrix":
            assert calibration is not None
            ids = text_tokens(Tokenizer.load(weights.folder), calibration, calibration_tokens)
            importance = activation_importance(model, ids, progress=progress, cancel=cancel)
            sens_info.update(method=method, calibration=calibration.name,
                             calibration_tokens=len(ids))
        if job.recipe is None:
            assert target_bpw is not None and calibration is not None
            tok = Tokenizer.load(weights.folder)
            errors = measure(model, tok, calibration, calibration_tokens,
                             progress=progress, cancel=cancel, importance=importance)
            plan = allocate(errors, quantizable(model), target_bpw)
            recipe = plan_to_recipe(f"auto-{target_bpw:g}", plan,
                                    f"sensitivity-guided for {target_bpw:g} bits per weight, "
                                    f"calibrated on {calibration.name}")
            sens_info.update(target_bpw=target_bpw, calibration=calibration.name,
                             calibration_tokens=calibration_tokens)
        else:
            recipe = job.recipe
            plan = plan_model(recipe, model, weights.config)
        if method in ("rtn", "imatrix"):
            apply_plan(model, plan, progress, cancel, importance=importance)
        else:
            assert calibration is not None and calibrate is not None
            used = calibrate(method, model, weights.config, plan,
                             Tokenizer.load(weights.folder), calibration, calibration_tokens,
                             progress, cancel, awq_grid=awq_grid)
            sens_info.update(method=method, calibration=calibration.name,
                             calibration_tokens=used)
            if method == "awq":
                sens_info.update(awq_grid=awq_grid)
        arrays = dict(tree_flatten(model.parameters()))
        mx.eval(arrays)
        config = quantized_config(weights.config, recipe, plan)
        if cancel():
            raise Cancelled("quantize")

        def build(tmp: Path) -> Manifest:
            mx.save_safetensors(str(tmp / "model.safetensors"), arrays,
                                metadata={"format": "mlx"})
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            (tmp / "recipe.toml").write_text(recipe.to_toml())
            for f in weights.tokenizer_files():
                shutil.copy2(f, tmp / f.name)
            formats, bpw, params = weight_stats(arrays, config)
            manifest = manifest_fields(config, "quantized", f"quantize:{source.label}",
                                       formats, bpw, params, weights.tokenizer)
            manifest["recipe"] = {"name": recipe.name, "tensors": class_summary(plan),
                                  **sens_info}
            return manifest

        manifest = library.install(name, build, replace=replace)
    finally:
        weights.close()
    if progress is not None:
        progress(1, 1)
    return manifest


@dataclass(frozen=True)
class Requantize:
    """A recipe and how to round it, as a value: what an import with a recipe applies.

    An engine.importers.Requantizer: `import_path(library, path, requantize=Requantize(r))`
    hands it the opened source, and `install` is `quantize` under the import's name."""

    recipe: str
    method: str = "rtn"
    target_bpw: float | None = None
    calibration: Path | None = None
    calibration_tokens: int = 2048
    awq_grid: int = AWQ_GRID

    def install(self, library: Library, source: QuantSource, name: str, *,
                progress: Progress | None = None, cancel: CancelFlag | None = None,
                replace: bool = False) -> Manifest:
        return quantize(library, source, self.recipe, name, target_bpw=self.target_bpw,
                        calibration=self.calibration,
                        calibration_tokens=self.calibration_tokens, progress=progress,
                        cancel=cancel, replace=replace, method=self.method,
                        awq_grid=self.awq_grid)

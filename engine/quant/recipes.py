"""Quantization recipes: which bits and group size each tensor gets, written as plain data.

Contract: `resolve_recipe(spec)` turns a built-in name ("q4-g64", "f16", "mixed-attn8-mlp4",
...) or a path to a .toml/.json file into a validated `Recipe`, or raises RecipeError with one
line before any model is touched. `plan_model(recipe, model)` maps each quantizable module path
of an mlx-lm model to a `Format` (float16 when bits is 16) and raises RecipeError when a rule
matches no tensor. A recipe is a default format plus rules; a rule names tensor classes (globs
over TENSOR_CLASSES) and optionally layers, and the last rule that matches a tensor wins.

    name = "my-recipe"
    bits = 4            # default for every quantizable tensor (16 keeps float16)
    group_size = 64
    [[rules]]
    tensors = ["embed", "head"]
    bits = 8
    [[rules]]
    tensors = ["attn.v", "mlp.down"]
    layers = ["0:2", -1]    # ints (negative from the end) or "start:stop" slices
    bits = 6
"""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import StrataError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
FLOAT_BITS = 16  # "bits = 16" keeps a tensor in float16
SUPPORTED_GROUPS = (32, 64, 128)
TENSOR_CLASSES = ("embed", "head", "attn.q", "attn.k", "attn.v", "attn.o",
                  "mlp.gate", "mlp.up", "mlp.down", "other")
RECIPES_DIR = Path(__file__).parent / "recipes"
_UNIFORM_RE = re.compile(r"^q([0-9]+)-g([0-9]+)$")
_RECIPE_KEYS = {"name", "description", "bits", "group_size", "rules"}
_RULE_KEYS = {"tensors", "layers", "bits", "group_size"}
_ATTN = {"q_proj": "attn.q", "k_proj": "attn.k", "v_proj": "attn.v", "o_proj": "attn.o"}
_MLP = {"gate_proj": "mlp.gate", "up_proj": "mlp.up", "down_proj": "mlp.down"}


class RecipeError(StrataError):
    """A recipe is unknown, does not parse, or cannot apply to a model."""


@dataclass(frozen=True)
class Format:
    """How one tensor is stored: affine `bits` with `group_size`, or float16 when bits is 16."""

    bits: int
    group_size: int

    @property
    def quantized(self) -> bool:
        return self.bits != FLOAT_BITS

    @property
    def bits_per_weight(self) -> float:
        # Scales and biases are float16, one pair per group.
        return float(self.bits) if not self.quantized else self.bits + 32 / self.group_size

    def label(self) -> str:
        return "f16" if not self.quantized else f"{self.bits}-bit g{self.group_size}"


@dataclass
class Rule:
    tensors: list[str]
    bits: int | None = None
    group_size: int | None = None
    layers: list[int | str] | None = None


@dataclass
class Recipe:
    name: str
    bits: int = 4
    group_size: int = 64
    rules: list[Rule] = field(default_factory=list)
    description: str = ""

    # -- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out.update(bits=self.bits, group_size=self.group_size)
        rules = []
        for r in self.rules:
            d: dict[str, Any] = {"tensors": list(r.tensors)}
            if r.layers is not None:
                d["layers"] = list(r.layers)
            if r.bits is not None:
                d["bits"] = r.bits
            if r.group_size is not None:
                d["group_size"] = r.group_size
            rules.append(d)
        if rules:
            out["rules"] = rules
        return out

    def to_toml(self) -> str:
        """TOML text that `parse_recipe` reads back to an equal recipe."""
        d = self.to_dict()
        lines = [f"{k} = {_toml_value(v)}" for k, v in d.items() if k != "rules"]
        for rule in d.get("rules", []):
            lines += ["", "[[rules]]"] + [f"{k} = {_toml_value(v)}" for k, v in rule.items()]
        return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to a recipe")


# -- parsing and validation -----------------------------------------------------------------
def _check_format(where: str, bits: Any, group: Any) -> None:
    if bits is not None and (not isinstance(bits, int) or isinstance(bits, bool)
                             or bits not in (*SUPPORTED_BITS, FLOAT_BITS)):
        raise RecipeError(f"{where}: bits {bits!r} is not supported "
                          f"(use {', '.join(map(str, SUPPORTED_BITS))} or 16 for float16)")
    if group is not None and (not isinstance(group, int) or isinstance(group, bool)
                              or group not in SUPPORTED_GROUPS):
        raise RecipeError(f"{where}: group size {group!r} is not supported "
                          f"(use {', '.join(map(str, SUPPORTED_GROUPS))})")


def _check_layer(where: str, item: Any) -> None:
    if isinstance(item, int) and not isinstance(item, bool):
        return
    if isinstance(item, str) and re.fullmatch(r"\s*-?\d*\s*:\s*-?\d*\s*", item):
        return
    raise RecipeError(f"{where}: layer {item!r} is neither an integer nor a 'start:stop' range")


def recipe_from_dict(data: Any, where: str) -> Recipe:
    """A validated Recipe from parsed TOML/JSON; RecipeError naming `where` otherwise."""
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: a recipe is a table of keys (name, bits, group_size, rules)")
    unknown = sorted(set(data) - _RECIPE_KEYS)
    if unknown:
        raise RecipeError(f"{where}: unknown key {unknown[0]!r} "
                          f"(allowed: {', '.join(sorted(_RECIPE_KEYS))})")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise RecipeError(f"{where}: the recipe needs a name")
    bits, group = data.get("bits", 4), data.get("group_size", 64)
    _check_format(where, bits, group)
    rules_data = data.get("rules", [])
    if not isinstance(rules_data, list):
        raise RecipeError(f"{where}: rules must be a list of tables ([[rules]])")
    rules = []
    for i, rd in enumerate(rules_data, 1):
        at = f"{where}: rule {i}"
        if not isinstance(rd, dict):
            raise RecipeError(f"{at}: not a table")
        unknown = sorted(set(rd) - _RULE_KEYS)
        if unknown:
            raise RecipeError(f"{at}: unknown key {unknown[0]!r} "
                              f"(allowed: {', '.join(sorted(_RULE_KEYS))})")
        tensors = rd.get("tensors")
        if isinstance(tensors, str):
            tensors = [tensors]
        if not isinstance(tensors, list) or not tensors or not all(
                isinstance(t, str) for t in tensors):
            raise RecipeError(f"{at}: tensors must be a list of class names "
                              f"({', '.join(TENSOR_CLASSES)}; globs like 'attn.*' allowed)")
        for t in tensors:
            if not fnmatch.filter(TENSOR_CLASSES, t):
                raise RecipeError(f"{at}: {t!r} names no tensor class "
                                  f"(known: {', '.join(TENSOR_CLASSES)})")
        if "bits" not in rd and "group_size" not in rd:
            raise RecipeError(f"{at}: says neither bits nor group_size")
        _check_format(at, rd.get("bits"), rd.get("group_size"))
        layers = rd.get("layers")
        if layers is not None:
            if isinstance(layers, (int, str)):
                layers = [layers]
            if not isinstance(layers, list) or not layers:
                raise RecipeError(f"{at}: layers must be a list of integers or 'start:stop'")
            for item in layers:
                _check_layer(at, item)
        rules.append(Rule(tensors=list(tensors), bits=rd.get("bits"),
                          group_size=rd.get("group_size"), layers=layers))
    desc = data.get("description", "")
    return Recipe(name=name.strip(), bits=bits, group_size=group, rules=rules,
                  description=str(desc))


def parse_recipe(text: str, where: str, suffix: str = ".toml") -> Recipe:
    try:
        data = json.loads(text) if suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        msg = " ".join(str(exc).split())
        raise RecipeError(f"{where}: does not parse as {suffix[1:].upper()} ({msg})") from exc
    return recipe_from_dict(data, where)


def load_recipe_file(path: Path) -> Recipe:
    if path.suffix not in (".toml", ".json"):
        raise RecipeError(f"{path}: a recipe file ends in .toml or .json")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read recipe ({exc.__class__.__name__})") from exc
    return parse_recipe(text, str(path), path.suffix)


def uniform(bits: int, group_size: int) -> Recipe:
    return Recipe(name=f"q{bits}-g{group_size}", bits=bits, group_size=group_size,
                  description=f"every tensor {bits}-bit, group {group_size}")


def builtin_names() -> list[str]:
    """Every built-in recipe name: f16, the uniform grid, then the mixed recipes' files."""
    grid = [f"q{b}-g{g}" for b in sorted(SUPPORTED_BITS, reverse=True) for g in SUPPORTED_GROUPS]
    files = sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))
    return ["f16", *grid, *files]


def resolve_recipe(spec: str) -> Recipe:
    """A built-in recipe by name, or a recipe file by path. 'auto' is handled by the caller."""
    m = _UNIFORM_RE.match(spec)
    if m:
        bits, group = int(m.group(1)), int(m.group(2))
        _check_format(f"recipe {spec!r}", bits, group)
        return uniform(bits, group)
    if spec == "f16":
        return Recipe(name="f16", bits=FLOAT_BITS, group_size=64,
                      description="every weight float16 (no quantization)")
    builtin = RECIPES_DIR / f"{spec}.toml"
    if "/" not in spec and builtin.is_file():
        return load_recipe_file(builtin)
    path = Path(spec).expanduser()
    if path.suffix in (".toml", ".json") or path.exists():
        if not path.is_file():
            raise RecipeError(f"{path}: no such recipe file")
        return load_recipe_file(path)
    raise RecipeError(f"unknown recipe {spec!r} (built in: auto, {', '.join(builtin_names())}; "
                      "or a path to a .toml/.json file)")


# -- applying a recipe to a model -----------------------------------------------------------
def tensor_class(path: str) -> tuple[str, int | None]:
    """(class, layer index or None) for a module path of an mlx-lm model."""
    parts = path.split(".")
    if parts[-1] == "embed_tokens":
        return "embed", None
    if parts[-1] == "lm_head":
        return "head", None
    layer = None
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            layer = int(parts[i + 1])
    if parts[-2:-1] == ["self_attn"] and parts[-1] in _ATTN:
        return _ATTN[parts[-1]], layer
    if parts[-2:-1] == ["mlp"] and parts[-1] in _MLP:
        return _MLP[parts[-1]], layer
    return "other", layer


def _layer_set(items: list[int | str], n_layers: int) -> set[int]:
    out: set[int] = set()
    for item in items:
        if isinstance(item, int):
            if -n_layers <= item < n_layers:
                out.add(item % n_layers)
        else:
            a, b = (s.strip() for s in item.split(":"))
            out.update(range(n_layers)[slice(int(a) if a else None, int(b) if b else None)])
    return out


def _rule_label(i: int, rule: Rule) -> str:
    where = f" layers {', '.join(map(str, rule.layers))}" if rule.layers is not None else ""
    return f"rule {i} ({', '.join(rule.tensors)}{where})"


def quantizable(model: Any) -> dict[str, tuple[int, ...]]:
    """Module path -> weight shape for every module MLX can quantize, in model order."""
    out = {}
    for path, mod in model.named_modules():
        if hasattr(mod, "to_quantized") and hasattr(mod, "weight"):
            out[path] = tuple(mod.weight.shape)
    return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def _order(path: str) -> tuple[int, int, str]:
    cls, layer = tensor_class(path)
    top = 0 if cls == "embed" else (2 if cls == "head" else 1)
    return top, -1 if layer is None else layer, path


def effective_group(group: int, columns: int) -> int | None:
    """`group` when it divides the row, else the largest supported group that does."""
    for g in sorted((g for g in SUPPORTED_GROUPS if g <= group), reverse=True):
        if columns % g == 0:
            return g
    for g in SUPPORTED_GROUPS:  # rows shorter than the group: try any supported size
        if columns % g == 0:
            return g
    return None


def plan_shapes(recipe: Recipe, shapes: dict[str, tuple[int, ...]], n_layers: int,
                tied: bool) -> dict[str, Format]:
    """The format of each quantizable tensor; RecipeError if a rule matches no tensor.

    A tied embedding is also the output head, so rules for "head" reach it too (after those
    for "embed"). Where a group size does not divide a row (576 columns and group 128) the
    largest supported group that does is used; a tensor no group divides stays float16.
    """
    hits = [0] * len(recipe.rules)
    out: dict[str, Format] = {}
    layer_sets = [None if r.layers is None else _layer_set(r.layers, n_layers)
                  for r in recipe.rules]
    for path, shape in shapes.items():
        cls, layer = tensor_class(path)
        classes = [cls, "head"] if (cls == "embed" and tied) else [cls]
        bits, group = recipe.bits, recipe.group_size
        for i, rule in enumerate(recipe.rules):
            if not any(fnmatch.fnmatchcase(c, t) for c in classes for t in rule.tensors):
                continue
            allowed = layer_sets[i]
            if allowed is not None and (layer is None or layer not in allowed):
                continue
            hits[i] += 1
            bits = rule.bits if rule.bits is not None else bits
            group = rule.group_size if rule.group_size is not None else group
        if bits == FLOAT_BITS:
            out[path] = Format(FLOAT_BITS, group)
            continue
        g = effective_group(group, shape[-1])
        out[path] = Format(bits, g) if g is not None else Format(FLOAT_BITS, group)
    for i, n in enumerate(hits):
        if n == 0:
            raise RecipeError(f"recipe {recipe.name!r}: {_rule_label(i + 1, recipe.rules[i])} "
                              "matches no tensor of this model")
    if not out:
        raise RecipeError(f"recipe {recipe.name!r}: the model has no quantizable tensor")
    return out


def plan_model(recipe: Recipe, model: Any, config: dict[str, Any]) -> dict[str, Format]:
    return plan_shapes(recipe, quantizable(model), int(config.get("num_hidden_layers", 0)),
                       bool(config.get("tie_word_embeddings", False)))


def plan_bits_per_weight(plan: dict[str, Format], shapes: dict[str, tuple[int, ...]]) -> float:
    """Bits per weight of the quantizable tensors under a plan (norms excluded)."""
    total = sum(_size(shapes[p]) for p in plan)
    bits = sum(f.bits_per_weight * _size(shapes[p]) for p, f in plan.items())
    return bits / max(total, 1)


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_to_recipe(name: str, plan: dict[str, Format], description: str = "") -> Recipe:
    """An explicit recipe (one rule per class and format) that reproduces `plan`."""
    counts: dict[Format, int] = {}
    for f in plan.values():
        counts[f] = counts.get(f, 0) + 1
    base = max(counts, key=lambda f: (counts[f], f.bits))
    groups: dict[tuple[str, Format], list[int | str]] = {}
    for path, f in plan.items():
        if f == base:
            continue
        cls, layer = tensor_class(path)
        groups.setdefault((cls, f), []).append(layer if layer is not None else -1)
    rules = []
    for (cls, f), layers in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1].bits)):
        has_layers = cls not in ("embed", "head", "other")
        rules.append(Rule(tensors=[cls], bits=f.bits, group_size=f.group_size,
                          layers=sorted(int(x) for x in layers) if has_layers else None))
    return Recipe(name=name, bits=base.bits, group_size=base.group_size, rules=rules,
                  description=description)

"""The floors of docs/architecture.md hold: imports run down, never up, never in a circle.

Reads every module of engine/ and app/ as source (AST: `import`, `from ... import`, relative
imports, names passed to importlib.import_module or __import__, TYPE_CHECKING blocks
included) and fails on:
- an import that goes up a floor, or sideways into another package of the same floor;
- a cycle between packages;
- any mention of the `app` package inside engine/ (an import, or a string naming a module
  or file of it);
- a cross-package import of an underscore name;
- a function-local import of Strata's own modules without a one-line reason beside it.
The checker is shown once, on a planted tree, to catch each of these.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import REPO

# Floor by package, from the ground up (docs/architecture.md).
FLOORS: dict[str, int] = {
    "engine": 0,  # the leaves: engine/__init__.py, errors.py, telemetry.py, platform.py
    "engine.kv": 1, "engine.library": 1,
    "engine.runtime": 2,
    "engine.importers": 3, "engine.quant": 3, "engine.server": 3,
    "engine.bench": 4,
    "app": 5,
    "app.cli": 6,  # the `strata` command: the composition root
}
SAME = {"app.__main__": "app.cli"}  # `python -m app` is the command too
ROOTS = ("engine", "app")
APP_MENTION = re.compile(r"(?<![\w.])app(\.[A-Za-z_]|/[A-Za-z_]|$)")


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: {self.what}"


def package_of(module: str) -> str:
    """The floor-owning package of a module: the longest key of FLOORS that prefixes it."""
    best = ""
    if module in SAME:
        return SAME[module]
    for pkg in FLOORS:
        if (module == pkg or module.startswith(pkg + ".")) and len(pkg) > len(best):
            best = pkg
    return best


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def _ours(name: str) -> bool:
    return name.split(".")[0] in ROOTS


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, is_pkg: bool, lines: list[str]) -> None:
        self.module, self.is_pkg, self.lines = module, is_pkg, lines
        self.imports: list[tuple[int, str, list[str], bool]] = []  # line, target, names, local
        self.depth = 0

    def _local_reason(self, node: ast.stmt) -> bool:
        """A comment on the import's own lines, or on the line above the run of imports it
        belongs to (one reason may cover a few imports that load together)."""
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        if any("#" in t for t in self.lines[first:last + 1]):
            return True
        i = first - 1
        while i >= 0 and self.lines[i].strip().startswith(("from ", "import ", ")")):
            if "#" in self.lines[i]:
                return True
            i -= 1
        return i >= 0 and self.lines[i].strip().startswith("#")

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports.append((node.lineno, alias.name, [], self._flag(node)))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        target = (_resolve(self.module, self.is_pkg, node.level, node.module) if node.level
                  else node.module or "")
        self.imports.append((node.lineno, target, [a.name for a in node.names],
                             self._flag(node)))

    def _flag(self, node: ast.stmt) -> bool:
        """True when this is a function-local import that gives no reason."""
        return self.depth > 0 and not self._local_reason(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                self.imports.append((node.lineno, arg.value, [], False))
            elif isinstance(arg, ast.JoinedStr) and arg.values:
                head = arg.values[0]
                if isinstance(head, ast.Constant) and isinstance(head.value, str):
                    self.imports.append((node.lineno, head.value.rstrip("."), [], False))
        self.generic_visit(node)


def check_tree(root: Path) -> list[Violation]:
    """Every violation of the floors in the engine/ and app/ under `root`."""
    found: list[Violation] = []
    edges: dict[tuple[str, str], tuple[str, int]] = {}
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            module = _module_name(root, path)
            source = path.read_text()
            tree = ast.parse(source, str(path))
            visitor = _Visitor(module, path.name == "__init__.py", source.splitlines())
            visitor.visit(tree)
            here = package_of(module)
            for line, target, names, unexplained in visitor.imports:
                if top == "engine" and target.split(".")[0] == "app":
                    found.append(Violation(module, line, f"engine names the app ({target})"))
                    continue
                if not _ours(target):
                    continue
                there = package_of(target)
                if not there:
                    continue
                if there != here:
                    edges.setdefault((here, there), (module, line))
                    if FLOORS[there] >= FLOORS[here]:
                        found.append(Violation(
                            module, line, f"imports {target} (floor {FLOORS[there]}, "
                            f"{there}) from floor {FLOORS[here]} ({here})"))
                    private = [n for n in names if n.startswith("_") and n != "__version__"]
                    if private:
                        found.append(Violation(module, line, f"takes private {private} from "
                                               f"another package ({target})"))
                if unexplained:
                    found.append(Violation(module, line, f"function-local import of {target} "
                                           "without a reason beside it"))
            if top == "engine":
                for node in ast.walk(tree):
                    if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                            and APP_MENTION.search(node.value)):
                        found.append(Violation(module, getattr(node, "lineno", 0),
                                               "a string in engine/ names the app"))
    found.extend(_cycles(edges))
    return found


def _cycles(edges: dict[tuple[str, str], tuple[str, int]]) -> list[Violation]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    out: list[Violation] = []
    seen: set[frozenset[str]] = set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                loop = path[path.index(nxt):]
                key = frozenset(loop)
                if key not in seen:
                    seen.add(key)
                    module, line = edges[(node, nxt)]
                    out.append(Violation(module, line,
                                         "packages import each other: " +
                                         " -> ".join([*loop, nxt])))
            elif len(path) < len(graph) + 1:
                walk(nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return out


def test_the_floors_hold() -> None:
    violations = check_tree(REPO)
    assert not violations, "\n".join(map(str, violations))


def test_every_module_has_a_floor() -> None:
    for top in ROOTS:
        for path in (REPO / top).rglob("*.py"):
            assert package_of(_module_name(REPO, path)), path


def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def test_the_checker_catches_planted_violations(tmp_path: Path) -> None:
    root = _plant(tmp_path, {
        "engine/__init__.py": "",
        "engine/errors.py": "",
        "engine/kv/__init__.py": "",
        "engine/kv/store.py": "from engine.runtime.generate import LoadedModel\n",
        "engine/kv/table.py": "from ..library import store\n",  # sideways, relative
        "engine/runtime/__init__.py": "",
        "engine/runtime/generate.py": (
            "from engine.kv.store import _private\n"
            "def f():\n    from engine.errors import StrataError\n"),
        "engine/library/__init__.py": "",
        "engine/library/store.py": "import importlib\nimportlib.import_module('app.main')\n",
        "engine/server/__init__.py": "X = 'see app/worker.py'\n",
        "engine/quant/__init__.py": "from engine.importers import detect\n",
        "engine/importers/__init__.py": "from engine.quant import plan\n",
        "app/__init__.py": "",
        "app/worker.py": "from app.cli import main\nfrom engine.errors import StrataError\n",
        "app/cli.py": "import app.worker\ndef run():\n    import app.main  # Qt only here\n",
    })
    found = [str(v) for v in check_tree(root)]
    expect = [
        "engine.kv.store:1: imports engine.runtime.generate (floor 2",  # up a floor
        "engine.kv.table:1: imports engine.library (floor 1",  # sideways, relative import
        "engine.quant:1: imports engine.importers (floor 3",  # sideways
        "engine.importers:1: imports engine.quant (floor 3",
        "engine.runtime.generate:1: takes private ['_private']",
        "engine.runtime.generate:3: function-local import of engine.errors without a reason",
        "engine.library.store:2: engine names the app (app.main)",  # through importlib
        "engine.library.store:2: a string in engine/ names the app",
        "engine.server:1: a string in engine/ names the app",
        "app.worker:1: imports app.cli (floor 6, app.cli) from floor 5",
        "packages import each other: app -> app.cli -> app",
        "packages import each other: engine.importers -> engine.quant -> engine.importers",
        "packages import each other: engine.kv -> engine.runtime -> engine.kv",
    ]
    for e in expect:
        assert any(e in f for f in found), (e, found)
    # The command may import every floor, with a reason for a local import: nothing else.
    assert len(found) == len(expect), found

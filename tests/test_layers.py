"""The layer map in sbpbench's docstring holds: no module imports a package of ours it may not.

The map is read from `sbpbench.__doc__` (one line per package: `name: job -> allowed, ...`), so
the documentation and this check cannot drift. Every import counts: absolute (`sbpbench.x`) and
relative, at module level and inside functions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import sbpbench

PACKAGE_DIR = Path(sbpbench.__file__).parent
ROOT = "sbpbench"  # the root module's own entry in the map: __init__.py and __main__.py
ENTRY = re.compile(r" {4}(\w+): .+ -> (.+)")


def layer_map(doc: str) -> dict[str, tuple[str, ...]]:
    """package -> the packages of ours it may import besides itself, in the docstring's order."""
    allowed = {}
    for line in doc.splitlines():
        match = ENTRY.fullmatch(line)
        if match:
            name, targets = match.groups()
            allowed[name] = () if targets.strip() == "nothing" else tuple(t.strip() for t in targets.split(","))
    return allowed


def imported_modules(tree: ast.Module, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the tree, function-level ones included, in line order;
    a relative import resolved against `package` (the dotted package the module is in)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from sbpbench import plot` imports a package; `from sbpbench import __version__` the root
            names = [f"{base}.{alias.name}" for alias in node.names] if base == ROOT else [base]
            found += [(node.lineno, name) for name in names]
    return sorted(found)


def package_of(name: str, packages) -> str | None:
    """The package of ours a dotted name lies in; ROOT for the root module or one of its names;
    None for a module not of ours."""
    parts = name.split(".")
    if parts[0] != ROOT:
        return None
    if len(parts) > 1 and (parts[1] in packages or (PACKAGE_DIR / parts[1]).is_dir()):
        return parts[1]
    return ROOT


def violations(sources: dict[str, str], allowed: dict[str, tuple[str, ...]]) -> list[str]:
    """One line per import that breaks the map, for modules given as {path under sbpbench/: source}."""
    found = []
    for path, source in sorted(sources.items()):
        parts = Path(path).with_suffix("").parts
        package = parts[0] if len(parts) > 1 else ROOT
        if package not in allowed:
            found.append(f"sbpbench/{path}: package {package} is not in the layer map (sbpbench/__init__.py)")
            continue
        dotted = ".".join((ROOT, *parts))
        current = dotted.removesuffix(".__init__") if parts[-1] == "__init__" else dotted.rpartition(".")[0]
        names = dict.fromkeys(name for _, name in imported_modules(ast.parse(source, path), current))
        for name in names:
            target = package_of(name, allowed)
            # the root module runs before any module of ours, so importing it adds no dependency
            if target in (None, ROOT, package) or target in allowed[package]:
                continue
            only = ", ".join(allowed[package]) or "itself"
            found.append(f"sbpbench/{path}: imports {name} (package {package} may import only {only})")
    return found


def test_every_module_keeps_to_the_layer_map():
    """No module under sbpbench/ imports a package of ours that its package's line in the map omits."""
    allowed = layer_map(sbpbench.__doc__)
    assert {"core", "records", "plot", "cli", ROOT} <= set(allowed), "the layer map did not parse"
    sources = {path.relative_to(PACKAGE_DIR).as_posix(): path.read_text() for path in PACKAGE_DIR.rglob("*.py")}
    found = violations(sources, allowed)
    assert not found, "imports that break the layer map in sbpbench/__init__.py:\n" + "\n".join(found)


def test_nothing_of_ours_imports_integrations():
    """integrations (the trainer subclasses) sits on top: it may import core only, and no package's
    line in the map lists it, so no module of ours imports it (tests and docs do)."""
    allowed = layer_map(sbpbench.__doc__)
    assert allowed["integrations"] == ("core",)
    assert not [package for package, targets in allowed.items() if "integrations" in targets]


def test_checker_catches_forbidden_imports():
    """Relative, absolute and function-level imports of a package not in the map are each reported."""
    allowed = layer_map("    core: x -> nothing\n    records: y -> measure\n    measure: z -> nothing\n")
    assert allowed == {"core": (), "records": ("measure",), "measure": ()}
    source = (
        "from .. import __version__\n"  # the root: allowed
        "from ..measure.units import GIB\n"  # listed: allowed
        "from .schema import ResultRow\n"  # itself: allowed
        "import numpy\n"  # not ours: ignored
        "import sbpbench.core.labels\n"
        "from .. import core\n"
        "def f():\n"
        "    import sbpbench.models.build\n"
        "    from ..core import stream_backward\n"
    )
    rule = "(package records may import only measure)"
    assert violations({"records/select.py": source}, allowed) == [
        f"sbpbench/records/select.py: imports sbpbench.core.labels {rule}",
        f"sbpbench/records/select.py: imports sbpbench.core {rule}",
        f"sbpbench/records/select.py: imports sbpbench.models.build {rule}",
    ]
    assert violations({"planner/x.py": ""}, allowed) == [
        "sbpbench/planner/x.py: package planner is not in the layer map (sbpbench/__init__.py)"
    ]

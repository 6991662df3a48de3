"""The layer map in sbpbench's docstring holds: no module imports a package of ours it may not.

The map is read from `sbpbench.__doc__` (one line per package: `name: job -> allowed, ...`), so
the documentation and this check cannot drift. Every import counts: absolute (`sbpbench.x`) and
relative, at module level and inside functions, and a module named by a string (a loader's
argument, a preload list, a `-m` command line). No modules of ours import each other in a cycle,
however the cycle is spread over module and function level. A name is imported from the package
that defines it, not through another package's re-export.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import sbpbench

PACKAGE_DIR = Path(sbpbench.__file__).parent
ROOT = "sbpbench"  # the root module's own entry in the map: __init__.py and __main__.py
ENTRY = re.compile(r" {4}(\w+): .+ -> (.+)")
OUR_MODULE = re.compile(r"sbpbench(\.\w+)+")  # a string spelling a module of ours: "sbpbench.core.x"
RELATIVE_MODULE = re.compile(r"(\.+)(\w+(\.\w+)*)")  # ".trainer", "..core.x"
LOADERS = ("import_module", "__import__")  # importlib.import_module, the builtin


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
    """(line, dotted name) of every import in the tree, function-level ones and strings
    (string_imports) included, in line order; a relative import resolved against `package` (the
    dotted package the module is in). `from X import a` gives X.a: a module, or a name X defines."""
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
            found += [(node.lineno, base if alias.name == "*" else f"{base}.{alias.name}") for alias in node.names]
    return sorted(found + string_imports(tree, package))


def _relative(name: str, package: str) -> str:
    """A relative module name ("..core.x") resolved against a dotted package."""
    dots, rest = RELATIVE_MODULE.fullmatch(name).group(1, 2)
    parts = package.split(".")
    return ".".join(parts[: len(parts) - (len(dots) - 1)] + [rest])


def string_imports(tree: ast.Module, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of the modules of ours a module names in a string: any string that spells
    one ("sbpbench.core.x" in a preload list or a `-m` command line), and, in a module that calls a
    loader (importlib.import_module, __import__), each of its strings that is a relative module
    name (".trainer", resolved against `package`), since the loader may be handed any of them."""
    strings = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    loads = any(getattr(c.func, "attr", getattr(c.func, "id", None)) in LOADERS for c in calls)
    found = [(n.lineno, n.value) for n in strings if OUR_MODULE.fullmatch(n.value)]
    if loads:
        found += [(n.lineno, _relative(n.value, package)) for n in strings if RELATIVE_MODULE.fullmatch(n.value)]
    return found


def package_of(name: str, packages) -> str | None:
    """The package of ours a dotted name lies in; ROOT for the root module or one of its names;
    None for a module not of ours."""
    parts = name.split(".")
    if parts[0] != ROOT:
        return None
    if len(parts) > 1 and (parts[1] in packages or (PACKAGE_DIR / parts[1]).is_dir()):
        return parts[1]
    return ROOT


def module_and_package(path: str) -> tuple[str, str]:
    """The dotted name of the module at `path` (under sbpbench/; a package's __init__.py: the
    package's name) and of the package it is in, against which its relative imports resolve."""
    parts = Path(path).with_suffix("").parts
    dotted = ".".join((ROOT, *parts))
    if parts[-1] == "__init__":
        dotted = dotted.removesuffix(".__init__")
        return dotted, dotted
    return dotted, dotted.rpartition(".")[0]


def package_at(path: str) -> str:
    """The package of ours a module is in, by its path under sbpbench/ (ROOT for a top-level file)."""
    parts = Path(path).parts
    return parts[0] if len(parts) > 1 else ROOT


def unused_arrows(sources: dict[str, str], allowed: dict[str, tuple[str, ...]]) -> list[str]:
    """One line per package of ours that a package's line in the map lists but none of its modules
    (given as {path under sbpbench/: source}) imports: a dependency the map claims and the code dropped."""
    used: dict[str, set[str | None]] = {package: set() for package in allowed}
    for path, source in sources.items():
        package = package_at(path)
        _, current = module_and_package(path)
        used.setdefault(package, set()).update(
            package_of(name, allowed) for _, name in imported_modules(ast.parse(source, path), current)
        )
    return [
        f"{package} -> {target}: no module of {package} imports {target}; take it off the map's line"
        for package, targets in allowed.items()
        for target in targets
        if target not in used[package]
    ]


def violations(sources: dict[str, str], allowed: dict[str, tuple[str, ...]]) -> list[str]:
    """One line per import that breaks the map, for modules given as {path under sbpbench/: source}."""
    found = []
    for path, source in sorted(sources.items()):
        package = package_at(path)
        if package not in allowed:
            found.append(f"sbpbench/{path}: package {package} is not in the layer map (sbpbench/__init__.py)")
            continue
        _, current = module_and_package(path)
        names = dict.fromkeys(name for _, name in imported_modules(ast.parse(source, path), current))
        for name in names:
            target = package_of(name, allowed)
            # the root module runs before any module of ours, so importing it adds no dependency
            if target in (None, ROOT, package) or target in allowed[package]:
                continue
            only = ", ".join(allowed[package]) or "itself"
            found.append(f"sbpbench/{path}: imports {name} (package {package} may import only {only})")
    return found


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports, at any level or by string, for modules given as
    {path under sbpbench/: source}. `from X import a` is an edge to the module X.a when there is one,
    else to X (a package: its __init__.py)."""
    names = {path: module_and_package(path) for path in sources}
    modules = {module for module, _ in names.values()}
    graph = {}
    for path, source in sources.items():
        module, package = names[path]
        graph[module] = set()
        for _, name in imported_modules(ast.parse(source, path), package):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: each strongly connected component of more than one module (Tarjan's
    algorithm), its modules sorted, the components in order."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def our_sources() -> dict[str, str]:
    """{path under sbpbench/: source} of every module of ours."""
    return {path.relative_to(PACKAGE_DIR).as_posix(): path.read_text() for path in PACKAGE_DIR.rglob("*.py")}


def test_every_module_keeps_to_the_layer_map():
    """No module under sbpbench/ imports a package of ours that its package's line in the map omits."""
    allowed = layer_map(sbpbench.__doc__)
    assert {"core", "records", "plot", "cli", ROOT} <= set(allowed), "the layer map did not parse"
    found = violations(our_sources(), allowed)
    assert not found, "imports that break the layer map in sbpbench/__init__.py:\n" + "\n".join(found)


def test_every_arrow_in_the_layer_map_is_used():
    """Each package a line of the map lists is imported by some module of that package, so the map
    states the dependencies as they are (a dependency removed from the code leaves the map too)."""
    found = unused_arrows(our_sources(), layer_map(sbpbench.__doc__))
    assert not found, "arrows of the layer map in sbpbench/__init__.py that no import uses:\n" + "\n".join(found)


def test_unused_arrow_checker_reports_an_arrow_no_import_uses():
    """A listed package that only a function-level import uses is used; one that no module imports is reported."""
    allowed = layer_map("    core: x -> nothing\n    records: y -> measure, core\n    measure: z -> nothing\n")
    used = {"records/a.py": "def f():\n    from ..measure.units import GIB\n", "records/b.py": "import os\n"}
    assert unused_arrows(used, allowed) == [
        "records -> core: no module of records imports core; take it off the map's line"
    ]


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
        f"sbpbench/records/select.py: imports sbpbench.core.stream_backward {rule}",
    ]
    assert violations({"planner/x.py": ""}, allowed) == [
        "sbpbench/planner/x.py: package planner is not in the layer map (sbpbench/__init__.py)"
    ]


def test_checker_sees_modules_named_by_strings():
    """A module of ours named in a string counts as an import: a loader's argument
    (importlib.import_module, __import__), a preload list, and, in a module that calls a loader,
    a relative name; a relative-looking string in a module that loads nothing is not one."""
    allowed = layer_map("    core: x -> nothing\n    runner: y -> models\n    models: z -> nothing\n")
    loader = (
        "import importlib\n"
        "PRELOAD = ('sbpbench.models.build', 'sbpbench.core.parallel.grad_sync')\n"  # models: allowed
        "def load(name):\n"
        "    importlib.import_module('sbpbench.core.labels')\n"
        "    __import__('sbpbench.core')\n"
        "    return importlib.import_module({'a': '.worker', 'b': '..core.head'}[name], __name__)\n"
    )
    plain = "SUFFIX = '..core'\nCOMMAND = ['-m', 'sbpbench.core.stream']\n"
    rule = "(package runner may import only models)"
    assert violations({"runner/fork.py": loader, "runner/files.py": plain}, allowed) == [
        f"sbpbench/runner/files.py: imports sbpbench.core.stream {rule}",
        f"sbpbench/runner/fork.py: imports sbpbench.core.parallel.grad_sync {rule}",
        f"sbpbench/runner/fork.py: imports sbpbench.core.labels {rule}",
        f"sbpbench/runner/fork.py: imports sbpbench.core {rule}",
        f"sbpbench/runner/fork.py: imports sbpbench.core.head {rule}",
    ]


def test_no_modules_of_ours_import_each_other_in_a_cycle():
    """No import cycle between modules of ours, at module level, function level or by string: a
    cycle hidden in a function is still a cycle (the shared piece belongs in a module both import)."""
    found = cycles(import_graph(our_sources()))
    assert not found, "modules of ours that import each other in a cycle:\n" + "\n".join(map(" <-> ".join, found))


def test_cycle_checker_finds_cycles_at_any_level():
    """Two modules tied by a function-level import, three tied through a package's __init__ and a
    string, and a module importing a name of a package: each cycle is found, nothing else is."""
    sources = {
        "a/__init__.py": "from .x import f\n",
        "a/x.py": "def f():\n    from .y import g\n",
        "a/y.py": "from .x import f\nfrom ..b import h\n",
        "b/__init__.py": "from .u import h\n",
        "b/u.py": "import importlib\nimportlib.import_module('sbpbench.b.v')\n",
        "b/v.py": "from . import w\n",
        "b/w.py": "from sbpbench.b import h\nfrom .. import __version__\n",
        "__init__.py": "",
    }
    graph = import_graph(sources)
    assert graph["sbpbench.a.y"] == {"sbpbench.a.x", "sbpbench.b"} and graph["sbpbench.b.w"] == {
        "sbpbench.b",
        "sbpbench",
    }
    assert cycles(graph) == [
        ["sbpbench.a.x", "sbpbench.a.y"],
        ["sbpbench.b", "sbpbench.b.u", "sbpbench.b.v", "sbpbench.b.w"],
    ]


CORE_INTERNAL = "internal"  # core/internal.py: what our packages use of core besides its face (__init__.py)


def _core_submodule(name: str) -> str | None:
    """The core submodule a dotted name lies in ("sbpbench.core.placements.placement.Placement": placement), if any."""
    parts = name.split(".")
    if parts[:2] != [ROOT, "core"] or len(parts) < 3:
        return None
    core = PACKAGE_DIR / "core"
    return parts[2] if (core / f"{parts[2]}.py").is_file() or (core / parts[2]).is_dir() else None


def core_submodule_imports(sources: dict[str, str]) -> list[str]:
    """One line per import, from a module outside core, of a core module other than its two faces."""
    found = []
    for path, source in sorted(sources.items()):
        if package_at(path) == "core":
            continue
        _, current = module_and_package(path)
        for line, name in imported_modules(ast.parse(source, path), current):
            if _core_submodule(name) not in (None, CORE_INTERNAL):
                found.append(f"sbpbench/{path}:{line}: imports {name}; use sbpbench.core or sbpbench.core.internal")
    return found


def test_outside_core_only_its_two_faces_are_imported():
    """No module outside core imports a core submodule but core/__init__.py (the library's face) and
    core/internal.py (what our own packages use of its internals), so that use stays one list."""
    found = core_submodule_imports(our_sources())
    assert not found, "\n".join(found)
    bad = {
        "runner/a.py": "from ..core.placements.placement import Placement\n",
        "runner/b.py": "from ..core import Placement\nfrom ..core.internal import ChunkState\n",
        "runner/c.py": "def f():\n    import sbpbench.core.attention\n",
    }
    assert [line.split(": imports ")[0] for line in core_submodule_imports(bad)] == [
        "sbpbench/runner/a.py:1",
        "sbpbench/runner/c.py:2",
    ]


def _imported_names(nodes, package: str) -> list[tuple[int, str, str, str]]:
    """(line, module, name, bound as) of each `from module import name` among `nodes`, a relative
    module resolved against `package`; `*` left out."""
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = imported_modules(ast.Module([node], []), package)[0][1].rpartition(".")[0]
            found += [(node.lineno, base, a.name, a.asname or a.name) for a in node.names if a.name != "*"]
    return found


def reexports(sources: dict[str, str]) -> list[str]:
    """One line per `from X import name` of ours (at any level, X given as {path under sbpbench/:
    source}) where X's package does not define `name` but takes it from another package of ours:
    the importer imports it from the package that defines it. A chain through X's own modules
    (a package's __init__.py importing its submodule) is followed to the end."""
    trees, packages, top = {}, {}, {}
    for path, source in sources.items():
        module, packages[module] = module_and_package(path)
        trees[module], top[module] = ast.parse(source, path), package_at(path)
    bound = {  # module -> {name it binds at its top level: (module it came from, name there)}
        module: {alias: (base, name) for _, base, name, alias in _imported_names(tree.body, packages[module])}
        for module, tree in trees.items()
    }
    found = []
    for path in sorted(sources):
        module, package = module_and_package(path)
        for line, base, name, _ in _imported_names(ast.walk(trees[module]), package):
            if base not in trees or f"{base}.{name}" in trees:  # not ours, or a module
                continue
            home, there, seen = base, name, set()
            while there in bound[home] and (home, there) not in seen:
                seen.add((home, there))
                home, there = bound[home][there]
                if home not in trees or f"{home}.{there}" in trees:  # defined outside ours, or a module
                    break
            if home in trees and top[home] != top[base]:
                found.append(f"sbpbench/{path}:{line}: imports {name} from {base}, which takes it from {home}")
    return found


# Imports through a re-export that stay until their modules change: (path, name). simulate takes
# ConfigError from config; it will import it from settings once the map gives simulate that arrow.
def test_names_are_imported_from_the_package_that_defines_them():
    """A name imported from a package of ours is defined in that package: no package passes on
    another's name (config handing out methods' METHODS), so the layer map's arrows are the real ones."""
    found = reexports(our_sources())
    assert not found, "names re-exported across packages; import each from its own package:\n" + "\n".join(found)


def test_reexport_checker_refuses_a_name_passed_on_from_another_package():
    """A name another package defines, passed on through a package's __init__ and one of its modules,
    is refused; a package's own names through its __init__, a submodule and a foreign name are not."""
    sources = {
        "methods/__init__.py": "from .registry import METHODS\n",
        "methods/registry.py": "METHODS = {}\n",
        "config/__init__.py": "from .run import METHODS, RunSpec\nfrom . import run\n",
        "config/run.py": "from ..methods import METHODS\nfrom torch import Tensor\nclass RunSpec: ...\n",
        "cli/a.py": "from ..config import RunSpec, run\nfrom ..config.run import Tensor\n"
        "def f():\n    from ..config import METHODS\n",
        "cli/b.py": "from ..methods import METHODS\n",
    }
    assert reexports(sources) == [
        "sbpbench/cli/a.py:4: imports METHODS from sbpbench.config, which takes it from sbpbench.methods.registry",
        "sbpbench/config/__init__.py:1: imports METHODS from sbpbench.config.run, which takes it from sbpbench.methods.registry",
    ]


CORE_ROOMS_MAX = 24  # core/ read at a glance: its top files and folders


def core_rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph of sbpbench.core with each top-level module and each subpackage as one
    room ("sbpbench.core.placements.placement" -> "placements"), edges between rooms only."""
    prefix = f"{ROOT}.core."

    def room(module: str) -> str | None:
        return module[len(prefix) :].split(".")[0] if module.startswith(prefix) else None

    rooms: dict[str, set[str]] = {}
    for module, imported in graph.items():
        source = room(module)
        if source is None:
            continue
        rooms.setdefault(source, set())
        rooms[source] |= {r for r in map(room, imported) if r is not None and r != source}
    return rooms


def test_core_is_a_few_rooms_with_imports_running_one_way():
    """core/ as rooms (a top file, or a folder as one): at most CORE_ROOMS_MAX of them, and no two
    rooms importing each other however indirectly, so a folder never reaches back up into the
    algorithm that uses it."""
    rooms = core_rooms(import_graph(our_sources()))
    assert len(rooms) <= CORE_ROOMS_MAX, sorted(rooms)
    found = cycles(rooms)
    assert not found, "rooms of core that import each other:\n" + "\n".join(map(" <-> ".join, found))
    bad = {
        "core/stream.py": "from .placements.placement import CheckpointStore\n",
        "core/placements/__init__.py": "",
        "core/placements/placement.py": "from ..stream import stream_backward\n",
    }
    assert cycles(core_rooms(import_graph(bad))) == [["placements", "stream"]]

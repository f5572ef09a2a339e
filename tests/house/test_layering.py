"""The package's layers, read from its sources: what may import what.

Each package may import its own modules and those of the layers below it, never one beside or
above it: so each can be read, tested and hosted (the node's service runs the CPU update outside
the trainer) without what sits above it. docs/architecture.md draws the same table.
"""
from __future__ import annotations

import ast
from pathlib import Path


from helpers import REPO

PACKAGE = REPO / "tiered"

LAYERS = (
    ("core",),
    ("device", "ops"),
    ("tiers",),
    ("policy",),
    ("placement",),
    ("optim",),
    ("planning", "checkpoint", "service"),
    ("engine",),
    ("integrations", "launch"),
)
"""Bottom first. ``tiered/__init__.py`` is the façade above them all."""

RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}

INNER_IMPORTS = {
    ("launch/rank_entry.py", "tiered.device"):
        "the rank imports torch only after the script could set what torch reads at import",
}
"""The imports inside a function, each with why it cannot sit at the top of its module."""


def _package_of(source: Path) -> tuple[str, ...]:
    parts = source.relative_to(PACKAGE.parent).with_suffix("").parts
    return parts if source.name == "__init__.py" else parts[:-1]


def imports_of(source: Path, text: str | None = None) -> list[tuple[str, bool]]:
    """The absolute module names ``source`` (or ``text`` read as it) imports, relative imports
    resolved and a name imported from a package counted as a module too, each with whether the
    import sits at the top of the module."""
    package = _package_of(source)
    tree = ast.parse(source.read_text() if text is None else text)
    at_top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in at_top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((module, id(node) in at_top))
            found += [(f"{module}.{alias.name}", id(node) in at_top) for alias in node.names]
    return found


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "tiered" and len(parts) > 1 and parts[1] in RANK else None


def test_every_package_has_a_layer():
    packages = {path.name for path in PACKAGE.iterdir()
                if path.is_dir() and (path / "__init__.py").exists()}
    assert packages == set(RANK)
    assert [path.name for path in PACKAGE.glob("*.py")] == ["__init__.py"], \
        "a module at the top of tiered/ belongs in one of the layers' packages"


def arrows_back(source: Path, text: str | None = None) -> list[str]:
    """The imports of ``source`` that reach a layer beside or above its own."""
    own = source.relative_to(PACKAGE).parts[0]
    if own not in RANK:
        return []
    return sorted({f"{source.relative_to(PACKAGE)} -> {module}"
                   for module, _ in imports_of(source, text)
                   if (target := _layer_of(module)) not in (None, own)
                   and RANK[target] >= RANK[own]})


def test_no_import_runs_back_up_or_sideways():
    assert [arrow for source in _sources() for arrow in arrows_back(source)] == []


def test_imports_sit_at_the_top_of_their_module():
    """An import inside a function hides a cycle or a cost; the few that must are named."""
    inner = {(str(source.relative_to(PACKAGE)), module)
             for source in _sources() for module, at_top in imports_of(source)
             if not at_top and module.startswith("tiered")}
    assert inner - {(path, module) for path, module in inner
                    if any(path == allowed and module.startswith(name)
                           for allowed, name in INNER_IMPORTS)} == set()


def module_graph() -> dict[str, set[str]]:
    """Each module of tiered, with the modules of tiered it imports (a package's own modules
    importing the package are not counted: that is Python loading the package first)."""
    modules = {}
    for source in _sources():
        parts = source.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if source.name == "__init__.py" else parts)] = source
    return {name: {module for module, _ in imports_of(source)
                   if module in modules and module != name and not name.startswith(module + ".")}
            for name, source in modules.items()}


def first_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as the modules along it, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        for child in sorted(graph[name]):
            if child in path:
                return path[path.index(child):] + [child]
            if child not in done:
                found = visit(child, path + [child])
                if found:
                    return found
        done.add(name)
        return None

    for name in sorted(graph):
        if name not in done and (found := visit(name, [name])):
            return found
    return None


def test_no_cycle_between_modules():
    assert first_cycle(module_graph()) is None


def test_the_import_reader_sees_relative_imports():
    """The checks above would pass vacuously if relative imports were misread."""
    modules = {module for module, _ in imports_of(PACKAGE / "engine" / "gradients.py")}
    assert "tiered.optim.arrival.LastBackward" in modules
    assert "tiered.engine.flat.FlatParam" in modules
    inner = [module for module, at_top in imports_of(PACKAGE / "launch" / "rank_entry.py")
             if not at_top]
    assert "tiered.device" in inner


def test_the_checks_fail_on_a_planted_arrow_back_up_and_a_planted_cycle():
    """They would pass vacuously if they could not see what they forbid."""
    source = PACKAGE / "optim" / "commands.py"
    assert arrows_back(source) == []
    planted = source.read_text() + "\nfrom ..engine.engine import TieredEngine\n"
    assert arrows_back(source, planted) == ["optim/commands.py -> tiered.engine.engine",
                                            "optim/commands.py -> tiered.engine.engine.TieredEngine"]
    graph = module_graph()
    graph["tiered.core.sizes"] = graph["tiered.core.sizes"] | {"tiered.policy.config"}
    cycle = first_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and "tiered.policy.config" in cycle

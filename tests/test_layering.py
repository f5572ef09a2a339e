"""The package's layers, read from its sources: what may import what.

The engine builds the optimizer (engine -> optim); the optimizer must not reach back into the
engine, or neither can be read, tested or hosted (issue 18's service runs the CPU update
outside the trainer) without the other.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tiered"


def imported_modules(source: Path) -> set[str]:
    """The absolute module names ``source`` imports, relative imports resolved."""
    package = source.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_optimizer_imports_nothing_from_the_engine():
    offenders = {str(source.relative_to(PACKAGE.parent)): sorted(
                     name for name in imported_modules(source)
                     if name == "tiered.engine" or name.startswith("tiered.engine."))
                 for source in sorted((PACKAGE / "optim").glob("*.py"))}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_import_reader_sees_relative_imports():
    """The check above would pass vacuously if relative imports were misread."""
    names = imported_modules(PACKAGE / "engine" / "gradients.py")
    assert "tiered.optim.arrival.LastBackward" in names
    assert "tiered.engine.flat.FlatParam" in names

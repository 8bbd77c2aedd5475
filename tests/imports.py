"""What a module of this project imports, read from its source (ast): for dvc.yaml's deps and the library's
import directions."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT


def module_file(name: str) -> Path | None:
    """The file of module ``name`` in this project (a package's ``__init__.py``), or None if it is not
    ours."""
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_names(path: Path, name: str) -> set[str]:
    """Every module name ``path`` (the module ``name``) may import, anywhere in its code, with their packages.
    ``from a import b`` also names ``a.b``, which is a module where ``b`` is a submodule."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is this package, each more level one package up
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    # importing a.b.c runs a/__init__.py and a/b/__init__.py first
    return {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}


def import_closure(module: str) -> set[str]:
    """The project files ``python -m module`` runs: its module, its packages, and all they import,
    transitively."""
    todo = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)]
    seen: dict[str, Path] = {}
    while todo:
        name = todo.pop()
        path = module_file(name)
        if name in seen or path is None:
            continue
        seen[name] = path
        todo.extend(imported_names(path, name))
    return {path.relative_to(ROOT).as_posix() for path in seen.values()}

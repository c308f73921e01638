"""The package's floors: no module imports a higher one, and no import cycle anywhere in gear_mpi.

Every ``import``/``from ... import`` of a gear_mpi module is read from the source
(module level and inside functions alike), so a lazy import cannot hide an upward
dependency. The floors are those of the README's module map; a new module must be
given one here.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gear_mpi"

# module (dotted, relative to gear_mpi) -> floor; a package's floor covers its submodules
FLOORS = {
    "errors": 0, "spec": 0, "keys": 0, "cuda_support": 0, "stats": 0, "deadline": 0, "progress": 0,
    "rate_limit": 0,
    "kernels": 1, "memory": 1, "page_collapse": 1, "file_memory": 1, "batch": 1, "comm": 1, "comm_torch": 1, "device": 1, "pinned": 1, "staging": 1,
    "budget": 2,
    "priority_index": 2, "selectors": 2, "storage": 2, "store_insert": 2, "table_layout": 2, "windows": 2,
    "writer": 2, "ingest": 2, "remote": 3,
    "shard": 3, "shard_state": 3, "shard_insert": 3,
    "checkpoint": 4, "warmup": 4,
    "node": 5, "transport": 5, "plans": 5, "routing": 5, "replay_state": 5, "feeds": 5, "prefetch": 5,
    "parallel": 5, "activity": 5,
    "replay": 6,
    "datasets": 7,  # builds Replays; gear_mpi/__init__.py re-exports the package
    "": 7,  # gear_mpi/__init__.py
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def floor_of(module: str) -> int:
    head = module.split(".")[0]
    if head not in FLOORS:
        raise KeyError(f"gear_mpi.{module} has no floor: add it to tests/test_layers.py and the README's module map")
    return FLOORS[head]


def imported_modules(path: Path) -> set[str]:
    """gear_mpi modules imported anywhere in ``path`` (dotted, relative to gear_mpi)."""
    me = module_name(path)
    parts = me.split(".") if me else []
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "gear_mpi" or node.module.startswith("gear_mpi.")):
                target = node.module[len("gear_mpi."):] if node.module != "gear_mpi" else ""
            else:
                continue
            names = [a.name for a in node.names]
            # "from . import x" / "from .kernels import ring": the names may be modules themselves
            for n in names:
                candidate = f"{target}.{n}" if target else n
                if (PACKAGE / Path(*candidate.split("."))).with_suffix(".py").exists() or \
                        (PACKAGE / Path(*candidate.split("."))).is_dir():
                    found.add(candidate)
                    break
            else:
                found.add(target)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("gear_mpi."):
                    found.add(a.name[len("gear_mpi."):])
    found.discard(me)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): imported_modules(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_floor():
    for m in graph():
        floor_of(m)


def test_no_module_imports_a_higher_floor():
    upward = []
    for m, deps in graph().items():
        for d in deps:
            if floor_of(d) > floor_of(m):
                upward.append(f"gear_mpi.{m} (floor {floor_of(m)}) imports gear_mpi.{d} (floor {floor_of(d)})")
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    g = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(g.get(m, ())):
            # a submodule importing its own package's __init__ is how relative imports read; not a cycle
            if m.startswith(d + ".") or d not in g:
                continue
            if state.get(d) == 1:
                cycle = path[path.index(d):] + [d]
                pytest.fail("import cycle: " + " -> ".join(f"gear_mpi.{x}" for x in cycle))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in g:
        if m not in state:
            visit(m)


def test_no_module_is_long():
    long = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 460]
    assert not long, long

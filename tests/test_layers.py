"""The package's floors: no module imports a higher one, and no import cycle anywhere in gear_mpi.

Every ``import``/``from ... import`` of a gear_mpi module is read from the source
(module level and inside functions alike), so a lazy import cannot hide an upward
dependency. The floors are those of the module map in docs/architecture.md; a new module must be
given one here. Tests, scripts and examples reach the library the way users do: through
``gear_mpi`` or one of its sub-packages, never a module inside a sub-package.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gear_mpi"

# module (dotted, relative to gear_mpi) -> floor; the longest entry that is a prefix of a module's name gives its
# floor, so a sub-package's floor covers its submodules except those named on their own
FLOORS = {
    # the top: the data model every layer shares, and the two objects users build
    "errors": 0, "batch_memory": 0, "spec": 0, "frames": 0, "keys": 0, "progress": 0, "threads": 0,
    "batch": 1,
    "stats": 2,
    "shard": 3,
    "warmup": 4,
    "replay": 6,
    "": 7,  # gear_mpi/__init__.py
    # kernels/: pure numba kernels (cuda_support: the one place that asks numba-cuda about the machine)
    "kernels": 1, "kernels.cuda_support": 0,
    # storage/: arenas first, then the store over them
    "storage": 2, "storage.arenas": 1, "storage.file_arenas": 1, "storage.file_guard": 1, "storage.chunk_heap": 1, "storage.huge_pages": 1,
    "storage.shared_pages": 1,
    "storage.pinned": 1,
    "storage.device": 1,
    # selection/: selectors and priority indexes
    "selection": 2,
    # feeds/: writers (no MPI) up to the replay's part that runs them
    "feeds": 2, "feeds.rate_limit": 0, "feeds.staging": 1, "feeds.remote": 3, "feeds.replay_feeds": 5,
    # distributed/: the communicator layer low, the protocols over shards high
    "distributed": 5, "distributed.deadline": 0, "distributed.comm": 1, "distributed.calls": 1,
    "distributed.torch_comm": 1,
    # checkpoint/: a shard's state exporter low, the files and protocol above the shard, the replay's on top
    "checkpoint": 4, "checkpoint.shard_state": 2, "checkpoint.replay_state": 5,
    "datasets": 7,  # builds Replays; gear_mpi/__init__.py re-exports the package
    # integrations/: adapters to RL frameworks, over everything (imported by name: the package imports nothing)
    "integrations": 8,
}
#: no module of gear_mpi passes this many lines: one concept per module, as long as it needs to be
MAX_LINES = 800


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def floor_of(module: str) -> int:
    parts = module.split(".") if module else []
    for i in range(len(parts), -1, -1):
        head = ".".join(parts[:i])
        if head in FLOORS and (i or not module):
            return FLOORS[head]
    raise KeyError(f"gear_mpi.{module} has no floor: add it to tests/test_layers.py (and docs/architecture.md)")


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
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, long


def _outside_imports():
    root = PACKAGE.parent
    for top in ("tests", "scripts", "examples", "docs"):
        for path in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    yield path.relative_to(root), node.lineno, node.module
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        yield path.relative_to(root), node.lineno, a.name


def _framework_adapter(module: str) -> bool:
    """``gear_mpi.integrations.<framework>``: an adapter module is public by name (its package stays light and
    imports no framework, so users import the adapter itself, e.g. ``gear_mpi.integrations.sb3``)."""
    parts = module.split(".")
    return len(parts) == 3 and parts[1] == "integrations"


def test_tests_scripts_and_examples_import_only_public_paths():
    """``gear_mpi``, a top module (``gear_mpi.keys``) or a sub-package (``gear_mpi.storage``, from which its
    modules and re-exported names are imported), never ``gear_mpi.storage.arenas``."""
    deep = [f"{path}:{line}: {module}" for path, line, module in _outside_imports()
            if module.startswith("gear_mpi.") and module.count(".") > 1 and not _framework_adapter(module)]
    assert not deep, "import through the sub-package instead:\n" + "\n".join(deep)


def test_shard_is_composed_not_mixed():
    """No class in gear_mpi/shard.py has base classes: a shard builds its parts and calls them explicitly."""
    tree = ast.parse((PACKAGE / "shard.py").read_text())
    based = [f"{node.name}({', '.join(ast.unparse(b) for b in node.bases + node.keywords)})"
             for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and (node.bases or node.keywords)]
    assert not based, based


def test_no_storage_function_takes_a_store_first():
    """No module-level function of gear_mpi/storage takes a parameter named ``store`` first: what works on a
    store's fields is a method of the store (or of a part it holds), not a function in exile."""
    exiled = []
    for path in sorted((PACKAGE / "storage").rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = node.args.posonlyargs + node.args.args
                if params and params[0].arg == "store":
                    exiled.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.name}")
    assert not exiled, exiled


def test_replay_inherits_nothing():
    """``Replay`` builds its parts (feeds, prefetch, activity, checkpoint state) and calls them by name: a
    reader follows a call from ``Replay.sample`` down to the kernels without searching base classes."""
    tree = ast.parse((PACKAGE / "replay.py").read_text())
    classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    assert any(c.name == "Replay" for c in classes)
    based = [f"{c.name}({', '.join(ast.unparse(b) for b in c.bases + c.keywords)})" for c in classes
             if c.bases or c.keywords]
    assert not based, f"classes of gear_mpi/replay.py with base classes: {based}"

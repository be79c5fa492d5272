"""The package's imports flow one way: no module of `ldm` reaches, at any depth, back to itself.

Every `import` / `from ... import` of an `ldm` module counts, inside functions too, so a cycle
cannot hide behind a late import. Relative imports are resolved against the importing module.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ldm"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def ldm_imports(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The `ldm` modules that module `name` imports anywhere in `source`, functions included."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules}
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f) for f in files}
    return {module_name(f): ldm_imports(f.read_text(), module_name(f), f.name == "__init__.py", modules) for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_check_sees_late_and_relative_imports():
    """The check itself: imports inside functions and relative ones count, and a cycle through them is found."""
    modules = {"ldm.a", "ldm.b", "ldm.c", "ldm.c.d"}
    late = "import os\n\ndef f():\n    from ldm.b import thing\n    import ldm.c\n"
    assert ldm_imports(late, "ldm.a", False, modules) == {"ldm.b", "ldm.c"}
    assert ldm_imports("from .d import x\nfrom . import d\n", "ldm.c", True, modules) == {"ldm.c.d"}
    assert ldm_imports("from ..a import y\n", "ldm.c.d", False, modules) == {"ldm.a"}
    graph = {"ldm.a": {"ldm.b"}, "ldm.b": {"ldm.c"}, "ldm.c": {"ldm.a"}, "ldm.d": set()}
    assert find_cycle(graph) == ["ldm.a", "ldm.b", "ldm.c", "ldm.a"]
    assert find_cycle({"ldm.a": {"ldm.b"}, "ldm.b": set()}) is None


# The floors of the package, as docs/development.md ("Layout") draws them: a module imports only from its own
# package or from lower floors.
FLOORS = {
    "ldm": 0,
    "ldm.config": 1,
    "ldm.utils": 1,
    "ldm.diffusion": 1,
    "ldm.families": 2,
    "ldm.components": 3,
    "ldm.backbones": 4,
    "ldm.pipelines": 5,
    "ldm.systems": 5,
    "ldm.data": 5,
    "ldm.sampling": 6,
    "ldm.weights": 7,
    "ldm.training": 8,
    "ldm.export": 9,
    "ldm.models": 9,
    "ldm.ui": 10,
    "ldm.cli": 11,
}


def floor_of(module: str) -> tuple[str, int]:
    package = ".".join(module.split(".")[:2])
    assert package in FLOORS, f"{module}: a package without a floor; add it to FLOORS and to docs/development.md"
    return package, FLOORS[package]


def test_imports_go_down_the_floors():
    wrong = []
    for module, imported in import_graph().items():
        package, floor = floor_of(module)
        for other in imported:
            other_package, other_floor = floor_of(other)
            if other_package != package and other_floor >= floor:
                wrong.append(f"{module} (floor {floor}) imports {other} (floor {other_floor})")
    assert not wrong, "\n".join(wrong)


def test_modules_stay_small():
    """One concept per file: no module of the package is over about 400 lines."""
    long = {module_name(f): n for f in PACKAGE.rglob("*.py") if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_one_module_imports_colossalai():
    importers = [
        module_name(f)
        for f in PACKAGE.rglob("*.py")
        if any(
            isinstance(n, (ast.Import, ast.ImportFrom))
            and any((a.name if isinstance(n, ast.Import) else n.module or "").startswith("colossalai") for a in n.names)
            for n in ast.walk(ast.parse(f.read_text()))
        )
    ]
    assert importers == ["ldm.training.strategies.colossal"]

"""No circle among the engine's modules: no module imports, at module level or inside a function,
one that imports it back, directly or through others. A piece two modules both need lives in a
module of its own (costs.py, gate/verdict.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import circles, module_name   # tests/ is on sys.path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "engine"
PACKAGE = "specpair"


def imported(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules one import statement loads by name (`from a import b` loads a.b when
    b is a module, else a)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = importer.split(".") if is_package else importer.split(".")[:-1]
            anchor = package[:len(package) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:      # `import a.b.c` where c is not a module of ours
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p, PACKAGE_ROOT): p for p in (PACKAGE_ROOT / PACKAGE).rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= imported(node, name, path.name == "__init__.py", modules)
        graph[name] = edges - {name}
    return graph


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "specpair.server.cli" in graph["specpair.cli"]     # imported inside a function only
    assert "specpair.cpu_kernels" in graph["specpair.kv.runner"]    # `from specpair import x`


def test_no_module_imports_one_that_imports_it_back():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)

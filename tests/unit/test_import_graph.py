"""The layout's rules (docs/design.md, "Layout"), read from the source's import statements, lazy ones included:
models/ imports neither harness/ nor parallel/ nor torch.distributed, parallel/ does not import harness/, and no
module imports itself back through others."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "models", "parallel")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every module (of ours, or any other by its full name) that `path` imports, at any depth of the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules)
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for package in PACKAGES for p in (REPO / package).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) for p in files}


def test_models_and_parallel_import_only_downward():
    for module, imported in _graph().items():
        if module.startswith("models"):
            bad = {m for m in imported if m.startswith(("harness", "parallel", "torch.distributed"))}
            assert not bad, (module, bad)
        if module.startswith("parallel"):
            assert not {m for m in imported if m.startswith("harness")}, module


def test_no_module_imports_itself_back():
    graph = _graph()
    ours = {m: {i for i in imported if i in graph and i != m} for m, imported in graph.items()}
    # A package's __init__ re-exporting its modules is not a cycle of their code.
    ours = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in ours.items()}
    state, cycles = {}, []

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(ours[module]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [module, dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(ours):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles

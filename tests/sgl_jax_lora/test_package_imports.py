"""The package's module-level imports form no cycle: a reader can follow the modules in one direction (a cycle
would also make the import order decide which names exist). Imports inside functions are left out: they run late,
after every module has loaded."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO_ROOT

PACKAGE = Path(REPO_ROOT) / "sgl_jax_lora"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports at module level (a `from pkg import name` counts pkg.name when
    that is a module, else pkg)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sgl_jax_lora"):
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    deps.add(submodule if submodule in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("sgl_jax_lora"))
        graph[name] = {d for d in deps if d in modules and d != name and d != "sgl_jax_lora"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, path + [dep])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = module_imports()
    assert len(graph) > 100 and graph["sgl_jax_lora.managers.engine_core"]  # the scan sees the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None

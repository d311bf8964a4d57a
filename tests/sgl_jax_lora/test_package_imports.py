"""The package's module-level imports form no cycle: a reader can follow the modules in one direction (a cycle
would also make the import order decide which names exist). Imports inside functions are left out: they run late,
after every module has loaded.

The same holds one level up: the subpackages (and the package's top-level modules) stand in the order of LAYERS,
bottom to top, the order a request's data takes from the sampled token back up to the HTTP route
(docs/architecture.md "Package layers"), and each imports only those at or below it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO_ROOT

PACKAGE = Path(REPO_ROOT) / "sgl_jax_lora"

# The package's subpackages and top-level modules, bottom to top: each imports (at module level) only those at or
# below it. A new subpackage or top-level module takes its place here.
LAYERS = [
    "utils",  # start-up helpers: quiet platform probes, compile progress, keyed locks
    "demo",  # the embedded demo corpus and tokenizer (data shipped in the package)
    "demo_model",  # the embedded demo model's files
    "server_args",  # every setting, one dataclass
    "server_args_checks",  # the settings' checks (ServerArgs.validate calls them)
    "configs",  # ModelConfig, the compiled buckets
    "layers",  # sharding, linears, norm, rotary, paged attention, weight layout
    "mem_cache",  # KV cache, page allocator, prefix cache
    "lora",  # adapters (files, host cache, slot table), LoRA linears and backends, LoRASetup
    "models",  # ForwardBatch, the Llama family, weight loading
    "sampling",  # sampling params, the sampler, logit adjustments
    "model_executor",  # ModelRunner: the compiled forward, logits and sampling programs
    "distributed",  # multi-host: the leader's runner, followers
    "managers",  # engine process (EngineCore, scheduler, LoRAManager) and frontend (TokenizerManager)
    "entrypoints",  # HTTP routes
    "engine",  # the offline Engine
    "launch",  # the server's command line
    "convert",  # the checkpoint converter's command line
    "train",  # LoRA fine-tuning on the serving model
    "sgl_jax_lora",  # the package itself (Engine and ServerArgs, resolved lazily)
]


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


def unit_of(module: str) -> str:
    """sgl_jax_lora.managers.scheduler -> managers; sgl_jax_lora.engine -> engine; sgl_jax_lora -> sgl_jax_lora."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def unit_imports(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(unit A, unit B) -> the module-level imports by which a module of A imports one of B (A != B)."""
    edges: dict[tuple[str, str], list[str]] = {}
    for module in sorted(graph):
        for dep in sorted(graph[module]):
            if unit_of(module) != unit_of(dep):
                edges.setdefault((unit_of(module), unit_of(dep)), []).append(f"{module} imports {dep}")
    return edges


def upward_imports(graph: dict[str, set[str]], layers: list[str]) -> list[str]:
    """The module-level imports of a unit that sits below the one it imports from."""
    rank = {unit: i for i, unit in enumerate(layers)}
    return [
        f"{how} ({a} sits below {b} in LAYERS)"
        for (a, b), hows in unit_imports(graph).items()
        if rank[a] < rank[b]
        for how in hows
    ]


def test_the_subpackages_have_no_import_cycle():
    edges = unit_imports(module_imports())
    cycle = find_cycle({unit: {b for a, b in edges if a == unit} for unit in {a for pair in edges for a in pair}})
    steps = [edges[pair][0] for pair in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, " -> ".join(cycle) + ": " + "; ".join(steps)


def test_each_subpackage_imports_only_those_below_it():
    graph = module_imports()
    units = {unit_of(m) for m in graph}
    assert units == set(LAYERS), f"place {sorted(units - set(LAYERS))} in LAYERS; drop {sorted(set(LAYERS) - units)}"
    upward = upward_imports(graph, LAYERS)
    assert not upward, "imports against the order of LAYERS:\n" + "\n".join(upward)


def test_the_order_check_names_the_upward_import():
    graph = {"pkg.low.a": {"pkg.high.b"}, "pkg.high.b": set(), "pkg.high.c": {"pkg.low.a"}}
    assert upward_imports(graph, ["low", "high"]) == ["pkg.low.a imports pkg.high.b (low sits below high in LAYERS)"]
    assert upward_imports(graph, ["high", "low"]) == ["pkg.high.c imports pkg.low.a (high sits below low in LAYERS)"]

"""The package stays readable in pieces: no module over 400 lines, no function over 60 (the Pallas kernels live in
pallas_kernels/, outside the package, and may be longer)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO_ROOT

PACKAGE = Path(REPO_ROOT) / "sgl_jax_lora"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def long_modules_and_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(root.parent)
        if source.count("\n") > MAX_MODULE_LINES:
            found.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_or_function_of_the_package_is_too_long():
    assert len(list(PACKAGE.rglob("*.py"))) > 100  # the scan sees the package
    assert long_modules_and_functions(PACKAGE) == []


def test_the_check_finds_a_long_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (package / "long.py").write_text(f"def too_long():\n{body}\n")
    (package / "short.py").write_text("def fine():\n    return 1\n")
    assert long_modules_and_functions(package) == [f"pkg/long.py:1 too_long: {MAX_FUNCTION_LINES + 1} lines"]

"""Module docstrings name code that exists: every `ClassName.attr` in the docstring of a module of
sgl_jax_lora/ or pallas_kernels/, where ClassName is a class defined in those packages, names a method,
property, field or attribute of that class (or of a base class defined there).

Only dotted references to the packages' own classes are checked, so prose and other libraries' names
(`jax.Array`, `np.int32`) cannot trip it. The names are read with `ast`, without importing anything.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

from tests.support import REPO_ROOT

REPO = REPO_ROOT
PACKAGES = ("sgl_jax_lora", "pallas_kernels")
REFERENCE = re.compile(r"\b([A-Z][A-Za-z0-9]*)\.([A-Za-z_][A-Za-z0-9_]*)")


def python_files() -> list[str]:
    files = []
    for package in PACKAGES:
        for root, _, names in os.walk(os.path.join(REPO, package)):
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    return sorted(files)


def class_attributes(node: ast.ClassDef) -> set[str]:
    """Methods, class-level names, annotated fields, nested classes and every `self.x` assigned in a method."""
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
            if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                names.add(sub.attr)
    return names


def package_classes() -> dict[str, tuple[set[str], list[str]]]:
    """class name -> (its attributes, the names of its bases); a name defined twice merges both."""
    classes: dict[str, tuple[set[str], list[str]]] = {}
    for path in python_files():
        with open(path) as f:
            tree = ast.parse(f.read(), filename=path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                attrs, bases = classes.setdefault(node.name, (set(), []))
                attrs.update(class_attributes(node))
                bases += [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
    return classes


def has_attribute(classes: dict, name: str, attr: str, seen: frozenset = frozenset()) -> bool:
    if name not in classes or name in seen:
        return False
    attrs, bases = classes[name]
    if attr in attrs:
        return True
    if any(b not in classes for b in bases if b not in ("object", "")):
        return True  # a base from outside the packages (NamedTuple, Exception, ...) may define it
    return any(has_attribute(classes, b, attr, seen | {name}) for b in bases)


CLASSES = package_classes()


def module_docstring(path: str) -> str:
    with open(path) as f:
        return ast.get_docstring(ast.parse(f.read(), filename=path)) or ""


def test_the_checker_sees_the_packages_classes():
    assert has_attribute(CLASSES, "ServerArgs", "from_kwargs")
    assert not has_attribute(CLASSES, "ServerArgs", "no_such_method")
    assert len([p for p in python_files() if module_docstring(p)]) > 50


@pytest.mark.parametrize("path", python_files(), ids=lambda p: os.path.relpath(p, REPO))
def test_module_docstring_names_existing_code(path):
    missing = [
        f"{cls}.{attr}"
        for cls, attr in REFERENCE.findall(module_docstring(path))
        if cls in CLASSES and not has_attribute(CLASSES, cls, attr)
    ]
    assert not missing, (
        f"{os.path.relpath(path, REPO)}: its docstring names {missing}, which do not exist; name what the code has now"
    )

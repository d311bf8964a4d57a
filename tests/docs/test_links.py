"""Docs point only at what exists in this repository: every markdown link of README.md, docs/ and tpu_configs/
names a file inside the repository (and, with `#anchor`, one of its headings); every section a doc, a docstring or
a comment names as `docs/FILE.md "Section"` is a heading of that file; and no work-log identifiers (sessions,
issues, run ids) appear in the docs, scripts, tests or package.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

from tests.support import REPO_ROOT

REPO = REPO_ROOT
MARKDOWN = sorted(
    [
        os.path.join(REPO, "README.md"),
        *glob.glob(os.path.join(REPO, "docs", "*.md")),
        *glob.glob(os.path.join(REPO, "tpu_configs", "*.md")),
    ]
)
SOURCES = sorted(
    p
    for d in ("sgl_jax_lora", "pallas_kernels", "scripts", "tests")
    for p in glob.glob(os.path.join(REPO, d, "**", "*.py"), recursive=True)
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SECTION_REF = re.compile(r'((?:docs/)?[a-z_]+\.md)[,:]? \(?"([^"]+)"')
WORK_LOG = re.compile(r"session [0-9]|sessions [0-9]|\bS[0-9]+-D[0-9]+|\bS-D[0-9]|issue [0-9]|issues [0-9]", re.I)
# Files that other engineers are rewriting, whose stale section names and work-log words the lead replaces (the
# replacement text is in the branch's report). Remove a file once it is fixed; the tests then hold it.
PENDING_ELSEWHERE: set[str] = set()


def rel(path: str) -> str:
    return os.path.relpath(path, REPO)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(path: str) -> list[str]:
    text = re.sub(r"```.*?```", "", read(path), flags=re.S)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)]


def has_section(path: str, section: str) -> bool:
    """A heading named `section`, or `section (qualifier)`."""
    return any(h == section or h.startswith(section + " (") for h in headings(path))


def doc_path(name: str) -> str:
    return os.path.join(REPO, name if name.startswith("docs/") or name == "README.md" else os.path.join("docs", name))


def test_slug_follows_github():
    assert slug("HF transformers + PEFT baseline") == "hf-transformers--peft-baseline"
    assert slug("POST /v1/completions") == "post-v1completions"


@pytest.mark.parametrize("path", MARKDOWN, ids=rel)
def test_links_stay_in_the_repository_and_find_their_target(path):
    broken = []
    for target in LINK.findall(read(path)):
        if target.startswith(("http://", "https://", "mailto:")):
            broken.append(f"{target}: a link outside the repository")
            continue
        file_part, _, anchor = target.partition("#")
        resolved = os.path.realpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not resolved.startswith(REPO + os.sep) or not os.path.exists(resolved):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and anchor not in {slug(h) for h in headings(resolved)}:
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{rel(path)}: {broken}"


@pytest.mark.parametrize("path", MARKDOWN + SOURCES, ids=rel)
def test_named_sections_exist(path):
    missing = []
    for name, section in SECTION_REF.findall(read(path)):
        section = " ".join(section.split())  # a reference may wrap across lines
        target = doc_path(name)
        if not os.path.exists(target):
            missing.append(f'{name} "{section}": no such doc')
        elif not has_section(target, section) and rel(path) not in PENDING_ELSEWHERE:
            missing.append(f'{name} "{section}": no such heading')
    assert not missing, f"{rel(path)}: {missing}"


@pytest.mark.parametrize("path", MARKDOWN + SOURCES, ids=rel)
def test_no_work_log_identifiers(path):
    if rel(path) in PENDING_ELSEWHERE:
        return
    found = [m.group(0) for m in WORK_LOG.finditer(read(path))]
    assert not found, f"{rel(path)} reads as a work log ({found}); say what the code does now, history is in git"

"""The open-file limit the server raises at its start (utils/open_files.py), in a child process whose soft limit
was lowered first, so this process keeps its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

resource = pytest.importorskip("resource")

CHILD = """
import json, resource
from sgl_jax_lora.utils.open_files import raise_open_file_limit
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
print(json.dumps([raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE), hard]))
"""


def test_the_soft_limit_is_raised_to_the_hard_one():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    (before, after), (soft, hard_now), hard = json.loads(out)
    assert before == 256 and after == soft and hard_now == hard
    if hard != resource.RLIM_INFINITY:
        assert soft == hard
    else:
        assert soft >= 256


def test_a_soft_limit_at_the_hard_one_is_left_as_it_is():
    child = CHILD.replace("(256, hard)", "(hard, hard)")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
    (before, after), (soft, _), hard = json.loads(out)
    if hard != resource.RLIM_INFINITY:
        assert before == after == soft == hard

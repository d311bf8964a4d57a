"""scripts/gil_profile.py: a py-spy raw profile summed per process and thread (a pool's threads together), its
samples turned into seconds at the rate, and each thread's lines that took the most."""

from __future__ import annotations

import json
import subprocess
import sys

from scripts.gil_profile import parse_line, summarize
from tests.support import REPO_ROOT

RAW = [
    'process 7:"python3 serve.py";thread (0x1): MainThread;main (serve.py:10);step (/a/engine.py:20) 30\n',
    'process 7:"python3 serve.py";thread (0x2): lora-prefetch_0;run (/a/pool.py:5);zeros (/a/pool.py:86) 12\n',
    'process 7:"python3 serve.py";thread (0x3): lora-prefetch_1;run (/a/pool.py:5);zeros (/a/pool.py:86) 8\n',
    'process 7:"python3 serve.py";thread (0x3): lora-prefetch_1;run (/a/pool.py:5);parse (/a/json.py:3) 5\n',
    "\n",
]


def test_threads_of_a_pool_count_together_and_lines_rank_by_samples():
    summary = summarize(RAW, rate=100, top=5, depth=1)
    assert summary["total_samples"] == 55
    main, pool = summary["threads"]
    assert (main["thread"], main["samples"], main["seconds"]) == ("MainThread", 30, 0.3)
    assert (pool["process"], pool["thread"], pool["samples"]) == ("process 7", "lora-prefetch_N", 25)
    assert pool["top"] == [
        {"frames": "zeros (pool.py:86)", "samples": 20},
        {"frames": "parse (json.py:3)", "samples": 5},
    ]
    deeper = summarize(RAW, rate=100, top=5, depth=2)["threads"][1]["top"][0]["frames"]
    assert deeper == "run (pool.py:5);zeros (pool.py:86)"
    assert parse_line("\n") is None


def test_the_command_writes_the_summary(tmp_path):
    profile, out = tmp_path / "gil.txt", tmp_path / "gil.json"
    profile.write_text("".join(RAW))
    cmd = [sys.executable, "scripts/gil_profile.py", str(profile), "--rate", "200", "--out", str(out)]
    printed = subprocess.run(cmd, cwd=REPO_ROOT, check=True, timeout=60, capture_output=True, text=True).stdout
    assert "lora-prefetch_N: 25 samples (0.12 s)" in printed
    assert json.loads(out.read_text())["threads"][0]["seconds"] == 0.15

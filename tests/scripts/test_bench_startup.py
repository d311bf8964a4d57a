"""scripts/bench_startup.py on the demo model (CPU, fp32, small buckets): one fresh process per run, each
reporting its warmup time and the programs it lowered, the same count whatever the compile threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sgl_jax_lora.demo_model import demo_model_path
from tests.support import REPO_ROOT

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

ROOT = REPO_ROOT


def test_serial_and_threaded_warmups_lower_the_same_programs(tmp_path):
    out = tmp_path / "startup.json"
    engine_flags = [
        "--model-path",
        demo_model_path(),
        "--dtype",
        "float32",
        "--context-length",
        "256",
        "--max-running-requests",
        "8",
        "--chunked-prefill-size",
        "32",
        "--token-buckets",
        "16",
        "32",
    ]
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench_startup.py"),
            "--threads",
            "1,2",
            "--out",
            str(out),
            "--",
            *engine_flags,
        ],
        check=True,
        cwd=ROOT,
        timeout=600,
    )
    runs = json.loads(out.read_text())["runs"]
    assert [r["threads"] for r in runs] == [1, 2]
    assert all(r["warmup_s"] > 0 for r in runs)
    assert runs[0]["programs_lowered"] == runs[1]["programs_lowered"] > 10

"""scripts/bench_startup_orbax.py on its tiny preset (CPU): it writes a sharded bf16 HF directory, converts it, loads
both in fresh processes, and the two paths load the same weights (their position-weighted checksums agree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

# slow: a minute or more of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

ROOT = REPO_ROOT


def test_tiny_run_times_both_paths_on_the_same_weights_and_cleans_up(tmp_path):
    out = tmp_path / "startup_orbax.json"
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench_startup_orbax.py"),
            "--preset",
            "tiny",
            "--repeats",
            "1",
            "--caches",
            "warm",
            "--num-shards",
            "2",
            "--work-dir",
            str(work),
            "--out",
            str(out),
        ],
        check=True,
        cwd=ROOT,
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert result["checksums_agree"]
    assert [(r["path"], r["cache"]) for r in result["runs"]] == [("hf", "warm"), ("orbax", "warm")]
    assert all(r["total_s"] > r["load_s"] > 0 for r in result["runs"])
    assert set(result["summary"]["warm"]) == {"hf_total_s", "orbax_total_s", "orbax_over_hf"}
    assert result["hf_dir_bytes"] > result["weight_bytes"] > 0 and result["orbax_dir_bytes"] > 0
    assert os.listdir(work) == []

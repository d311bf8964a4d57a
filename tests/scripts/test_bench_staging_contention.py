"""scripts/bench_staging_contention.py: the emulated engine loop alone, beside staging threads copying at once and
taking turns, on CPU with a tiny Llama's slot arrays and small matmuls: every mode reported, with its staged copies."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import REPO_ROOT
from tests.support.model_fixtures import make_hf_model_dir


def test_reports_the_loop_alone_and_beside_concurrent_and_serial_staging(tmp_path):
    base = make_hf_model_dir(tmp_path / "base", "llama", seed=3)
    out = tmp_path / "staging.json"
    cmd = [sys.executable, "scripts/bench_staging_contention.py", "--model", str(base), "--rank", "4"]
    cmd += ["--threads", "2", "--seconds", "0.3", "--matmuls", "2", "--matmul-size", "64", "--out", str(out)]
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    result = json.loads(out.read_text())
    assert result["threads"] == 2 and result["adapter_bytes"] > 0
    for mode in ("none", "concurrent", "serial"):
        loop = result[mode]
        assert loop["steps"] > 1
        for kind in ("dispatch_ms", "wait_ms", "step_ms"):
            assert 0 <= loop[kind]["p50"] <= loop[kind]["max"]
        assert loop["step_ms"]["mean"] >= loop["dispatch_ms"]["mean"]
    for mode in ("concurrent", "serial"):
        assert result[mode]["adapters_staged_per_s"] > 0 and result[mode]["copy_ms"]["p50"] > 0
    assert "copy_ms" not in result["none"]

"""scripts/bench_slot_write.py: the LoRA slot write's dispatch idle and beside a step in flight, on CPU with two layers
and a few slots: every case reported, and the three writes (host, staged, pinned) set the same values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support import REPO_ROOT


def test_reports_every_write_case_and_the_writes_agree(tmp_path):
    out = tmp_path / "slot_write.json"
    cmd = [sys.executable, "scripts/bench_slot_write.py", "--num-layers", "2", "--slots", "5", "--rank", "4"]
    cmd += ["--step-ms", "5", "--matmul-size", "128", "--repeats", "2", "--out", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(cmd, cwd=REPO_ROOT, check=True, timeout=300, env=env)
    result = json.loads(out.read_text())
    assert result["writes_agree"] is True
    medians = result["medians"]
    for source in ("staged", "host", "pinned"):
        for device in ("idle", "busy"):
            case = medians[f"write_{source}_{device}"]
            assert 0 < case["write_dispatch_ms"] <= case["write_ready_ms"] <= case["all_done_ms"]
    for copy in ("staging", "pinning"):
        assert medians[f"{copy}_busy"][f"{copy}_ms"] > 0 and medians[f"{copy}_idle"]["spinner_rate_share"] >= 0
    assert medians["step_alone"]["step_ms"] > 0 and len(result["runs"]["write_host_busy"]) == 2

"""scripts/bench_peft_baseline.py on CPU: a tiny HF model and two adapters written by peft, every group served (a
budget no group reaches), and the report's counts and per-group seconds checked against what was asked."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import REPO_ROOT
from tests.support.model_fixtures import make_hf_model_dir
from tests.support.peft_fixtures import write_peft_adapter


def test_every_group_is_served_and_timed(tmp_path):
    base = make_hf_model_dir(tmp_path / "base", "llama", seed=3)
    for i in range(2):
        write_peft_adapter(base, tmp_path / "adapters" / f"a{i}", seed=10 + i, r=4, target_modules="all-linear")
    out = tmp_path / "peft.json"
    flags = ["--num-requests", "6", "--num-adapters", "2", "--popularity", "distinct", "--input-len", "8"]
    flags += ["--output-len", "3", "--max-batch", "2", "--time-budget", "600", "--device", "cpu", "--out", str(out)]
    cmd = [sys.executable, "scripts/bench_peft_baseline.py", "--model", str(base), "--adapter-dir"]
    subprocess.run([*cmd, str(tmp_path / "adapters"), *flags], cwd=REPO_ROOT, check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["requests_served"] == 6 and result["adapter_groups"] == 2
    assert result["output_tokens"] == 6 * 3  # exactly --output-len new tokens each
    assert len(result["group_seconds"]) == 2 and all(s > 0 for s in result["group_seconds"])
    assert sum(result["group_seconds"]) <= result["duration_s"]
    assert result["warmup_s"] > 0  # the untimed warm-up batch ran
    assert abs(result["output_tok_per_s"] - result["output_tokens"] / result["duration_s"]) < 1e-6

"""scripts/bench_peft_baseline.py on CPU: a tiny HF model and two adapters written by peft, every group served (a
budget no group reaches), and the report's counts and per-group seconds checked against what was asked; with mixed
batches (PEFT's `adapter_names`) each request gets the tokens it gets alone under its adapter's group."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.model_fixtures import make_hf_model_dir
from tests.support.peft_fixtures import write_peft_adapter

FLAGS = ["--num-requests", "6", "--num-adapters", "2", "--input-len", "8", "--output-len", "3", "--max-batch", "2"]
FLAGS += ["--time-budget", "600", "--device", "cpu"]


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_baseline")
    base = make_hf_model_dir(root / "base", "llama", seed=3)
    for i in range(2):
        write_peft_adapter(base, root / "adapters" / f"a{i}", seed=10 + i, r=4, target_modules="all-linear")
    return base, root / "adapters"


def run_baseline(model_and_adapters, out, *flags: str) -> dict:
    base, adapters = model_and_adapters
    cmd = [sys.executable, "scripts/bench_peft_baseline.py", "--model", str(base), "--adapter-dir", str(adapters)]
    subprocess.run([*cmd, *FLAGS, *flags, "--out", str(out)], cwd=REPO_ROOT, check=True, timeout=300)
    return json.loads(out.read_text())


def test_every_group_is_served_and_timed(model_and_adapters, tmp_path):
    result = run_baseline(model_and_adapters, tmp_path / "peft.json", "--popularity", "distinct")
    assert result["batching"] == "per-adapter"
    assert result["requests_served"] == 6 and result["adapter_groups"] == 2
    assert result["output_tokens"] == 6 * 3  # exactly --output-len new tokens each
    assert len(result["group_seconds"]) == 2 and all(s > 0 for s in result["group_seconds"])
    assert sum(result["group_seconds"]) <= result["duration_s"]
    assert abs(result["output_tok_per_s"] - result["output_tokens"] / result["duration_s"]) < 1e-6
    assert result["warmup_s"] > 0  # the untimed warm-up batch ran


def test_mixed_batches_serve_each_request_under_its_own_adapter(model_and_adapters, tmp_path):
    """fp32, greedy: a mixed batch (requests 0 and 1 on adapters 0 and 1 in one generate call) gives each request the
    ids the per-adapter groups give it; with every request on adapter 0, those on adapter 1 differ, so the adapters
    change the tokens and a mixed batch run under one adapter would fail the first check."""

    def run(name: str, *flags: str) -> dict:
        return run_baseline(model_and_adapters, tmp_path / f"{name}.json", "--dtype", "float32", "--record-ids", *flags)

    mixed = run("mixed", "--popularity", "distinct", "--batching", "mixed")
    grouped = run("grouped", "--popularity", "distinct")
    identical = run("identical", "--popularity", "identical")
    assert mixed["batching"] == "mixed" and mixed["requests_served"] == 6
    assert len(mixed["group_seconds"]) == 3  # batches of 2 in arrival order
    assert mixed["output_ids"] == grouped["output_ids"]
    assert all(len(ids) == 3 for ids in mixed["output_ids"].values())
    on_adapter_1 = [str(i) for i in range(1, 6, 2)]  # distinct: request i on adapter i mod 2
    assert any(identical["output_ids"][i] != grouped["output_ids"][i] for i in on_adapter_1)
    assert all(identical["output_ids"][str(i)] == grouped["output_ids"][str(i)] for i in range(0, 6, 2))

"""scripts/simulate_schedule.py: the engine's scheduler over bench_serving.py's workload, without a device."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from scripts.simulate_schedule import build_scheduler, simulate
from tests.support import REPO_ROOT

FLAGS = ["--max-running-requests", "16", "--max-prefill-seqs", "4", "--context-length", "256"]


def run(extra: list[str], num_requests: int = 40):
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(8, 200, num_requests), rng.integers(2, 50, num_requests)
    scheduler, buckets = build_scheduler(FLAGS + extra)
    return simulate(scheduler, buckets, inputs, outputs), inputs, outputs


def test_every_prompt_and_output_token_is_scheduled_once():
    """Prefill tokens are the prompts (no preemption here), and each request's first token comes from the step that
    ends its prefill, the rest from decode rows."""
    result, inputs, outputs = run(["--chunked-prefill-size", "128", "--max-total-tokens", "100000"])
    steps = result["mixed"], result["decode"]
    prefill = sum(kind["tokens"] - kind["decode_rows"] for kind in steps)
    assert result["preemptions"] == 0 and prefill == inputs.sum()
    assert sum(kind["decode_rows"] for kind in steps) == (outputs - 1).sum()
    assert result["mixed"]["mean_tokens"] <= 128 and result["token_buckets"][-1] == 128
    for kind in steps:  # each step counted once, in a compiled bucket that holds its tokens
        assert sum(kind["steps_by_bucket"].values()) == kind["steps"]
        assert set(kind["steps_by_bucket"]) <= set(result["token_buckets"])
        assert sum(b * n for b, n in kind["steps_by_bucket"].items()) == kind["bucket_tokens"] >= kind["tokens"]
        means = kind["mean_tokens_by_bucket"]
        assert set(means) == set(kind["steps_by_bucket"])
        assert sum(means[b] * n for b, n in kind["steps_by_bucket"].items()) == pytest.approx(kind["tokens"])
        buckets = sorted(result["token_buckets"])
        for bucket, mean in means.items():  # each bucket holds the steps too large for the one below it
            below = max((b for b in buckets if b < bucket), default=0)
            assert below < mean <= bucket


def test_a_step_budget_above_the_context_length_fills_steps_above_it():
    """--chunked-prefill-size 1024 with a 256-token context: a step's chunks span several prompts, so mixed steps
    reach past 256 tokens (the budget is not capped at the context)."""
    flags = ["--max-running-requests", "64", "--max-prefill-seqs", "16", "--max-total-tokens", "100000"]
    result, _, _ = run(["--chunked-prefill-size", "1024", *flags])
    assert result["token_buckets"][-1] == 1024 and result["mixed"]["mean_tokens"] > 256


def test_a_small_cache_preempts_and_recomputes():
    roomy, inputs, _ = run(["--chunked-prefill-size", "256", "--max-total-tokens", "100000"])
    tight, _, _ = run(["--chunked-prefill-size", "256", "--max-total-tokens", "1024"])
    assert roomy["preemptions"] == 0 < tight["preemptions"]
    recomputed = sum(kind["tokens"] - kind["decode_rows"] for kind in (tight["mixed"], tight["decode"]))
    assert recomputed > inputs.sum()  # preempted requests prefill again


def test_command_line_writes_json(tmp_path):
    out = tmp_path / "sim.json"
    cmd = [sys.executable, "scripts/simulate_schedule.py", "--num-requests", "30", "--json", str(out), "--"]
    done = subprocess.run(cmd + FLAGS + ["--max-total-tokens", "50000"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "mixed:" in done.stdout and "preemptions:" in done.stdout
    result = json.loads(out.read_text())
    assert result["mixed"]["steps"] > 0 and result["engine_flags"][-1] == "50000"
    missing = subprocess.run(cmd + FLAGS, cwd=REPO_ROOT, capture_output=True, text=True)
    assert missing.returncode != 0 and "--max-total-tokens" in missing.stderr

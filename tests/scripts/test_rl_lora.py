"""scripts/rl_lora.py on the demo model (CPU, fixed seed): the reward rises, and the engine compiles nothing after
its warmup while the adapter is updated every step (the script fails otherwise)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

ROOT = REPO_ROOT


def test_reinforce_raises_the_reward_with_updates_in_place(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "rl_lora.py"),
            "--steps",
            "10",
            "--seed",
            "0",
            "--samples-per-prompt",
            "16",
            "--out-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "engine compilations after warmup: 0" in result.stdout
    assert "sampled by adapter version 10" in result.stdout  # each step sampled from the version the last one pushed
    with open(tmp_path / "reward.csv") as f:
        rewards = [float(row["mean_reward"]) for row in csv.DictReader(f)]
    assert len(rewards) == 10
    # the reward (the fraction of target tokens, at most 1) at least doubles from the untrained policy's first step,
    # and the last three steps are mostly target tokens
    assert sum(rewards[-3:]) / 3 > max(2 * rewards[0], 0.8), rewards
    assert (tmp_path / "reward.png").stat().st_size > 0
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

"""scripts/bench_sampling.py: the logits and sampling programs per sequence bucket, timed on a small vocabulary."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT


def run(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/bench_sampling.py", *flags], cwd=REPO_ROOT, capture_output=True, text=True
    )


def test_every_bucket_and_mode_is_timed_beside_its_floor(tmp_path):
    out = tmp_path / "sampling.json"
    flags = ["--seqs", "4,16", "--hidden", "32", "--vocab", "1000", "--min-seconds", "0.01", "--hbm-tb-s", "2"]
    done = run(*flags, "--modes", "greedy,top_p", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert (result["hidden"], result["vocab"], result["dtype"]) == (32, 1000, "bfloat16")
    assert [row["seqs"] for row in result["rows"]] == [4, 16]
    for row in result["rows"]:
        timed = {k for k in row if k.endswith("_ms") and k != "floor_ms"}
        assert timed == {"logits_ms", "sample_greedy_ms", "both_greedy_ms", "sample_top_p_ms", "both_top_p_ms"}
        assert all(row[k] > 0 for k in timed)
        # the lm_head's bf16 bytes, plus the float32 logits written and read once, at 2 TB/s
        assert row["floor_ms"] == pytest.approx(1e3 * (32 * 1000 * 2 + 2 * row["seqs"] * 1000 * 4) / 2e12)


def test_an_unknown_mode_names_the_choices():
    done = run("--modes", "greedy,beam")
    assert done.returncode != 0 and "unknown --modes ['beam']" in done.stderr and "top_p" in done.stderr


def test_compile_times_cover_every_sampling_program_of_the_platform(tmp_path):
    out = tmp_path / "sampling.json"
    flags = ["--seqs", "4", "--hidden", "32", "--vocab", "300", "--min-seconds", "0.01", "--modes", "greedy"]
    done = run(*flags, "--compile", "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    compiled = {k for k in row if k.startswith("compile_")}
    # on the CPU the device chooses the search: greedy and sampled, each with top logprobs and without
    assert compiled == {"compile_greedy_s", "compile_greedy_top_s", "compile_sampled_s", "compile_sampled_top_s"}
    assert all(row[k] > 0 for k in compiled)

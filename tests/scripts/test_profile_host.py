"""scripts/profile_host.py: a real EngineCore around a tiny model, the host phases of its steps per kind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scripts.profile_host import HOST_PHASES, host_report
from tests.support import REPO_ROOT


def test_host_time_is_the_phases_less_the_device_wait():
    totals = dict(steps=4, tokens=40, decode_tokens=8, schedule_s=0.004, prepare_s=0.008, run_s=0.1, wait_s=0.09)
    idle = dict(steps=0, tokens=0, decode_tokens=0, schedule_s=0.0, prepare_s=0.0, run_s=0.0, wait_s=0.0)
    report = host_report({"mixed": totals, "extend": idle})
    assert set(report) == {"mixed"}  # kinds that ran no step are left out
    row = report["mixed"]
    assert row["launch_finish_ms"] == pytest.approx(2.5) and row["device_wait_ms"] == pytest.approx(22.5)
    assert row["host_ms"] == pytest.approx(1.0 + 2.0 + 2.5)
    assert row["decode_rows_per_step"] == 2 and row["tokens_per_step"] == 10


def test_the_workload_runs_to_the_end_and_reports_each_kind(tmp_path):
    """24 requests of 40 + 12 tokens through 16 running: every output token but each request's first is a decode
    row, nothing compiles after the engine's warmup, and each kind's host time is the sum of its phases."""
    out = tmp_path / "host.json"
    flags = ["--max-running-requests", "16", "--max-prefill-seqs", "4", "--context-length", "256"]
    flags += ["--max-total-tokens", "20000", "--chunked-prefill-size", "128"]
    cmd = [sys.executable, "scripts/profile_host.py", "--num-requests", "24", "--input-len", "40", "--output-len", "12"]
    done = subprocess.run([*cmd, "--json", str(out), "--", *flags], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    kinds = [result[kind] for kind in ("extend", "decode", "mixed") if kind in result]
    assert sum(round(k["decode_rows_per_step"] * k["steps"]) for k in kinds) == 24 * (12 - 1)
    assert sum(k["steps"] for k in kinds) == result["step_calls"]  # no overlap: each call runs and lands one step
    assert result["compilations_after_warmup"] == 0
    for kind in kinds:
        assert kind["host_ms"] == pytest.approx(sum(kind[f"{phase}_ms"] for phase in HOST_PHASES))
        assert all(kind[f"{phase}_ms"] >= 0 for phase in HOST_PHASES)
    assert "decode:" in done.stdout and "host ms per step" in done.stdout
    assert result["gc_frozen_objects"] > 10_000  # the engine's startup objects, frozen as the engine process does
    assert "garbage collector (" in done.stdout


def test_requests_draw_adapters_as_bench_serving_does(tmp_path):
    """--num-adapters writes that many PEFT adapters for the tiny model and gives request i adapter i mod n
    (distinct): every request's adapter is in a device slot when its steps run, and nothing compiles after warmup."""
    out = tmp_path / "host.json"
    flags = ["--max-running-requests", "8", "--max-prefill-seqs", "4", "--context-length", "256"]
    flags += ["--max-total-tokens", "20000", "--chunked-prefill-size", "128", "--max-loras-per-batch", "4"]
    cmd = [sys.executable, "scripts/profile_host.py", "--num-requests", "8", "--input-len", "24", "--output-len", "6"]
    cmd += ["--num-adapters", "3"]
    done = subprocess.run([*cmd, "--json", str(out), "--", *flags], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["num_adapters"] == 3 and result["popularity"] == "distinct"
    assert result["lora"]["device_hits"] + result["lora"]["device_misses"] > 0
    assert result["compilations_after_warmup"] == 0

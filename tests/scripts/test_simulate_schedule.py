"""scripts/simulate_schedule.py: the engine's scheduler over bench_serving.py's workload, without a device."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from scripts.simulate_schedule import build_scheduler, max_new_tokens_of, simulate
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


def test_requests_that_may_run_longer_end_at_their_output_and_raise_only_the_headroom():
    """--max-new-tokens: each request's limit is at least its output and at most what the context leaves; outputs still
    end at their sampled length (as at an EOS), so a roomy cache runs the same steps, and under a short cache only the
    KV headroom, which counts the tokens a request may still sample, sees the difference."""
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(8, 200, 40), rng.integers(2, 50, 40)
    limits = max_new_tokens_of(256, inputs, outputs, FLAGS)
    assert (limits >= outputs).all() and (limits <= 256 - inputs).all() and (limits > outputs).any()
    assert max_new_tokens_of(0, inputs, outputs, FLAGS) is None

    def replay(extra, max_new_tokens):
        scheduler, buckets = build_scheduler(FLAGS + ["--chunked-prefill-size", "128", *extra])
        return simulate(scheduler, buckets, inputs, outputs, max_new_tokens=max_new_tokens)

    roomy = ["--max-total-tokens", "100000"]
    assert replay(roomy, limits) == replay(roomy, None)
    tight = ["--max-total-tokens", "1024"]
    assert replay(tight + ["--kv-headroom", "0"], limits) == replay(tight + ["--kv-headroom", "0"], None)
    with_headroom, without = replay(tight, None), replay(tight + ["--kv-headroom", "0"], None)
    assert 0 < with_headroom["preemptions"] < without["preemptions"]
    assert replay(tight, limits) != with_headroom  # the headroom counts the longer limits


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


def run_with_adapters(num_slots: int, adapters: list[int | None], num_requests: int = 40):
    rng = np.random.default_rng(3)
    inputs, outputs = rng.integers(8, 200, num_requests), rng.integers(2, 50, num_requests)
    flags = FLAGS + ["--chunked-prefill-size", "128", "--max-total-tokens", "100000"]
    scheduler, buckets = build_scheduler(flags + ["--max-loras-per-batch", str(num_slots)], with_adapters=True)
    return simulate(scheduler, buckets, inputs, outputs, adapters=adapters)


def test_slots_for_every_adapter_leave_the_schedule_as_without_adapters():
    """With a slot for each adapter, slots never bind: each adapter loads once and none is evicted, and the same
    tokens run in about the steps of the base-only schedule (admission takes the adapters' requests in its packing
    order, not in arrival order, so a chunk boundary may move)."""
    adapters = [i % 6 if i % 5 else None for i in range(40)]  # 6 adapters and base requests
    base, _, _ = run(["--chunked-prefill-size", "128", "--max-total-tokens", "100000"])
    roomy = run_with_adapters(6, adapters)
    assert roomy["adapters"] == dict(distinct=6, slots=6, loads=6, evictions=0, max_per_step=6)
    for key in ("tokens", "decode_rows"):
        assert sum(roomy[k][key] for k in ("mixed", "decode")) == sum(base[k][key] for k in ("mixed", "decode"))
    steps = [sum(r[k]["steps"] for k in ("mixed", "decode")) for r in (roomy, base)]
    assert abs(steps[0] - steps[1]) <= 0.05 * steps[1]


def test_few_slots_take_more_steps_and_reload_evicted_adapters():
    """12 adapters behind 3 slots: no step holds more than 3 adapters, adapters take turns on the slots (every load
    past the first three evicts one), and the same work takes more steps than with a slot for each adapter."""
    adapters = [i % 12 for i in range(40)]
    tight = run_with_adapters(3, adapters)
    roomy = run_with_adapters(12, adapters)
    assert tight["adapters"]["max_per_step"] == 3 and roomy["adapters"]["max_per_step"] <= 12
    assert tight["adapters"]["loads"] == 3 + tight["adapters"]["evictions"] >= 12

    def total(result, key):
        return result["mixed"][key] + result["decode"][key]

    assert total(tight, "tokens") == total(roomy, "tokens")  # the same work, every token scheduled once
    assert total(tight, "steps") > total(roomy, "steps")


def test_command_line_draws_bench_serving_adapters(tmp_path):
    out = tmp_path / "sim.json"
    cmd = [sys.executable, "scripts/simulate_schedule.py", "--num-requests", "30", "--num-adapters", "50"]
    cmd += ["--popularity", "skewed", "--json", str(out), "--", *FLAGS, "--max-total-tokens", "50000"]
    done = subprocess.run(cmd + ["--max-loras-per-batch", "4"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "adapters:" in done.stdout and "4 slots" in done.stdout
    result = json.loads(out.read_text())["adapters"]
    assert result["slots"] == 4 and result["max_per_step"] <= 4 and result["loads"] >= result["distinct"] > 4

"""scripts/serving_floor.py: the work floor of bench_serving.py's workload over the engine's own scheduled steps."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from scripts.bench_offline import LLAMA3_8B
from scripts.serving_floor import FloorTally, ModelWork
from scripts.simulate_schedule import build_scheduler, simulate
from tests.support import REPO_ROOT

FLAGS = ["--max-running-requests", "16", "--max-prefill-seqs", "4", "--context-length", "256"]
FLAGS += ["--chunked-prefill-size", "128", "--max-total-tokens", "100000"]


def test_llama3_8b_work_constants():
    work = ModelWork.from_config(LLAMA3_8B)
    norms = (2 * 32 + 1) * 4096
    assert work.layer_weights + 2 * work.head_weights + norms == 8_030_261_248  # Llama-3-8B's parameter count
    assert work.kv_elements_per_token * 2 == 131_072  # bytes of bf16 K and V per token, 32 layers
    assert work.attention_flops_per_pair == 4 * 128 * 32 * 32
    assert work.lora_elements_per_rank * 16 == 41_943_040  # PEFT's trainable parameters: rank 16, all 7 projections


def test_the_tally_counts_every_token_pair_and_sample_of_the_scheduled_steps():
    """Over the scheduler's real steps (chunked prompts, decode rows beside them), the FLOPs add up to the workload's:
    each prompt and fed-back output token through the layers once, each output sampled once, and each token
    attending to itself and every earlier token of its sequence once."""
    rng = np.random.default_rng(5)
    inputs, outputs = rng.integers(8, 300, 30), rng.integers(2, 40, 30)
    work = ModelWork.from_config(LLAMA3_8B)
    tally = FloorTally(work, gemm_flops_per_s=790e12, hbm_bytes_per_s=3.35e12, kv_bytes=2)
    scheduler, buckets = build_scheduler(FLAGS)
    result = simulate(scheduler, buckets, inputs, outputs, on_step=tally.add_step)
    assert result["preemptions"] == 0
    processed = inputs + outputs - 1  # the last output token is sampled, never fed back
    want_linear = 2.0 * (work.layer_weights * processed.sum() + work.head_weights * outputs.sum())
    assert tally.linear_flops == want_linear
    pairs = (processed * (processed + 1) // 2).sum()
    assert tally.attention_flops == work.attention_flops_per_pair * pairs
    steps = result["mixed"]["steps"] + result["decode"]["steps"]
    assert tally.weight_bytes == steps * 2.0 * (work.layer_weights + work.head_weights)
    assert sum(tally.floor_s_by_kind.values()) == pytest.approx(tally.floor_s, rel=1e-12)


def test_the_serial_floor_by_bucket_adds_up_to_the_run_and_counts_the_schedulers_steps():
    """Kept per step kind and token bucket, the serial floor's two parts add up to the run's serial floor, and each
    bucket holds the steps and tokens the scheduler's replay ran in it."""
    rng = np.random.default_rng(7)
    inputs, outputs = rng.integers(8, 300, 30), rng.integers(2, 40, 30)
    scheduler, buckets = build_scheduler(FLAGS)
    tally = FloorTally(ModelWork.from_config(LLAMA3_8B), 790e12, 3.35e12, kv_bytes=2, token_buckets=buckets.tokens)
    result = simulate(scheduler, buckets, inputs, outputs, on_step=tally.add_step)
    by_bucket = tally.serial_floor_by_bucket
    assert len(by_bucket) >= 2  # this workload runs both step kinds
    parts = sum(entry["linear_floor_s"] + entry["attention_floor_s"] for entry in by_bucket.values())
    assert parts == pytest.approx(tally.serial_floor_s, rel=1e-12)
    for kind in ("mixed", "decode"):
        for bucket, steps in result[kind]["steps_by_bucket"].items():
            entry = by_bucket[f"{kind} {bucket}"]
            assert entry["steps"] == steps
            assert entry["tokens"] / steps == pytest.approx(result[kind]["mean_tokens_by_bucket"][bucket])
    assert sum(entry["steps"] for entry in by_bucket.values()) == result["mixed"]["steps"] + result["decode"]["steps"]


def test_the_floors_bound_each_other():
    """The roofline floor (compute and memory overlapped per step) is at most the serial one (linears then
    attention), which is at most the four parts added; and at least the whole run's work at either peak."""
    rng = np.random.default_rng(6)
    inputs, outputs = rng.integers(8, 300, 30), rng.integers(2, 40, 30)
    fp8, bf16 = (FloorTally(ModelWork.from_config(LLAMA3_8B), 790e12, 3.35e12, kv_bytes=b) for b in (1, 2))
    for tally in (fp8, bf16):
        simulate(*build_scheduler(FLAGS), inputs, outputs, on_step=tally.add_step)
        parts = tally.parts_s()
        assert tally.floor_s <= tally.serial_floor_s <= sum(parts.values()) * (1 + 1e-12)
        assert tally.floor_s >= max(parts["linear_flops_s"], parts["weight_bytes_s"] + parts["kv_bytes_s"])
    assert fp8.kv_read_write_bytes * 2 == bf16.kv_read_write_bytes and fp8.floor_s < bf16.floor_s


def test_adapters_add_their_reads_per_step_and_their_flops_per_token():
    """With adapters, each step reads the A and B of every distinct adapter its requests use, once, and each token of
    an adapter does 2 FLOPs per A and B element; base requests add nothing; the floors only grow."""
    rng = np.random.default_rng(8)
    inputs, outputs = rng.integers(8, 300, 30), rng.integers(2, 40, 30)
    adapters = [None if i % 5 == 0 else i % 4 for i in range(30)]
    work = ModelWork.from_config(LLAMA3_8B)
    base = FloorTally(work, 790e12, 3.35e12, kv_bytes=2)
    simulate(*build_scheduler(FLAGS), inputs, outputs, on_step=base.add_step)
    tally = FloorTally(work, 790e12, 3.35e12, kv_bytes=2, lora_rank=8)
    seen = {"adapters_per_step": 0, "adapter_tokens": 0}

    def count(plan):
        seen["adapters_per_step"] += len({req.lora_slot_key for req in plan.reqs} - {None})
        seen["adapter_tokens"] += sum(n for req, n in zip(plan.reqs, plan.num_new_tokens) if req.lora_slot_key)
        tally.add_step(plan)

    simulate(*build_scheduler(FLAGS, with_adapters=True), inputs, outputs, on_step=count, adapters=adapters)
    elements = 8 * work.lora_elements_per_rank
    assert seen["adapters_per_step"] > 0 and base.lora_bytes == base.lora_flops == 0
    assert tally.lora_bytes == 2.0 * elements * seen["adapters_per_step"]
    processed = inputs + outputs - 1
    assert seen["adapter_tokens"] == sum(p for p, a in zip(processed, adapters) if a is not None)
    assert tally.lora_flops == 2.0 * elements * seen["adapter_tokens"]
    assert tally.linear_flops == base.linear_flops + tally.lora_flops
    assert tally.serial_floor_s > base.serial_floor_s and tally.floor_s > base.floor_s


def test_command_line_writes_json(tmp_path):
    out = tmp_path / "floor.json"
    cmd = [sys.executable, "scripts/serving_floor.py", "--num-requests", "30", "--kv-bytes", "1", "--json", str(out)]
    done = subprocess.run(cmd + ["--", *FLAGS], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "ceiling" in done.stdout and "serial floor" in done.stdout
    result = json.loads(out.read_text())
    assert result["kv_bytes"] == 1 and result["floor_s"] <= result["serial_floor_s"]
    assert result["ceiling_output_tok_per_s"] == result["output_tokens"] / result["floor_s"]
    by_bucket = result["serial_floor_by_bucket"]
    assert sum(e["linear_floor_s"] + e["attention_floor_s"] for e in by_bucket.values()) == pytest.approx(
        result["serial_floor_s"], rel=1e-12
    )
    assert "serial floor by step kind and token bucket" in done.stdout
    assert result["lora_bytes_s"] == 0 and result["num_adapters"] == 0
    with_adapters = subprocess.run(
        cmd[:-2] + ["--num-adapters", "4", "--popularity", "uniform", "--", *FLAGS, "--max-loras-per-batch", "4"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert with_adapters.returncode == 0, with_adapters.stderr
    assert "the adapters' part of those (rank 16, 4 uniform)" in with_adapters.stdout

"""scripts/bench_serving.py end to end against a real server: `python -m sgl_jax_lora.launch` (demo model, fp32,
small buckets) on 127.0.0.1 with adapters written by scripts/make_adapters.py and loaded on demand by path.

Checks what the benchmark reports (one scenario per adapter count, Poisson arrivals, the ratio to the
base-only scenario, the engine's own account of the window) against what was sent.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from scripts.bench_serving import (
    add_length_options,
    engine_delta,
    max_in_flight,
    median_run,
    parse_concurrencies,
    sample_lengths,
)
from tests.support import REPO_ROOT
from tests.support.http_helpers import SMALL_ENGINE_FLAGS, server_env, start_server, write_demo_adapters

# slow: over a minute of the suite on a 2-core CPU; `pytest -m "not slow"` leaves it out
pytestmark = pytest.mark.slow

ROOT = REPO_ROOT
NUM_REQUESTS, INPUT_LEN, OUTPUT_LEN = 10, 8, 4


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_adapters")
    write_demo_adapters(str(root), "--num-adapters", "3", "--rank-mix", "4,8", "--targets", "q_proj,v_proj,down_proj")
    return root


@pytest.fixture(scope="module")
def server(adapter_root):
    # pages of 4 tokens: the 8-token prompts fill a page the prefix cache could serve, were a prompt sent twice
    srv = start_server(
        [
            *SMALL_ENGINE_FLAGS,
            "--lora-allowed-dirs",
            str(adapter_root),
            "--max-loras-per-batch",
            "2",
            "--page-size",
            "4",
        ]
    )
    yield srv
    srv.stop(signal.SIGKILL)


def run_bench(server, adapter_root, out, *flags: str) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench_serving.py"),
            "--url",
            server.url,
            "--num-requests",
            str(NUM_REQUESTS),
            "--input-len",
            str(INPUT_LEN),
            "--output-len",
            str(OUTPUT_LEN),
            "--adapter-dir",
            str(adapter_root),
            "--out",
            str(out),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=server_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| adapters | popularity |" in done.stdout  # the printed table
    with open(out) as f:
        return json.load(f)


def test_scenarios_report_what_was_sent(server, adapter_root, tmp_path):
    result = run_bench(
        server,
        adapter_root,
        tmp_path / "r.json",
        "--num-adapters",
        "0,3:skewed,3:distinct",
        "--request-rate",
        "200",
        "--warmup-requests",
        "2",
    )
    base, skewed, distinct = result["scenarios"]
    shape = result["engine"]  # the step shape the server took from its flags
    assert shape["step_token_budget"] == shape["token_buckets"][-1] and shape["context_length"] > 0
    assert [(s["num_adapters"], s["popularity"]) for s in result["scenarios"]] == [
        (0, "distinct"),
        (3, "skewed"),
        (3, "distinct"),
    ]
    for scenario in (base, skewed, distinct):
        assert scenario["num_requests"] == NUM_REQUESTS
        assert scenario["total_input_tokens"] == NUM_REQUESTS * INPUT_LEN
        assert scenario["total_output_tokens"] == NUM_REQUESTS * OUTPUT_LEN  # ignore_eos: every token streamed
        assert scenario["request_rate"] == 200
        assert 0 < scenario["ttft_s"]["mean"] <= scenario["e2e_s"]["mean"]
        assert scenario["ttft_s"]["p50"] <= scenario["ttft_s"]["p99"]
        assert scenario["output_tok_per_s"] > 0 and scenario["engine"]["compilations"] == 0
        assert scenario["engine"]["prefix_cache_hit_tokens"] == 0  # fresh prompts in every run: compute is measured
        assert scenario["engine"]["preemptions"] == 0  # the server's KV cache holds every request at once
        assert scenario["ratio_to_base_throughput"] == pytest.approx(
            scenario["output_tok_per_s"] / base["output_tok_per_s"]
        )
        decode_rows = sum(kind["decode_tokens"] for kind in scenario["engine"]["step_stats"].values())
        assert decode_rows >= NUM_REQUESTS * (OUTPUT_LEN - 1)  # the first token comes from the prefill
        gc_delta = scenario["engine"]["gc"]  # the engine process's collections during the run, per generation
        assert len(gc_delta["collections"]) == 3 and all(n >= 0 for n in gc_delta["collections"])
        assert all(s >= 0 for s in gc_delta["pause_s"])
    assert base["engine"]["lora"]["device_misses"] == 0
    # adapters loaded on demand by path into 2 device slots: every request of the distinct scenario names one of 3
    # adapters, so at least one of them was written into a slot inside its measured window
    assert skewed["engine"]["lora"]["device_hits"] > 0
    assert distinct["engine"]["lora"]["device_misses"] >= 1


def test_length_medians_move_the_token_totals():
    """The default ShareGPT-like draw is the protocol every recorded run used; --input-median 180 --output-median 167
    give 1,000 requests the totals vLLM's `bench serve` reports for real ShareGPT prompts (229,711 in, 203,068 out)."""
    parser = argparse.ArgumentParser()
    add_length_options(parser)

    def totals(*flags):
        inputs, outputs = sample_lengths(np.random.default_rng(0), 1000, parser.parse_args(list(flags)))
        return int(inputs.sum()), int(outputs.sum())

    assert totals() == (278_023, 216_037)
    calibrated_in, calibrated_out = totals("--input-median", "180", "--output-median", "167")
    assert abs(calibrated_in / 229_711 - 1) < 0.01 and abs(calibrated_out / 203_068 - 1) < 0.01
    assert totals("--input-len", "64", "--output-len", "32", "--input-median", "180") == (64_000, 32_000)


def test_engine_delta_counts_what_happened_between_two_server_infos():
    before = {"step_stats": {"decode": {"steps": 4}}, "num_compilations": 9, "num_preemptions": 3}
    after = {"step_stats": {"decode": {"steps": 10}}, "num_compilations": 9, "num_preemptions": 8}
    delta = engine_delta(before, after)
    assert delta["step_stats"] == {"decode": {"steps": 6}} and delta["compilations"] == 0
    assert delta["preemptions"] == 5  # requests preempted for KV pages during the run, not since the start


def test_baseline_file_gives_the_ratio(server, adapter_root, tmp_path):
    baseline = run_bench(
        server, adapter_root, tmp_path / "base.json", "--num-adapters", "0", "--temperature", "0.8", "--top-p", "0.9"
    )
    sampled = baseline["scenarios"][0]  # every request sampled at temperature 0.8 with top_p 0.9, to its full length
    assert (sampled["temperature"], sampled["top_p"]) == (0.8, 0.9)
    assert sampled["total_output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    lora = run_bench(
        server,
        adapter_root,
        tmp_path / "lora.json",
        "--num-adapters",
        "2,1",
        "--baseline",
        str(tmp_path / "base.json"),
        "--repeats",
        "3",
    )
    # --repeats 3: each scenario measured three times (in rounds over both), the median run reported
    for scenario in lora["scenarios"]:
        assert scenario["ratio_to_base_throughput"] == pytest.approx(
            scenario["output_tok_per_s"] / baseline["scenarios"][0]["output_tok_per_s"]
        )
        repeats = scenario["repeats_output_tok_per_s"]
        assert len(repeats) == 3 and scenario["output_tok_per_s"] == sorted(repeats)[1]
        assert scenario["total_output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    assert [s["num_adapters"] for s in lora["scenarios"]] == [2, 1]


def test_max_concurrency_keeps_that_many_requests_in_flight(server, adapter_root, tmp_path):
    """--max-concurrency 1,3: every adapter scenario at each limit, in that order; no more requests in flight than
    the limit (one at a time at 1), every request still served, and each ratio against base at its own limit."""
    result = run_bench(server, adapter_root, tmp_path / "c.json", "--num-adapters", "0,2", "--max-concurrency", "1,3")
    runs = result["scenarios"]
    assert [(s["max_concurrency"], s["num_adapters"]) for s in runs] == [(1, 0), (1, 2), (3, 0), (3, 2)]
    assert [s["max_in_flight"] for s in runs[:2]] == [1, 1]
    assert all(1 <= s["max_in_flight"] <= 3 for s in runs[2:])
    for s in runs:
        assert s["total_output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    for base, lora in (runs[0:2], runs[2:4]):
        assert lora["ratio_to_base_throughput"] == pytest.approx(lora["output_tok_per_s"] / base["output_tok_per_s"])


def test_the_median_run_carries_the_traced_runs_profile():
    traced, untraced = {"output_tok_per_s": 10.0, "profile": {"trace_dir": "/t"}}, {"output_tok_per_s": 9.0}
    median = median_run([traced, untraced])  # the lower middle of two: the untraced one
    assert median["output_tok_per_s"] == 9.0 and median["profile"] == {"trace_dir": "/t"}
    assert median["repeats_output_tok_per_s"] == [10.0, 9.0]
    assert "profile" not in median_run([untraced])


def test_max_in_flight_counts_overlapping_requests():
    records = [{"start": 0.0, "end": 2.0}, {"start": 1.0, "end": 3.0}, {"start": 3.0, "end": 4.0}]
    assert max_in_flight(records) == 2  # the third starts as the second ends
    assert max_in_flight([{"start": 0.0, "end": 1.0}, {"start": 1.0, "end": 2.0}]) == 1
    assert parse_concurrencies("1,8,64") == [1, 8, 64]
    for bad in ("0", "1,x"):
        with pytest.raises(argparse.ArgumentTypeError, match="concurrenc|integers"):
            parse_concurrencies(bad)


def test_a_shared_prefix_is_served_from_the_prefix_cache(server, adapter_root, tmp_path):
    """--shared-prefix-len 8: two pages of 4 tokens before every prompt, the warm-up's too, so every measured request
    finds them cached; the prompts count them."""
    result = run_bench(server, adapter_root, tmp_path / "p.json", "--shared-prefix-len", "8", "--warmup-requests", "2")
    scenario = result["scenarios"][0]
    assert scenario["shared_prefix_len"] == 8
    assert scenario["total_input_tokens"] == NUM_REQUESTS * (8 + INPUT_LEN)
    assert scenario["engine"]["prefix_cache_hit_tokens"] >= NUM_REQUESTS * 8


def test_urgent_share_under_fcfs_reports_classes_without_priorities(server, adapter_root, tmp_path):
    """The server runs fcfs: the urgent requests go out without a priority (a non-zero one would be refused) and
    the report gives each class's latencies."""
    result = run_bench(server, adapter_root, tmp_path / "u.json", "--urgent-share", "0.5")
    assert result["scheduling_policy"] == "fcfs"
    scenario = result["scenarios"][0]
    assert scenario["urgent_share"] == 0.5 and scenario["urgent_priority_sent"] is None
    classes = scenario["by_class"]
    assert classes["urgent"]["count"] + classes["normal"]["count"] == NUM_REQUESTS
    assert classes["urgent"]["count"] > 0 and classes["normal"]["count"] > 0
    for cls in classes.values():
        assert 0 < cls["ttft_s"]["mean"] <= cls["e2e_s"]["mean"]


def test_too_many_adapters_is_a_clear_error(server, adapter_root, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench_serving.py"),
            "--url",
            server.url,
            "--num-requests",
            "2",
            "--num-adapters",
            "5",
            "--adapter-dir",
            str(adapter_root),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=server_env(),
    )
    assert done.returncode != 0 and "--num-adapters 5: the server has only 3 adapters" in done.stderr


def run_offline(out, *flags: str, engine_flags: tuple[str, ...] = ()) -> tuple[dict, str]:
    """bench_serving.py without --url: an offline Engine from SMALL_ENGINE_FLAGS and `engine_flags` after `--`;
    (the --out JSON, the printed output)."""
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "bench_serving.py"),
            "--input-len",
            str(INPUT_LEN),
            "--output-len",
            str(OUTPUT_LEN),
            "--out",
            str(out),
            *flags,
            "--",
            *SMALL_ENGINE_FLAGS,
            *engine_flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=server_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out) as f:
        return json.load(f), done.stdout


def test_offline_engine_mode(adapter_root, tmp_path):
    """Without --url the benchmark builds an offline Engine from the flags after `--` (what the GPU runs use)."""
    result, stdout = run_offline(
        tmp_path / "offline.json",
        "--num-requests",
        "4",
        "--num-adapters",
        "0,2",
        "--adapter-dir",
        str(adapter_root),
        "--sample-clock",
        engine_flags=("--lora-allowed-dirs", str(adapter_root), "--max-loras-per-batch", "2"),
    )
    base, lora = result["scenarios"]
    assert base["total_output_tokens"] == lora["total_output_tokens"] == 4 * OUTPUT_LEN
    assert lora["engine"]["lora"]["device_misses"] == 2 and base["engine"]["lora"]["device_misses"] == 0
    # --sample-clock: each run's GPU clock, or why there is none (no nvidia-smi on a CPU machine)
    for run in (base, lora):
        if shutil.which("nvidia-smi") is None:
            assert run["clock"] == {"samples": 0, "unavailable": "nvidia-smi is not on PATH"}
        else:
            assert run["clock"]["samples"] > 0 and run["clock"]["sm_mhz"]["min"] > 0
    assert "the GPU meanwhile:" in stdout


def test_urgent_requests_first_under_the_priority_policy(tmp_path):
    """An offline engine with `--scheduling-policy priority` and one running request at a time: the urgent
    requests, sent with priority -1, are admitted before the others queued beside them, so they reach their first
    token sooner."""
    result, printed = run_offline(
        tmp_path / "priority.json",
        "--num-requests",
        "12",
        "--urgent-share",
        "0.34",
        engine_flags=("--scheduling-policy", "priority", "--max-running-requests", "1"),
    )
    assert "urgent (" in printed  # the printed lines by class
    assert result["scheduling_policy"] == "priority"
    scenario = result["scenarios"][0]
    assert scenario["urgent_priority_sent"] == -1 and scenario["total_output_tokens"] == 12 * OUTPUT_LEN
    urgent, normal = scenario["by_class"]["urgent"], scenario["by_class"]["normal"]
    assert urgent["count"] > 0 and normal["count"] > 0
    assert urgent["ttft_s"]["mean"] < normal["ttft_s"]["mean"]


def test_profile_steps_trace_each_scenarios_first_run(tmp_path):
    """--profile-steps traces that many engine steps of each scenario's measured run into the engine's --profile-dir
    (not the warm-up's, not a second round's); a trace asked for more steps than the run has left is stopped after
    it, holding the steps it saw."""
    profiles = tmp_path / "profiles"
    result, _ = run_offline(
        tmp_path / "profiled.json",
        "--num-requests",
        "4",
        "--warmup-requests",
        "2",
        "--repeats",
        "2",
        "--profile-steps",
        "1000",
        engine_flags=("--profile-dir", str(profiles)),
    )
    profile = result["scenarios"][0]["profile"]  # the first round's trace, whichever round is the median
    assert os.path.dirname(profile["trace_dir"]) == str(profiles) and profile["after_s"] == 0
    assert OUTPUT_LEN - 1 <= profile["num_steps"] < 1000  # the run's steps, at least one decode step per token
    assert os.listdir(profiles) == [os.path.basename(profile["trace_dir"])]  # one trace: the first round's run
    assert glob.glob(os.path.join(profile["trace_dir"], "**", "*.trace.json.gz"), recursive=True)

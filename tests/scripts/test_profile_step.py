"""scripts/profile_step.py's trace reading on a hand-made perfetto trace: device ops only, forwards split at the
host's gaps, and each forward's span (not its summed op time) when ops overlap on two streams; the dispatch
timing leaves out the wait for a call's result; the layer period is read off the op that runs once per layer; each
mode's one token bucket holds its profiled step, and --token-bucket pads a decode step's rows to a larger one."""

from __future__ import annotations

import argparse
import gzip
import json

import pytest

import scripts.profile_step as profile_step
from scripts.profile_step import (
    device_ops,
    layer_period_us,
    span_us,
    split_forwards,
    summarize_trace,
    timed,
    timeline,
)


def write_trace(directory, ops: list[tuple[str, float, float, int]]) -> None:
    """ops: (name, start us, duration us, stream tid) on the GPU process, plus one host op that must be ignored."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "Stream #9(Compute)"}},
        {"ph": "X", "name": "host_dispatch", "pid": 2, "tid": 1, "ts": 500.0, "dur": 400.0},
    ]
    events += [{"ph": "X", "name": n, "pid": 1, "tid": tid, "ts": ts, "dur": dur} for n, ts, dur, tid in ops]
    (directory / "plugins").mkdir()
    with gzip.open(directory / "plugins" / "step.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_forwards_split_at_host_gaps_and_span_counts_overlap_once(tmp_path):
    write_trace(
        tmp_path,
        [
            ("gemm", 0.0, 10.0, 7),
            ("shrink", 2.0, 25.0, 9),
            ("expand", 12.0, 5.0, 7),  # shrink overlaps both
            ("gemm", 1000.0, 10.0, 7),
            ("expand", 1011.0, 5.0, 7),
        ],
    )
    ops = device_ops(str(tmp_path))
    assert [op["name"] for op in ops] == ["gemm", "shrink", "expand", "gemm", "expand"]
    forwards = split_forwards(ops)
    assert [len(f) for f in forwards] == [3, 2]
    assert [span_us(f) for f in forwards] == [27.0, 16.0]
    rows, total_ms, total_ops = summarize_trace(ops, top=2)
    assert rows[0] == ("shrink", 0.025, 1) and total_ops == 5
    assert total_ms == pytest.approx(0.055)  # summed op time: more than the spans' 0.043 ms
    first = timeline(forwards[0])
    assert first[1] == {"start_us": 2.0, "dur_us": 25.0, "stream": "Stream #9(Compute)", "name": "shrink"}


def test_no_trace_gives_no_ops(tmp_path):
    assert device_ops(str(tmp_path)) == [] and split_forwards([]) == []


class FakeClock:
    """perf_counter for scripts/profile_step.py: time moves only when a result is awaited."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class SlowResult:
    """A call's result that takes 30 ms (on the fake clock) to become ready, as a device computation would."""

    def __init__(self, clock: FakeClock):
        self.clock = clock

    def block_until_ready(self):
        self.clock.now += 0.03
        return self


def test_dispatch_time_leaves_out_the_wait_for_the_result(monkeypatch):
    clock, calls = FakeClock(), []
    monkeypatch.setattr(profile_step, "time", clock)
    launch = lambda: calls.append(1) or SlowResult(clock)  # noqa: E731
    assert timed(launch, repeats=3, wait=False) == 0.0  # ms: the 30 ms wait is outside the timing
    assert len(calls) == 4  # one warm-up call, then one per repeat
    assert timed(launch, repeats=1) == pytest.approx(30.0)


def test_layer_period_follows_the_per_layer_op_with_the_most_time():
    def op(name, ts, dur):
        return {"name": name, "ts": ts, "dur": dur, "stream": "s"}

    forward = [op("embed", 0.0, 5.0)]
    for start, norm_at in ((10.0, 90.0), (110.0, 90.0), (230.0, 60.0)):  # layers 100 and 120 us apart
        forward += [op("attention", start, 50.0), op("norm", start + norm_at, 2.0)]
    forward += [op("lm_norm", 330.0, 3.0)]
    assert layer_period_us(forward, num_layers=3) == 110.0  # median of 100 and 120, read off "attention"
    forward[3]["name"] = "attention_2"  # XLA named one layer's op apart: only "norm" still runs once per layer
    assert layer_period_us(forward, num_layers=3) == 95.0  # norms 100 and 90 us apart
    assert layer_period_us(forward, num_layers=4) is None


@pytest.mark.parametrize(
    "mode,batch,prompt_len,chunks,chunk_len,want",
    [
        ("decode", 256, 512, 2, 256, (256, 2048)),  # the decode rows; prefill chunks of 2048 to bring them up
        ("extend", 8, 256, 2, 256, (2048, 2048)),  # the batch's prompt tokens
        ("mixed", 240, 512, 2, 256, (1024, 1024)),  # 240 decode rows + 512 chunk tokens, as the engine pads them
        ("mixed", 4, 32, 2, 16, (128, 128)),  # at least 128
    ],
)
def test_step_bucket_holds_the_profiled_step(mode, batch, prompt_len, chunks, chunk_len, want):
    opts = argparse.Namespace(
        mode=mode, batch=batch, prompt_len=prompt_len, chunks=chunks, chunk_len=chunk_len, token_bucket=0
    )
    assert profile_step.step_bucket(opts) == want


def test_token_bucket_pads_a_decode_step_as_the_engine_does():
    opts = argparse.Namespace(mode="decode", batch=369, prompt_len=384, chunks=0, chunk_len=0, token_bucket=512)
    assert profile_step.step_bucket(opts) == (512, 2048)  # 369 rows in the 512 bucket
    opts.token_bucket = 256
    with pytest.raises(SystemExit, match="--token-bucket 256 holds fewer tokens than the step's 369 rows"):
        profile_step.step_bucket(opts)

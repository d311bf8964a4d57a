"""How busy the device was in a trace of the engine's steps: busy and idle time, and the idle gaps by length.

    python scripts/trace_busy.py TRACE_DIR [TRACE_DIR ...] [--slice-ms 1000] [--json out.json]

Where it sits: after a trace written by the engine's StepProfiler (POST /start_profile on a server started with
--profile-dir, `Engine.start_profile`, or `scripts/bench_serving.py --profile-steps N`). It reads the Perfetto trace
(`*.trace.json.gz`) under each directory with `profile_step.device_ops` (the device's ops, every stream) and reports,
over the window from the first op's start to the last op's end: the time some op ran (the union of the ops'
intervals, so ops overlapping on several streams count once), the idle rest, the idle gaps by length, the ops' time
by family (`op_family`: each kernel or XLA fusion with its copies' numbers dropped) and by kind of op (`op_kind`: the
GEMMs, the decode and prefill attention kernels, the LoRA shrink and expand, and other ops). With the
overlap schedule the host prepares and launches a step while the device runs the one before, so a device that
idles between steps is waiting for the host: the gaps say how much serving time the host path costs.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.profile_step import device_ops  # noqa: E402

GAP_BOUNDS_US = (10.0, 100.0, 1000.0)  # idle gaps reported at or above each of these lengths
# the engine's kinds of op by what their kernels are called in a GPU trace (the first kind whose names match); any
# other op (XLA's fusions: the residual adds and norms, the sums of split K's parts, the sampler) is "other ops"
OP_KINDS = (
    ("decode attention", ("ragged_paged_attention_decode",)),
    ("prefill attention", ("ragged_paged_attention_prefill",)),
    ("LoRA shrink", ("_shrink_kernel",)),
    ("LoRA expand", ("_expand_kernel",)),
    ("GEMMs", ("mosaic_gpu_kernel", "gemm", "nvjet", "cutlass", "cublas")),  # ours, XLA's and cuBLAS's
)
OTHER_OPS = "other ops"


def busy_intervals(ops: list[dict]) -> list[tuple[float, float]]:
    """The union of the ops' [ts, ts + dur) intervals (us), merged and in order."""
    merged: list[tuple[float, float]] = []
    for op in sorted(ops, key=lambda op: op["ts"]):
        start, end = op["ts"], op["ts"] + op["dur"]
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def compute_ops(ops: list[dict]) -> list[dict]:
    """The ops of compute streams (a GPU's stream names say "Compute"): not the copies of a stream that only copies
    (the step's batch from the host), which can run while no kernel does. All ops where no stream is so named."""
    compute = [op for op in ops if "Compute" in op["stream"]]
    return compute or ops


def busy_summary(ops: list[dict]) -> dict:
    """Window, busy and idle time (ms) of a trace's device ops, the share of the window a compute stream's op ran, and
    its idle gaps: how many and how long in all at or above each of GAP_BOUNDS_US, and the five longest (ms)."""
    if not ops:
        raise ValueError("the trace holds no device ops: trace the engine's steps on a GPU (or a TPU)")
    intervals = busy_intervals(ops)
    gaps = [b[0] - a[1] for a, b in zip(intervals, intervals[1:])]
    window = intervals[-1][1] - intervals[0][0]
    busy = sum(end - start for start, end in intervals)
    kernels = compute_ops(ops)
    kernel_busy = sum(end - start for start, end in busy_intervals(kernels))
    return {
        "window_ms": window / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (window - busy) / 1e3,
        "busy_share": busy / window if window else 1.0,
        "compute_busy_share": kernel_busy / window if window else 1.0,
        "num_ops": len(ops),
        "gaps": {
            f">={bound:g}us": {"count": sum(g >= bound for g in gaps), "ms": sum(g for g in gaps if g >= bound) / 1e3}
            for bound in GAP_BOUNDS_US
        },
        "longest_gaps_ms": [g / 1e3 for g in sorted(gaps, reverse=True)[:5]],
    }


def op_family(name: str) -> str:
    """An op's name without the numbers XLA and Pallas append to copies of one kind of op (`loop_add_fusion_62`,
    `fusion_532_remat2`, `_expand_kernel__3` -> `loop_add_fusion`, `fusion`, `_expand_kernel`)."""
    return re.sub(r"(_remat\d*|__?\d+|\.\d+)+$", "", name) or name


def time_by_family(ops: list[dict], top: int = 12) -> list[dict]:
    """The compute streams' op time by op family, the largest first, each as ms and as a share of that op time (ops
    overlapping on several streams each count, so the shares are of the ops' time, not of the window)."""
    total: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for op in compute_ops(ops):
        family = op_family(op["name"])
        total[family] += op["dur"]
        count[family] += 1
    whole = sum(total.values()) or 1.0
    return [
        {"family": family, "ms": us / 1e3, "share": us / whole, "count": count[family]}
        for family, us in total.most_common(top)
    ]


def op_kind(name: str) -> str:
    """The kind of op (OP_KINDS) a device op's name says it is, else OTHER_OPS."""
    lowered = name.lower()
    return next((kind for kind, marks in OP_KINDS if any(mark in lowered for mark in marks)), OTHER_OPS)


def time_by_kind(ops: list[dict]) -> dict[str, float]:
    """The compute streams' op time (ms) by kind of op, every kind of OP_KINDS and OTHER_OPS, each op counted (ops
    overlapping on several streams each count: the LoRA kernels beside the GEMMs)."""
    total = dict.fromkeys([kind for kind, _ in OP_KINDS] + [OTHER_OPS], 0.0)
    for op in compute_ops(ops):
        total[op_kind(op["name"])] += op["dur"] / 1e3
    return total


def busy_by_slice(ops: list[dict], slice_ms: float) -> list[dict]:
    """Busy share of each `slice_ms` of the window in turn (a serving run's phases: mixed steps, then its decode tail),
    by the compute streams' ops."""
    intervals = busy_intervals(compute_ops(ops))
    start, width = intervals[0][0], slice_ms * 1e3
    num_slices = max(math.ceil((intervals[-1][1] - start) / width), 1)
    busy = [0.0] * num_slices
    for lo, hi in intervals:
        for k in range(int((lo - start) // width), min(int((hi - start) // width), num_slices - 1) + 1):
            cut_lo, cut_hi = max(lo, start + k * width), min(hi, start + (k + 1) * width)
            busy[k] += max(cut_hi - cut_lo, 0.0)
    last = intervals[-1][1] - start - (num_slices - 1) * width  # the last slice ends with the window
    widths = [width] * (num_slices - 1) + [last]
    return [{"start_ms": k * slice_ms, "busy_share": b / w if w else 1.0} for k, (b, w) in enumerate(zip(busy, widths))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace_dirs", nargs="+", help="directories of StepProfiler traces")
    parser.add_argument("--slice-ms", type=float, default=0, help="also the busy share of each slice this long")
    parser.add_argument("--json", default=None, help="write the summaries here")
    opts = parser.parse_args()
    summaries = {}
    for trace_dir in opts.trace_dirs:
        ops = device_ops(trace_dir)
        summary = busy_summary(ops)
        summary["by_family"] = time_by_family(ops)
        summary["by_kind"] = time_by_kind(ops)
        if opts.slice_ms:
            summary["slices"] = busy_by_slice(ops, opts.slice_ms)
        summaries[trace_dir] = summary
        gaps = ", ".join(f"{key}: {g['count']} ({g['ms']:.2f} ms)" for key, g in summary["gaps"].items())
        print(
            f"{trace_dir}: window {summary['window_ms']:.2f} ms, busy {summary['busy_ms']:.2f} ms "
            f"({summary['busy_share']:.3f}; compute streams {summary['compute_busy_share']:.3f}), idle "
            f"{summary['idle_ms']:.2f} ms; idle gaps {gaps}; "
            f"longest {', '.join(f'{g:.2f}' for g in summary['longest_gaps_ms'])} ms"
        )
        for row in summary["by_family"]:
            print(f"  {row['share']:6.1%} {row['ms']:10.2f} ms {row['count']:8d} x {row['family']}")
        print("  by kind: " + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in summary["by_kind"].items()))
        for piece in summary.get("slices", []):
            print(f"  from {piece['start_ms']:.0f} ms: busy {piece['busy_share']:.3f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(summaries, f, indent=2)


if __name__ == "__main__":
    main()

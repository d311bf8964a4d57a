"""scripts/trace_busy.py: the device's busy time counts ops overlapping on several streams once, the idle gaps between
them are reported by length, and a trace without device ops (the CPU's, from the engine's own profiler) is refused
with what to do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from scripts.profile_step import device_ops
from scripts.trace_busy import (
    OTHER_OPS,
    busy_by_slice,
    busy_intervals,
    busy_summary,
    op_family,
    op_kind,
    time_by_family,
    time_by_kind,
)
from sgl_jax_lora.managers.step_profiler import StepProfiler


def op(ts: float, dur: float, stream: str = "Stream #1(Compute)") -> dict:
    return {"name": "fusion", "ts": ts, "dur": dur, "stream": stream}


def test_overlapping_ops_count_once_and_gaps_are_sorted_by_length():
    ops = [
        op(0, 100),
        op(50, 100, "Stream #2(Compute)"),  # overlaps the first on another stream: busy 0-150
        op(2000, 400, "Stream #3(MemcpyH2D)"),  # a copy alone: busy, not computing
        op(155, 45),  # a 5 us gap
        op(400, 100),  # a 200 us gap
        op(2500, 500),  # a 2,000 us gap
    ]
    assert busy_intervals(ops) == [(0, 150), (155, 200), (400, 500), (2000, 2400), (2500, 3000)]
    summary = busy_summary(ops)
    assert summary["window_ms"] == pytest.approx(3.0) and summary["busy_ms"] == pytest.approx(1.195)
    assert summary["idle_ms"] == pytest.approx(1.805) and summary["busy_share"] == pytest.approx(1.195 / 3)
    assert summary["compute_busy_share"] == pytest.approx(0.265)
    assert summary["gaps"] == {
        ">=10us": {"count": 3, "ms": pytest.approx(1.8)},
        ">=100us": {"count": 3, "ms": pytest.approx(1.8)},
        ">=1000us": {"count": 1, "ms": pytest.approx(1.5)},
    }
    assert summary["longest_gaps_ms"] == pytest.approx([1.5, 0.2, 0.1, 0.005])
    slices = busy_by_slice(ops, 1.0)  # 0-1 ms, 1-2 ms (idle), 2-3 ms (the last op from 2.5 ms)
    assert [s["start_ms"] for s in slices] == [0, 1, 2]
    assert [s["busy_share"] for s in slices] == pytest.approx([0.295, 0.0, 0.5])


def test_a_trace_without_device_ops_is_refused(tmp_path):
    profiler = StepProfiler(str(tmp_path))
    started = profiler.start()
    jax.jit(lambda x: x * 2)(jnp.ones(4)).block_until_ready()
    profiler.stop()
    ops = device_ops(started.trace_dir)  # the CPU's ops are the host's, not a device's
    with pytest.raises(ValueError, match="no device ops: trace the engine's steps on a GPU"):
        busy_summary(ops)


def test_op_time_by_family_folds_the_numbered_copies_of_an_op():
    assert [
        op_family(n) for n in ("loop_add_fusion_62", "fusion_532_remat2", "_expand_kernel__3", "rope_kv_write")
    ] == [
        "loop_add_fusion",
        "fusion",
        "_expand_kernel",
        "rope_kv_write",
    ]
    ops = [
        {"name": "ragged_paged_attention_decode", "ts": 0, "dur": 300, "stream": "Stream #1(Compute)"},
        {"name": "_expand_kernel__1", "ts": 300, "dur": 50, "stream": "Stream #1(Compute)"},
        {"name": "_expand_kernel__2", "ts": 350, "dur": 150, "stream": "Stream #2(Compute)"},
        {"name": "MemcpyH2D", "ts": 0, "dur": 900, "stream": "Stream #3(MemcpyH2D)"},  # not a compute stream
    ]
    assert time_by_family(ops) == [
        {"family": "ragged_paged_attention_decode", "ms": 0.3, "share": 0.6, "count": 1},
        {"family": "_expand_kernel", "ms": 0.2, "share": 0.4, "count": 2},
    ]


def test_op_time_by_kind_names_the_engines_kernels_and_counts_every_op():
    """The GPU trace's names of the engine's kernels map to their kinds (ours, XLA's and cuBLAS's GEMMs alike); XLA's
    other fusions are other ops; every compute op counts, the copy stream's none."""
    names = {
        "anonymous_mosaic_gpu_kernel": "GEMMs",
        "_kernel_mosaic_gpu_kernel": "GEMMs",
        "nvjet_sm90_tss_128x256_64x4_2x1_v_bz_coopA_NNN": "GEMMs",
        "gemm_fusion_dot_general_254": "GEMMs",
        "ragged_paged_attention_decode": "decode attention",
        "ragged_paged_attention_prefill": "prefill attention",
        "_shrink_kernel__3": "LoRA shrink",
        "_expand_kernel": "LoRA expand",
        "loop_add_fusion_62": OTHER_OPS,
        "rope_kv_write": OTHER_OPS,
    }
    assert {name: op_kind(name) for name in names} == names
    ops = [
        {"name": "anonymous_mosaic_gpu_kernel", "ts": 0, "dur": 400, "stream": "Stream #1(Compute)"},
        {"name": "_shrink_kernel__1", "ts": 100, "dur": 50, "stream": "Stream #2(Compute)"},  # beside the GEMM
        {"name": "ragged_paged_attention_decode", "ts": 400, "dur": 300, "stream": "Stream #1(Compute)"},
        {"name": "loop_add_fusion_1", "ts": 700, "dur": 20, "stream": "Stream #1(Compute)"},
        {"name": "MemcpyH2D", "ts": 0, "dur": 900, "stream": "Stream #3(MemcpyH2D)"},  # not a compute stream
    ]
    by_kind = time_by_kind(ops)
    assert by_kind == pytest.approx(
        {
            "decode attention": 0.3,
            "prefill attention": 0.0,
            "LoRA shrink": 0.05,
            "LoRA expand": 0.0,
            "GEMMs": 0.4,
            OTHER_OPS: 0.02,
        }
    )

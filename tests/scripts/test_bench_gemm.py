"""scripts/bench_gemm.py on CPU: its rows, timed with the kernel's pure-JAX reference (the kernel needs a Hopper GPU)."""

from __future__ import annotations

from scripts.bench_gemm import measure_row


def test_a_row_times_both_programs_and_compares_their_outputs():
    row = measure_row("o", 128, 256, 128, layers=2, min_seconds=0.01, reference=True)
    assert row["module"] == "o" and row["tokens"] == 128 and row["layers"] == 2
    assert row["xla_us"] > 0 and row["kernel_us"] > 0
    assert abs(row["ratio"] - row["kernel_us"] / row["xla_us"]) < 1e-12
    assert row["max_abs_diff"] < 0.05  # the reference accumulates in float32 like XLA's dot; bf16 outputs


def test_a_shape_the_kernel_refuses_raises_naming_the_fix():
    import pytest

    with pytest.raises(ValueError, match="do not fit tiles"):
        measure_row("o", 128, 384, 128, layers=1, min_seconds=0.01, reference=True)

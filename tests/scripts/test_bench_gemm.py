"""scripts/bench_gemm.py on CPU: its rows, timed with the kernel's pure-JAX reference (the kernel needs a Hopper GPU)."""

from __future__ import annotations

from scripts.bench_gemm import measure_row


def test_a_row_times_both_programs_and_compares_their_outputs():
    row = measure_row("o", 128, 256, 128, layers=2, min_seconds=0.01, reference=True)
    assert row["module"] == "o" and row["tokens"] == 128 and row["layers"] == 2
    assert row["xla_us"] > 0 and row["kernel_us"] > 0
    assert abs(row["ratio"] - row["kernel_us"] / row["xla_us"]) < 1e-12
    assert row["max_abs_diff"] < 0.05  # the reference accumulates in float32 like XLA's dot; bf16 outputs


def test_fp8_times_the_8_bit_kernel_and_reports_its_error_against_bf16():
    """--fp8: the 8-bit kernel on the stack quantized as the loader does it, with x quantized once and in every layer;
    its last layer's output within fp8's error of XLA's bf16 product (measured on H100 rows: 0.034-0.042)."""
    row = measure_row("o", 256, 512, 128, layers=2, min_seconds=0.01, reference=True, fp8=True)
    assert row["fp8_us"] > 0 and row["fp8_quant_us"] > 0
    assert 0.005 < row["fp8_rel_err"] < 0.1
    assert "fp8_us" not in measure_row("o", 256, 512, 128, layers=1, min_seconds=0.01, reference=True)


def test_a_shape_the_kernel_refuses_raises_naming_the_fix():
    import pytest

    with pytest.raises(ValueError, match="do not fit tiles"):
        measure_row("o", 128, 384, 128, layers=1, min_seconds=0.01, reference=True)


def test_tilings_parse_and_refuse_what_the_kernel_does_not_take():
    import pytest

    from scripts.bench_gemm import parse_tilings

    assert parse_tilings("64x1,128x2,") == [(64, 1), (128, 2)]
    with pytest.raises(ValueError, match="write WxK"):
        parse_tilings("64")
    with pytest.raises(ValueError, match="tile_n must be 64 or 128"):
        parse_tilings("96x1")
    with pytest.raises(ValueError, match="K parts 1, 2, 4 or 8"):
        parse_tilings("64x3")


def test_tilings_take_the_deepest_pipeline_that_fits_shared_memory():
    from scripts.bench_gemm import tiles_for

    assert (tiles_for(128, 1).stages, tiles_for(128, 1).epilogue_n) == (4, 64)  # the kernel's default tiles
    assert (tiles_for(64, 1).stages, tiles_for(64, 2).stages, tiles_for(64, 2).epilogue_n) == (6, 6, 32)
    for tiles, itemsize in ((tiles_for(64, 1), 2), (tiles_for(64, 4), 4), (tiles_for(128, 2), 4)):
        assert tiles.smem_bytes(0, itemsize) + 1024 <= 227 * 1024  # an H100 block's shared memory, less the spare


def test_a_row_times_each_tiling():
    row = measure_row("o", 128, 256, 128, layers=2, min_seconds=0.01, reference=True, tilings=((64, 1), (64, 2)))
    assert set(row["tilings_us"]) == {"64x1", "64x2"} and all(us > 0 for us in row["tilings_us"].values())

"""scripts/bench_sliding_window.py: a row times full and windowed attention and checks the windowed decode rows
against the reference (on CPU the GPU kernels run in interpret mode, on a small cache); bad windows are refused."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

import scripts.bench_sliding_window as bench
from pallas_kernels.attention.gpu import ragged_paged_attention_gpu
from scripts.bench_attention import CacheSpec

# slow: the kernels in interpret mode at the Llama-3-8B attention shape
pytestmark = pytest.mark.slow


def test_a_decode_row_reports_each_window_against_full_attention(monkeypatch):
    monkeypatch.setattr(
        bench, "ragged_paged_attention_gpu", functools.partial(ragged_paged_attention_gpu, interpret=True)
    )
    monkeypatch.setattr(bench, "time_ms", lambda fn, arg_sets: 1.0)  # interpret-mode timings mean nothing
    row = bench.measure_row("decode", 2, 40, [16, 64], CacheSpec(min_bytes=0))
    assert row["kind"] == "decode" and row["full_ms"] == 1.0
    assert row["window_16_max_err"] < 2e-2 and row["window_64_max_err"] < 2e-2  # bf16 against the reference
    assert row["window_16_tbps"] < row["window_64_tbps"] == row["full_tbps"]  # a window past the context reads all


def test_a_window_under_one_key_is_refused():
    run = [sys.executable, "scripts/bench_sliding_window.py", "--windows", "0", "--decode-rows", "--prefill-rows"]
    result = subprocess.run(run, capture_output=True, text=True)
    assert result.returncode == 2 and "each window must be a positive number of keys" in result.stderr


def test_the_mistral_shape_windows_every_layer_and_null_serves_full_attention(tmp_path):
    from scripts.bench_offline import MISTRAL_7B, make_model_dir
    from sgl_jax_lora.configs.model_config import ModelConfig

    windowed = ModelConfig.from_model_path(make_model_dir(MISTRAL_7B, str(tmp_path / "windowed")))
    full = ModelConfig.from_model_path(make_model_dir({**MISTRAL_7B, "sliding_window": None}, str(tmp_path / "full")))
    assert windowed.sliding_windows == (4096,) * 32 and windowed.page_release_window == 4096
    assert full.sliding_windows == () and full.page_release_window is None
    assert windowed.served_within(4096).sliding_windows == ()  # a window as wide as the context is full attention

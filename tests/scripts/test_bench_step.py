"""scripts/bench_step.py: the variants it parses, the order it times the cases in, and one variant measured end to end
on a tiny model (the cases themselves: test_step_cases.py)."""

from __future__ import annotations

import argparse

import jax
import pytest

from scripts import bench_step
from scripts.bench_offline import make_model_dir
from scripts.bench_step import measure_variant, parse_variant, round_order, time_cases
from scripts.step_cases import parse_case
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.model_executor.compiler_options import forward_compiler_options
from sgl_jax_lora.model_executor.model_runner import load_engine_model
from sgl_jax_lora.server_args import ServerArgs
from tests.support.tiny_configs import TINY_LLAMA_CONFIG


def test_variants_name_the_attention_and_the_lora_backend():
    assert parse_variant("native") == ("native", None)
    assert parse_variant("pallas+lora") == ("pallas", "auto")
    assert parse_variant("pallas+lora=bgmv") == ("pallas", "bgmv")
    for bad in ("xla", "pallas+lora=fast", "pallas+adapters", "pallas+=bgmv"):
        with pytest.raises(SystemExit):
            parse_variant(bad)


def test_rounds_alternate_the_order_of_the_cases():
    """Every case's calls run together within a round, the order reversed every other round (a drift of the device
    over the run weighs on every case alike); each round yields the times so far, one list of calls per round."""
    assert round_order(3, 0) == [0, 1, 2] and round_order(3, 1) == [2, 1, 0] and round_order(3, 2) == [0, 1, 2]
    calls = []
    snapshots = [[len(rounds) for rounds in times] for times in time_cases(calls.append, 3, 2, 3)]
    assert calls == [0, 0, 1, 1, 2, 2, 2, 2, 1, 1, 0, 0, 0, 0, 1, 1, 2, 2]
    assert snapshots == [[1, 1, 1], [2, 2, 2], [3, 3, 3]]
    *_, times = time_cases(lambda case: None, 2, 4, 2)
    assert all(len(calls) == 4 and min(calls) >= 0 for rounds in times for calls in rounds)


def test_a_variant_is_measured_round_by_round(monkeypatch):
    """The tests' tiny Llama (two layers), native attention, a decode, a prefill and a mixed case over two rounds: one
    row a case after each round, with that round's median beside the earlier ones and the HBM floor of the real rows. The
    model is the engine's for the variant's flags (`load_engine_model`) and its forward takes the engine's XLA options
    for this platform, both sets of them as ForwardPrograms compiles them."""
    asked = []

    def engine_options(platform: str, disable_gpu_concurrent_kernels: bool, *, cublas_gemms: bool):
        asked.append((platform, disable_gpu_concurrent_kernels, cublas_gemms))
        return forward_compiler_options(platform, disable_gpu_concurrent_kernels, cublas_gemms=cublas_gemms)

    def engine_model(args: ServerArgs, *rest):
        asked.append((args.attention_backend, args.lora_backend, args.gpu_gemm_min_tokens))
        return load_engine_model(args, *rest)

    monkeypatch.setattr(bench_step, "forward_compiler_options", engine_options)
    monkeypatch.setattr(bench_step, "load_engine_model", engine_model)
    cfg = ModelConfig.from_model_path(make_model_dir(TINY_LLAMA_CONFIG))
    opts = argparse.Namespace(
        repeats=2,
        rounds=2,
        num_adapters=2,
        lora_fused_gemm_min_tokens=None,
        gpu_gemm_min_tokens=8,
        disable_gpu_concurrent_kernels=True,
        hbm_tb_s=4.8,
        peak_tflops=790.0,
    )
    texts = ["decode:3x40@8", "prefill:2x24", "mixed:2x40+1x16@32"]
    cases = [parse_case(text) for text in texts]
    yielded = list(measure_variant(cfg, "native+lora", "native", "auto", cases, opts))
    assert [[len(row["round_ms"]) for row in rows] for rows in yielded] == [[1, 1, 1], [2, 2, 2]]
    last = yielded[-1]
    assert [row["case"] for row in last] == texts
    assert [row["tokens"] for row in last] == [3, 48, 18]
    assert all(row["forward_ms"] > 0 and row["hbm_floor_ms"] > 0 and row["variant"] == "native+lora" for row in last)
    assert yielded[0][0]["round_ms"] == last[0]["round_ms"][:1]
    # the engine's two option sets (XLA's Triton fusions, cuBLAS's GEMMs), each batch running the one the engine's would
    assert asked == [("native", "auto", 8), (jax.default_backend(), True, False), (jax.default_backend(), True, True)]

"""scripts/ab_step.py: the settings it parses, the knobs it applies while the forward is traced and undoes after, the
order it times the (case, setting) pairs in, and a fused-GEMM setting compiling a different forward of the same
values on a tiny model whose modules fit the kernel's tiles."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import pallas_kernels.attention.gpu as attention_gpu
import pallas_kernels.sgmv.work_list as work_list
import sgl_jax_lora.layers.base_gemm as base_gemm
from scripts.ab_step import (
    alternate,
    applied,
    compared_with,
    compile_settings,
    parse_setting,
    setting_batches,
    setting_compiler_options,
)
from scripts.bench_offline import make_model_dir
from scripts.bench_step import build, engine_args
from scripts.step_cases import cache_pages, case_batch, lora_batches, parse_case
from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.lora.backend.auto import AutoBackend

# widths multiples of 256 and inputs of 64: every module fits the GEMM with the LoRA inside it
KERNEL_SIZED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 128,
}


def test_settings_parse_into_knobs():
    assert parse_setting("default") == {}
    assert parse_setting("base") == {"base": True}
    assert parse_setting("gated-delta=0,fused=2048:2048") == {"gated-delta": 0, "fused": (2048, 2048)}
    assert parse_setting("entry-ring=4096") == {"entry-ring": 4096}
    assert parse_setting("tile16=512,gated-delta=1") == {"tile16": 512, "gated-delta": 1}
    assert parse_setting("fused=1024:2048") == {"fused": (1024, 2048)}
    assert parse_setting("decode-warps=2,decode-keys=64") == {"decode-warps": 2, "decode-keys": 64}
    assert parse_setting("fused=0:0,decode-warps=4") == {"fused": (0, 0), "decode-warps": 4}
    assert parse_setting("base,skinny=0") == {"base": True, "skinny": 0}  # the base program under a knob
    assert parse_setting("base,triton-gemm=0") == {"base": True, "triton-gemm": 0}
    assert parse_setting("fused-qkv=1024") == {"fused-qkv": 1024}
    for bad in (
        "base,base",
        "fused=1024",
        "fused=a:b",
        "decode-warps=2:4",
        "warps=2",
        "decode-keys=-1",
        "fused=1:1,fused=2:2",
        "base=1",
        "gated-delta=2",
        "triton-gemm=2",
        "mem-slop=-1",
        "gated-delta=",
    ):
        with pytest.raises(SystemExit):
            parse_setting(bad)


def test_knobs_hold_while_traced_and_are_undone_after(monkeypatch):
    """Inside the setting: the Pallas GPU backend's thresholds, and the attention kernel called with the setting's
    decode tiles, each call recorded; after it (a failure included) both as they were."""
    backend = AutoBackend(None, fused_gemm_min_tokens=0)
    pallas = backend.backends["pallas"]
    calls = []
    kernel = lambda *args, **kwargs: calls.append((args, kwargs))  # noqa: E731 - the attention kernel's stand-in
    monkeypatch.setattr(attention_gpu, "ragged_paged_attention_gpu", kernel)
    row_tile_16 = work_list.ROW_TILE_16_MAX_ROWS
    setting = {"fused": (256, 512), "decode-warps": 2, "gated-delta": 1, "entry-ring": 4096, "tile16": 64}
    skinny_max = base_gemm.SKINNY_MAX_TOKENS
    default_gemm = base_gemm.BaseGemm(256, skinny=True, xla_dots=True)
    with applied({**setting, "skinny": 0, "xla-dots": 0}, backend) as traced:
        assert not base_gemm.BaseGemm(256, skinny=True).runs_skinny(256)  # the skinny form off in the 256 bucket
        assert default_gemm.runs(256)  # the kernel in the 256 bucket, the default's XLA dots off
        assert (pallas.fused_gemm_min_tokens, pallas.fused_gemm_other_min_tokens) == (256, 512)
        assert pallas.gated_delta and pallas.ENTRY_RING_MAX_TOKENS == 4096
        assert work_list.gpu_block_rows(64) == 16 and work_list.gpu_block_rows(256) == 32
        attention_gpu.ragged_paged_attention_gpu("q", page_size=16)
    tiles = attention_gpu.DecodeTiles(0, 0, 2)
    assert calls == [(("q",), {"page_size": 16, "decode_tiles": tiles})] and traced == [tiles]
    assert (pallas.fused_gemm_min_tokens, pallas.fused_gemm_other_min_tokens, pallas.gated_delta) == (0, 0, False)
    assert "ENTRY_RING_MAX_TOKENS" not in vars(pallas)  # the class default again
    assert attention_gpu.ragged_paged_attention_gpu is kernel and work_list.ROW_TILE_16_MAX_ROWS == row_tile_16
    assert base_gemm.SKINNY_MAX_TOKENS == skinny_max and base_gemm.BaseGemm(256, skinny=True).runs_skinny(256)
    assert not default_gemm.runs(256) and default_gemm.runs(512)
    with pytest.raises(RuntimeError), applied({"fused": (128, 128), "decode-keys": 64}, backend):
        raise RuntimeError("a compile that fails")
    assert pallas.fused_gemm_min_tokens == 0 and attention_gpu.ragged_paged_attention_gpu is kernel
    with applied({}, backend) as traced:
        assert attention_gpu.ragged_paged_attention_gpu is kernel and traced == []
    with pytest.raises(SystemExit, match="needs --lora"), applied({"fused": (128, 128)}, None):
        pass
    with pytest.raises(SystemExit, match="needs --lora"), applied({"gated-delta": 1}, None):
        pass
    with pytest.raises(SystemExit, match="entry-ring knob needs --lora"), applied({"entry-ring": 8}, None):
        pass


def test_the_fused_qkv_knob_moves_q_k_v_alone_and_is_undone_after():
    backend = AutoBackend(None, fused_gemm_min_tokens=1024)
    pallas = backend.backends["pallas"]
    pallas.fused_gemm_other_min_tokens = 2048  # the Hopper default's two thresholds
    modules = ((3, False), (2, False), (1, True))  # q|k|v, gate|up, o and down
    with applied({"fused-qkv": 1024}, backend):
        assert [pallas.takes_fused_gemm(1024, *module) for module in modules] == [True, True, False]
        assert not pallas.takes_fused_gemm(512, 3, False)
    with applied({"fused-qkv": 0, "fused": (512, 512)}, backend):
        assert [pallas.takes_fused_gemm(4096, *module) for module in modules] == [False, True, True]
    assert [pallas.takes_fused_gemm(1024, *module) for module in modules] == [False, True, False]
    assert "takes_fused_gemm" not in pallas.__dict__
    with pytest.raises(SystemExit, match="fused-qkv knob needs --lora"), applied({"fused-qkv": 8}, None):
        pass


def test_each_setting_compiles_with_the_engines_options_for_its_kind_and_the_xla_knobs():
    engine = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT", "xla_gpu_memory_limit_slop_factor": 100000}
    cublas, triton = {"xla_gpu_enable_triton_gemm": False}, {"xla_gpu_enable_triton_gemm": True}
    hopper = base_gemm.BaseGemm(256, skinny=True, xla_dots=True)  # the default setting of one Hopper GPU

    def batch(tokens: int, adapters: bool):  # a base setting's batches have no adapter batch
        return SimpleNamespace(lora=object() if adapters else None, input_ids=np.zeros(tokens, np.int32))

    lora_64, lora_256, base_64 = batch(64, True), batch(256, True), batch(64, False)
    assert setting_compiler_options({}, "gpu", lora_64, hopper) == engine  # with adapters: XLA's Triton fusions
    assert setting_compiler_options({}, "gpu", lora_256, hopper) == {**engine, **cublas}  # the bucket keeping its dots
    assert setting_compiler_options({}, "gpu", lora_256, None) == engine
    assert setting_compiler_options({}, "gpu", base_64, hopper) == {**engine, **cublas}  # as the engine's
    assert setting_compiler_options({"triton-gemm": 0}, "gpu", lora_64, hopper) == {**engine, **cublas}
    assert setting_compiler_options({"triton-gemm": 1}, "gpu", base_64, None) == {**engine, **triton}
    assert setting_compiler_options({}, "cpu", lora_64, hopper) is None
    assert setting_compiler_options({"triton-gemm": 1}, "cpu", base_64, None) == triton
    slop = {"xla_gpu_memory_limit_slop_factor": 95}  # XLA's default again
    assert setting_compiler_options({"mem-slop": 95}, "gpu", lora_64, hopper) == {**engine, **slop}
    assert setting_compiler_options({"mem-slop": 95}, "cpu", lora_64, hopper) == slop


def test_pairs_alternate_round_by_round_after_an_untimed_call():
    calls = []
    times = alternate(lambda case, setting: calls.append((case, setting)), 2, 2, 1, 2)
    forward = [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert calls == [pair for pair in forward for _ in range(2)] + [pair for pair in forward[::-1] for _ in range(2)]
    assert all(len(rounds) == 2 for rounds in times.values())


def test_each_output_is_checked_against_the_first_setting_of_its_kind():
    settings = [{"base": True}, {}, {"gated-delta": 0}, {"base": True, "decode-warps": 4}]
    assert compared_with(settings) == [0, 1, 1, 0]
    assert compared_with([{}, {"fused": (1, 1)}]) == [0, 0]


def test_the_base_setting_takes_the_batches_without_adapters_and_needs_lora():
    lora, base = ["lora batch"], ["base batch"]
    assert setting_batches([{}, {"base": True}, {"fused": (1, 1)}], lora, base) == [lora, base, lora]
    with pytest.raises(SystemExit, match="needs --lora"):
        setting_batches([{"base": True}], base, base)


def test_a_fused_setting_compiles_another_forward_of_the_same_values(tmp_path):
    """Two adapters over 5 decode rows in a 128-token bucket: `default` (off on CPU) runs the SGMV path, fused=128:128
    every module's GEMM with the LoRA inside it (its pure-JAX reference here); the programs differ, their outputs
    agree, and the backend keeps its thresholds after. `base`, the batch without adapters, gives other values."""
    cfg = ModelConfig.from_model_path(make_model_dir(KERNEL_SIZED_CONFIG, str(tmp_path / "model")))
    flags = argparse.Namespace(
        gpu_gemm_min_tokens=None, lora_fused_gemm_min_tokens=None, disable_gpu_concurrent_kernels=False
    )
    cases = [parse_case("decode:5x40@128")]
    max_pages, num_pages = cache_pages(cases)
    model = build(cfg, engine_args(cfg, "native", "auto", flags), True, num_pages, 2)
    batch = jax.device_put(case_batch(cases[0], max_pages, lora_batches(3))[0])
    base_batch = jax.device_put(case_batch(cases[0], max_pages, None)[0])
    settings = [{}, {"fused": (128, 128)}, {"base": True}]
    compiled = compile_settings(model, settings, setting_batches(settings, [batch], [base_batch]))
    assert compiled[0, 0].as_text() != compiled[0, 1].as_text()
    pallas = model.lora.backend.backends["pallas"]
    assert (pallas.fused_gemm_min_tokens, pallas.fused_gemm_other_min_tokens) == (0, 0)
    kv = model.kv
    outputs = []
    for setting in range(3):
        out, kv = compiled[0, setting](model.state, kv, base_batch if setting == 2 else batch)
        outputs.append(np.asarray(out, np.float32))
    assert np.abs(outputs[1] - outputs[0]).max() <= 0.02 * np.abs(outputs[0]).max()
    rounding = np.abs(outputs[1] - outputs[0]).max()
    assert np.abs(outputs[2] - outputs[0]).max() > max(2 * rounding, 0.01 * np.abs(outputs[0]).max())

"""The whole forward compiles for TPU: libtpu, the TPU compiler, runs on this CPU host against a TPU slice it
describes (`jax.experimental.topologies`, no TPU needed), so XLA's TPU passes and Mosaic's passes over every Pallas
kernel (layouts, VMEM, alignment) run as on a TPU host. The `tpu_export` tests stop at the exported module; these go
on to the compiled program. Slices: v5e 2x2 (tpu_configs/v5e-4.json's tp 4) and v6e 2x4 (v6e-8.json's tp 8).

Nothing runs: the kernels' numbers are checked in interpret mode (tests/pallas_kernels/attention/test_tpu.py), and
speed on a TPU is not measured anywhere. Skipped where libtpu is not installed (the test extra installs it on Linux
x86_64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sgl_jax_lora.launch import parse_args
from sgl_jax_lora.model_executor.tpu_aot import (
    compile_for_tpu,
    compile_forward_programs,
    mosaic_kernels,
    tpu_slice_devices,
)
from tests.support.model_export import NUM_SLOTS, STEPS, compile_forward_for_tpu, has_libtpu, kernel_shaped_config

pytestmark = [
    pytest.mark.tpu_compile,
    pytest.mark.slow,
    pytest.mark.skipif(not has_libtpu(), reason="libtpu is not installed: pip install -e '.[test]' on Linux x86_64"),
]

SLICES = {"v5e": "v5e:2x2", "v6e": "v6e:2x4"}


@pytest.mark.parametrize("tp_size", [1, 4])
@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("chip", list(SLICES))
def test_forward_compiles_for_tpu(model_config, chip, tp_size, with_lora, step):
    compiled = compile_forward_for_tpu(model_config, SLICES[chip], tp_size, with_lora, *STEPS[step])
    # the attention kernel, and the LoRA shrink and expand kernels when LoRA is on
    assert mosaic_kernels(compiled) >= (3 if with_lora else 1)
    assert compiled.memory_analysis().argument_size_in_bytes > 0


def test_forward_compiles_for_all_eight_v6e_chips(model_config):
    compiled = compile_forward_for_tpu(model_config, SLICES["v6e"], 8, True, *STEPS["prefill_or_mixed"])
    assert mosaic_kernels(compiled) >= 3


@pytest.mark.parametrize("step", list(STEPS))
def test_forward_with_an_fp8_cache_compiles_for_tpu(model_config, step):
    compiled = compile_forward_for_tpu(
        model_config, SLICES["v5e"], 4, False, *STEPS[step], kv_dtype=jnp.float8_e4m3fn, page_size=32
    )
    assert mosaic_kernels(compiled) >= 1


@pytest.mark.parametrize("step", list(STEPS))
def test_forward_with_sliding_windows_compiles_for_tpu(tmp_path, step):
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": True}
    cfg = kernel_shaped_config(tmp_path, max_window_layers=1, **qwen2)
    compiled = compile_forward_for_tpu(cfg, SLICES["v5e"], 4, True, *STEPS[step])
    assert mosaic_kernels(compiled) >= 3


def test_forward_with_fp8_weights_compiles_for_tpu(model_config):
    compiled = compile_forward_for_tpu(model_config, SLICES["v5e"], 4, True, *STEPS["decode"], quantization="fp8")
    assert mosaic_kernels(compiled) >= 3


def test_a_kernel_mosaic_refuses_does_not_compile():
    """The harness runs Mosaic's passes: a lane-dimension slice at an offset Mosaic cannot prove 128-aligned compiles
    in interpret mode and exports, but libtpu refuses it."""
    device = tpu_slice_devices(SLICES["v5e"])[0]
    replicated = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())

    def shifted_copy(x_ref, o_ref):
        o_ref[...] = x_ref[:, pl.ds(pl.program_id(0) * 3, 128)]

    def program(x):
        out = jax.ShapeDtypeStruct((8, 128), x.dtype)
        return pl.pallas_call(shifted_copy, grid=(2,), out_shape=out)(x)

    lowered = jax.jit(program).lower(jax.ShapeDtypeStruct((8, 512), jnp.float32, sharding=replicated))
    with pytest.raises(Exception, match="Mosaic failed to compile TPU kernel"):
        compile_for_tpu(lowered)


def test_the_engines_programs_compile_for_a_tpu_preset(model_config):
    """tpu_configs/v5e-4.json's flags (tp 4, LoRA) on the kernel-shaped model: every bucket the warmup compiles,
    each LoRA segment bucket and the LoRA-free program, through `compile_forward_programs`."""
    flags = ["--config", "tpu_configs/v5e-4.json", "--model-path", model_config.model_path, "--enable-lora"]
    flags += ["--token-buckets", "8", "64", "512", "--max-running-requests", "32", "--context-length", "512"]
    flags += ["--chunked-prefill-size", "512"]
    args = parse_args(flags)
    report = compile_forward_programs(args, model_config.model_path, SLICES["v5e"], num_kv_pages=64)
    records = report.programs
    assert {(r.num_seqs, r.num_tokens) for r in records} == {(8, 8), (32, 64), (32, 512)}
    assert all(r.mosaic_kernels >= (1 if r.lora_segments is None else 3) for r in records)
    # the layer loop rolled on TPU (--layers-per-scan-step's default there): each kernel's code once, not once a layer
    assert all(r.mosaic_kernels == 2 for r in records if r.lora_segments is None)  # attention and K/V write
    segment_buckets = {r.lora_segments for r in records if r.num_tokens == 512}
    assert None in segment_buckets and len(segment_buckets) >= 2
    assert all(r.argument_bytes > 0 and r.alias_bytes > 0 for r in records)  # the KV cache is donated
    # per chip: 2 layers x 1 of the 4 kv heads x 128 dims x K and V in bf16 a token
    assert report.device_kind == "TPU v5 lite" and report.kv_bytes_per_token == 2 * 1 * 128 * 2 * 2
    assert 0 < report.weight_bytes < max(r.argument_bytes for r in records)
    assert report.kv_tokens_that_fit(0.85) > 1_000_000  # a tiny model on a 16 GiB chip


@pytest.mark.parametrize("tp_size", [1, 4])
@pytest.mark.parametrize("step", list(STEPS))
def test_the_forward_copies_neither_the_kv_cache_nor_the_adapter_pool(model_config, tp_size, step):
    """Each layer's K/V write leaves the caches in the layout the attention kernel reads, and the SGMV kernels read
    the adapter slot pool's layer stacks in the layouts the TPU holds them in: the compiled program copies neither.
    (XLA's row scatter had the whole cache copied into another layout and back, per layer; the expand reading a
    rank-16 B as [.., out, R] had every B stack copied into a lane-padded layout, every step.)"""
    compiled = compile_forward_for_tpu(model_config, SLICES["v5e"], tp_size, True, *STEPS[step])
    layers, kv_heads = model_config.num_layers, model_config.num_kv_heads // tp_size
    cache_shape = f"[{layers},{kv_heads},{64 * 16},{model_config.head_dim}]"  # forward_program's 64 pages of 16
    pool_stack = f"[{layers},{NUM_SLOTS},"  # every LoRA A and B stack: [layers, slots, ...]
    copies = [line for line in compiled.as_text().splitlines() if " copy(" in line]
    assert not [line for line in copies if cache_shape in line], copies[:2]
    assert not [line for line in copies if pool_stack in line], copies[:2]
    assert mosaic_kernels(compiled) >= 3 + 2 * layers  # attention, SGMV, and each layer's K/V write

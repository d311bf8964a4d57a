"""The skinny base GEMM (pallas_kernels/sgmv/gemm_skinny_gpu.py: the tokens as the WGMMA's N side).

On CPU: the pure-JAX reference against x @ W[layer], the shape checks, the K parts against the SMs, the pipeline depth
against shared memory, the kernel traced for Mosaic GPU (its jaxpr: one branch a token width) and lowered for CUDA
(its epilogue's transposed stores of y). The Mosaic GPU
interpreter does not take the transposed shared-memory operands the kernel hands the WGMMA, so the kernel itself runs
in the tests marked `gpu`, skipped without a Hopper-class CUDA device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sgmv.gemm_gpu import is_hopper
from pallas_kernels.sgmv.gemm_skinny_gpu import (
    MAX_SKINNY_TOKENS,
    SkinnyTiles,
    _skinny_rows,
    check_skinny_shapes,
    choose_skinny_splits,
    gemm_skinny_gpu,
    skinny_kernel_call,
)

HAS_HOPPER = is_hopper(jax.devices()[0])
LLAMA3_8B_MODULES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


@pytest.fixture
def hopper_with_132_sms(monkeypatch):
    """jax.devices() as on an H100 (132 SMs), for tracing and lowering the kernel on CPU."""

    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])


def operands(seed: int, num_tokens: int, in_dim: int, out_dim: int, layers: int = 3):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((layers, in_dim, out_dim)) / np.sqrt(in_dim), jnp.bfloat16)
    return x, w


def expected(x, w_layer) -> np.ndarray:
    return np.asarray(jnp.dot(x.astype(jnp.float32), w_layer.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST))


def test_reference_is_x_at_the_layers_w_with_the_padding_zeroed():
    x, w = operands(0, 64, 128, 256)
    rows = jnp.array([37], jnp.int32)
    y = np.asarray(jax.jit(lambda x, w: gemm_skinny_gpu(x, w, jnp.int32(2), rows, reference=True))(x, w), np.float32)
    want = expected(x, w[2])
    assert y.shape == (64, 256)
    assert np.abs(y[:37] - want[:37]).max() <= 1e-2 * np.abs(want).max()
    assert not y[37:].any()
    kept = np.asarray(gemm_skinny_gpu(x, w, jnp.int32(2), rows, reference=True, zero_padding=False), np.float32)
    assert np.abs(kept[37:] - want[37:]).max() <= 1e-2 * np.abs(want).max()  # the padding's products, not zeroed


@pytest.mark.parametrize(
    "num_tokens,in_dim,out_dim,k_splits,why",
    [
        (512, 128, 256, 1, "T=512 must be a multiple of 32 up to 256"),
        (48, 128, 256, 1, "T=48 must be a multiple of 32"),
        (64, 128, 192, 1, "out must be a multiple of 128"),
        (64, 192, 256, 2, "in of 64 x 2 K parts"),
    ],
)
def test_shapes_that_do_not_fit_are_refused_with_the_fix(num_tokens, in_dim, out_dim, k_splits, why):
    with pytest.raises(ValueError, match=why):
        check_skinny_shapes(num_tokens, in_dim, out_dim, SkinnyTiles(k_splits=k_splits))


@pytest.mark.parametrize(
    "module,expected_splits", [("qkv", 2), ("o", 4), ("gate_up", 1), ("down", 4)], ids=lambda v: str(v)
)
def test_k_parts_fill_one_wave_of_132_sms(module, expected_splits):
    in_dim, out_dim = LLAMA3_8B_MODULES[module]
    splits = choose_skinny_splits(in_dim, out_dim, 132)
    assert splits == expected_splits
    assert (out_dim // 128) * splits <= 132 or splits == 1


def test_the_widest_token_block_fits_shared_memory():
    tiles = SkinnyTiles()
    assert tiles.stages_for(MAX_SKINNY_TOKENS, 2) == 4  # bf16 output: four stages of [64, 128] W and [256, 64] x
    assert tiles.stages_for(MAX_SKINNY_TOKENS, 4) == 4  # float32 parts: the same, the epilogue's slots 32 KB
    assert SkinnyTiles(tile_k=128).stages_for(MAX_SKINNY_TOKENS, 4) == 2  # twice the bytes a stage: two stages


def test_the_kernel_traces_one_branch_a_token_width(hopper_with_132_sms):
    """The kernel traced as on a GPU: 256 tokens in widths of 32 give eight branches, each with its own pipeline
    of W blocks [4 stages, 64, 128] and x blocks of its width; split K writes float32 parts."""
    x, w = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((2 * 4096, 4096), jnp.bfloat16)
    row = jax.ShapeDtypeStruct((1,), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda *a: _skinny_rows(*a, tiles=SkinnyTiles(k_splits=4)))(x, w, row, row))
    for width in range(32, 257, 32):
        assert f"bf16[4,{width // 8},1,8,64]" in jaxpr, width  # the width's x blocks, four stages
    assert "f32[1024,4096]" in jaxpr  # four float32 parts of y [256, 4096], stacked on the rows


@pytest.mark.parametrize("module", sorted(LLAMA3_8B_MODULES))
def test_the_kernel_lowers_for_cuda_writing_y_itself(hopper_with_132_sms, module):
    """Each module's kernel call at the 256 bucket, lowered for CUDA as a Hopper GPU with 132 SMs would run it
    (Pallas' Mosaic GPU lowering refuses what it cannot lower: here the epilogue's transposed register layout stored
    into a transposed view of the slot, bf16 and float32); the call hands back y's layout [k_splits * T, out]."""
    in_dim, out_dim = LLAMA3_8B_MODULES[module]
    tiles = SkinnyTiles(k_splits=choose_skinny_splits(in_dim, out_dim, 132))
    x = jax.ShapeDtypeStruct((256, in_dim), jnp.bfloat16)
    w, row = jax.ShapeDtypeStruct((2 * in_dim, out_dim), jnp.bfloat16), jax.ShapeDtypeStruct((1,), jnp.int32)
    call = jax.jit(functools.partial(skinny_kernel_call, tiles=tiles, num_sms=132))
    lowered = call.trace(x, w, row, row).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    assert lowered.out_info.shape == (tiles.k_splits * 256, out_dim)
    assert lowered.out_info.dtype == (jnp.bfloat16 if tiles.k_splits == 1 else jnp.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
@pytest.mark.parametrize("module", sorted(LLAMA3_8B_MODULES))
@pytest.mark.parametrize("num_tokens,num_rows", [(256, 147), (256, 256), (64, 28), (128, 103), (64, 1)])
def test_kernel_matches_reference_at_llama3_8b_decode_sizes(module, num_tokens, num_rows):
    """Layer 1 of a 3-layer stack read in place: the real rows within bf16 rounding of x @ W[1], the padding zero,
    and not layer 0's product."""
    in_dim, out_dim = LLAMA3_8B_MODULES[module]
    x, w = operands(7, num_tokens, in_dim, out_dim)
    rows = jnp.array([num_rows], jnp.int32)
    y = np.asarray(jax.jit(lambda x, w, rows: gemm_skinny_gpu(x, w, jnp.int32(1), rows))(x, w, rows), np.float32)
    want = expected(x, w[1])[:num_rows]
    scale = np.abs(want).max()
    assert y.shape == (num_tokens, out_dim)
    assert np.abs(y[:num_rows] - want).max() <= 1e-2 * scale
    assert not y[num_rows:].any()
    assert np.abs(y[:num_rows] - expected(x, w[0])[:num_rows]).max() > 0.1 * scale

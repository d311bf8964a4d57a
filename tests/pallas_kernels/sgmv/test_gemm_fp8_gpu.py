"""The 8-bit float base GEMM (pallas_kernels/sgmv/gemm_fp8_gpu.py: gemm_lora_gpu.py's kernel with fp8=True).

On CPU: the pure-JAX reference against a float32 product of the same 8-bit values, the padding of T, the shape
checks, the tiles against the shared-memory budget, the kernel traced for Mosaic GPU, and the kernel run by JAX's
Mosaic GPU interpreter (each row scaled by its own scale in the epilogue). Tests marked `gpu` run the
kernel itself against the reference and are skipped without a Hopper-class CUDA device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sgmv.gemm_fp8_gpu import choose_fp8_tiles, fp8_kernel_call, gemm_fp8_gpu, gemm_fp8_gpu_rows
from pallas_kernels.sgmv.gemm_gpu import is_hopper
from tests.pallas_kernels.sgmv.test_gemm_gpu import kernel_output_is_returned, mosaic_gpu_interpreter

HAS_HOPPER = is_hopper(jax.devices()[0])
FP8 = jnp.float8_e4m3fn
LLAMA3_8B_MODULES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def operands(seed: int, num_tokens: int, in_dim: int, out_dim: int, layers: int = 3):
    """8-bit x [T, in] and a K-major [L, out, in] W stack of values spread over e4m3's range."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)) * 40, jnp.float32).astype(FP8)
    w = jnp.asarray(rng.standard_normal((layers, out_dim, in_dim)) * 40, jnp.float32).astype(FP8)
    return x, w


def expected(x, w_layer, scale):
    """The float32 product, each row times its scale (scale [T], or a scalar for every row)."""
    product = jnp.dot(x.astype(jnp.float32), w_layer.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    return product * jnp.reshape(jnp.asarray(scale, jnp.float32), (-1, 1))


def row_scales(seed: int, num_tokens: int, base: float) -> jax.Array:
    """[T] f32 per-row scales spread over a decade around `base`, as per-token activation scales are."""
    return jnp.asarray(base * np.random.default_rng(seed).uniform(0.3, 3.0, num_tokens), jnp.float32)


def relative_error(y, want) -> float:
    return float(jnp.max(jnp.abs(y.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))


def test_reference_is_the_scaled_product_of_the_layers_w():
    x, w = operands(0, 200, 256, 512)
    scale = row_scales(0, 200, 3e-5)
    y = jax.jit(lambda x, w, s, layer: gemm_fp8_gpu(x, w, s, layer, reference=True))(x, w, scale, jnp.int32(1))
    assert y.shape == (200, 512) and y.dtype == jnp.bfloat16
    assert relative_error(y, expected(x, w[1], scale)) < 1e-2  # bf16 output
    w_scales = jnp.array([1.0, 2.0, 8.0], jnp.float32)  # the layer's own W scale, from the stack's
    with_w_scales = gemm_fp8_gpu(x, w, scale, jnp.int32(2), w_scales=w_scales, reference=True, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(with_w_scales), np.asarray(expected(x, w[2], scale * 8.0)), rtol=1e-5)
    assert relative_error(y, expected(x, w[0], scale)) > 0.1  # not another layer's W
    assert relative_error(y, expected(x, w[1], jnp.mean(scale))) > 0.1  # each row its own scale
    unstacked = gemm_fp8_gpu(x, w[2], scale, reference=True, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(unstacked), np.asarray(expected(x, w[2], scale)), rtol=1e-5, atol=1e-4)
    one_scale = gemm_fp8_gpu(x, w[2], jnp.float32(3e-5), reference=True, out_dtype=jnp.float32)  # a scalar: every row
    np.testing.assert_allclose(np.asarray(one_scale), np.asarray(expected(x, w[2], 3e-5)), rtol=1e-5, atol=1e-4)


def test_scales_of_the_wrong_shape_are_refused():
    x, w = operands(0, 200, 256, 512, layers=3)
    with pytest.raises(ValueError, match="neither one per row of x"):
        gemm_fp8_gpu(x, w[0], jnp.ones((100,), jnp.float32), reference=True)
    with pytest.raises(ValueError, match="neither one scale per layer of W"):
        gemm_fp8_gpu(x, w, jnp.float32(1), jnp.int32(0), w_scales=jnp.ones((2,), jnp.float32), reference=True)


@pytest.mark.parametrize(
    "in_dim,out_dim,why", [(192, 512, "in not a multiple of 128"), (256, 384, "out not a multiple of 256")]
)
def test_shapes_that_do_not_fit_the_tiles_are_refused(in_dim, out_dim, why):
    x, w = operands(1, 128, in_dim, out_dim, layers=1)
    with pytest.raises(ValueError, match="do not fit tiles.*--quantization fp8"):
        gemm_fp8_gpu(x, w[0], jnp.float32(1), reference=True)


def test_operands_that_are_not_fp8_are_refused():
    x, w = operands(2, 128, 256, 512, layers=1)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gemm_fp8_gpu(x.astype(jnp.bfloat16), w[0], jnp.float32(1), reference=True)


def test_tiles_fit_shared_memory_with_8_bit_operands():
    """128-byte K tiles of 8-bit values: four stages of x and W tiles plus the epilogue fit, split or not."""
    for splits, out_itemsize in ((1, 2), (4, 4)):
        tiles = choose_fp8_tiles(splits)
        assert (tiles.tile_k, tiles.stages) == (128, 4)
        assert tiles.smem_bytes(0, out_itemsize=out_itemsize, in_itemsize=1) + 1024 <= 227 * 1024


def test_the_kernel_traces_with_k_major_w_and_a_scale(monkeypatch):
    """The kernel body with fp8=True, traced as on a GPU: 8-bit x tiles [128, 128] and W tiles [256, 128] (K-major)
    in shared memory, a row tile's float32 scales beside them, bf16 out; with the K loop in 2 parts, float32 parts
    summed once."""

    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])
    x = jax.ShapeDtypeStruct((256, 1024), FP8)  # 8 K steps: 4 stages deep in either part of a 2-way split
    w = jax.ShapeDtypeStruct((3 * 512, 1024), FP8)
    row, scale = jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((256,), jnp.float32)
    w_scales = jax.ShapeDtypeStruct((3,), jnp.float32)
    for splits in (1, 2):
        call = lambda *a, splits=splits: gemm_fp8_gpu_rows(  # noqa: E731
            *a, out_dim=512, tiles=choose_fp8_tiles(splits), k_splits=splits, out_dtype=jnp.bfloat16
        )
        jaxpr = jax.make_jaxpr(call)(x, w, row, w_scales, scale, row)
        text = str(jaxpr)
        assert "f8_e4m3fn[4,16,1,8,128]" in text and "f8_e4m3fn[4,32,1,8,128]" in text, text[:2000]
        assert "f32[2,128]" in text  # each consumer warpgroup's copy of the row tile's scales
        assert jaxpr.out_avals[0].shape == (256, 512) and jaxpr.out_avals[0].dtype == jnp.bfloat16
        assert ("f32[512,512]" in text and "reduce_sum" in text) == (splits == 2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper-class CUDA device (Mosaic GPU WGMMA)")
@pytest.mark.parametrize("num_tokens", [64, 200, 512, 2048])
@pytest.mark.parametrize("module", sorted(LLAMA3_8B_MODULES))
def test_gemm_fp8_gpu_matches_reference_at_llama3_8b_sizes(module, num_tokens):
    """Each Llama-3-8B layer linear, W layer 1 of a 3-layer stack read in place (each row its own scale, times the
    layer's W scale): decode sizes (split K, T padded to the row tile) and prefill sizes, against the float32 product
    of the same 8-bit values. Hopper's 8-bit WGMMA
    accumulates its products at reduced precision: down's 14336-long K loop unsplit lands at 1.1% of the largest
    output (seen on an H100), split or shorter well under 1%; hence the 2% bound."""
    in_dim, out_dim = LLAMA3_8B_MODULES[module]
    x, w = operands(3, num_tokens, in_dim, out_dim)
    scale = row_scales(3, num_tokens, 1.0 / (40 * 40 * np.sqrt(in_dim)))
    w_scales = jnp.array([0.25, 2.0, 0.5], jnp.float32)  # layer 1's applied, read from the stack's scales
    y = gemm_fp8_gpu(x, w, scale, jnp.int32(1), w_scales=w_scales)
    assert y.shape == (num_tokens, out_dim) and y.dtype == jnp.bfloat16
    want = expected(x, w[1], scale * 2.0)
    assert relative_error(y, want) < 2e-2
    assert relative_error(y, expected(x, w[0], scale * 2.0)) > 0.1
    for splits in (1, 2):
        forced = gemm_fp8_gpu(x, w, scale, jnp.int32(1), w_scales=w_scales, k_splits=splits)
        assert relative_error(forced, want) < 2e-2, splits
    rows = num_tokens * 2 // 3  # the padding's row tiles after the real tokens skipped, their rows zero
    part = gemm_fp8_gpu(x, w, scale, jnp.int32(1), jnp.full((1,), rows, jnp.int32), w_scales=w_scales)
    part = np.asarray(part.astype(jnp.float32))
    np.testing.assert_array_equal(part[:rows], np.asarray(y.astype(jnp.float32))[:rows])
    assert not part[rows:].any()


def test_zero_padding_false_leaves_the_padding_rows_to_the_consumer(monkeypatch):
    """The reference: by default zero from num_rows on; zero_padding=False returns every row's product (as the
    kernel returns its skipped rows unwritten). The kernel path, traced as on a GPU: the select after the kernel
    is left out with zero_padding=False."""
    x, w = operands(3, 256, 256, 512)
    scale, rows = jnp.float32(3e-5), jnp.array([100], jnp.int32)
    full = np.asarray(gemm_fp8_gpu(x, w, scale, jnp.int32(1), reference=True), np.float32)
    kept = gemm_fp8_gpu(x, w, scale, jnp.int32(1), rows, reference=True, zero_padding=False)
    np.testing.assert_array_equal(np.asarray(kept, np.float32), full)
    assert full[100:].any()
    zeroed = np.asarray(gemm_fp8_gpu(x, w, scale, jnp.int32(1), rows, reference=True), np.float32)
    np.testing.assert_array_equal(zeroed[:100], full[:100])
    assert not zeroed[100:].any()

    class FakeHopper:
        core_count = 132

    monkeypatch.setattr(jax, "devices", lambda *args, **kwargs: [FakeHopper()])
    shapes = (jax.ShapeDtypeStruct((256, 256), FP8), jax.ShapeDtypeStruct((3, 512, 256), FP8))
    for zero_padding in (True, False):
        call = lambda x, w, zero_padding=zero_padding: gemm_fp8_gpu(  # noqa: E731
            x, w, scale, jnp.int32(1), rows, k_splits=1, zero_padding=zero_padding
        )
        jaxpr = jax.make_jaxpr(call)(*shapes)
        assert kernel_output_is_returned(jaxpr, "gemm_fp8_gpu_rows") == (not zero_padding), zero_padding


@pytest.mark.parametrize("k_splits", [1, 2])
def test_the_kernel_scales_each_row_in_the_mosaic_gpu_interpreter(k_splits):
    """The kernel call (as gemm_fp8_gpu_rows makes it) run by the interpreter on 3 "SMs" over layer 1 of a 2-layer
    stack, 200 real rows of 256: each row of the product times its own scale, which the row tile's consumer
    warpgroups copy into shared memory while the K loop runs, and times layer 1's W scale, read from the stack's;
    split K's float32 parts scaled each, then summed."""
    interpret = mosaic_gpu_interpreter()
    if interpret is None or jax.__version_info__ < (0, 11):
        pytest.skip("needs JAX 0.11's Mosaic GPU interpreter (0.10's cannot read a transposed WGMMA operand)")
    num_tokens, in_dim, out_dim, num_rows = 256, 256, 512, 200
    x, w = operands(4, num_tokens, in_dim, out_dim, layers=2)
    scale, w_scales = row_scales(4, num_tokens, 1e-5), jnp.array([0.5, 4.0], jnp.float32)
    run = jax.jit(
        lambda x, w, scale: fp8_kernel_call(
            x,
            w.reshape(-1, in_dim),
            jnp.array([out_dim], jnp.int32),
            w_scales,
            scale,
            jnp.array([num_rows], jnp.int32),
            out_dim=out_dim,
            tiles=choose_fp8_tiles(k_splits),
            k_splits=k_splits,
            out_dtype=jnp.bfloat16,
            num_sms=3,
            interpret=interpret,
        )
    )
    y = np.asarray(run(x, w, scale), np.float32).reshape(k_splits, num_tokens, out_dim).sum(axis=0)
    want = np.asarray(expected(x, w[1], scale * w_scales[1]))
    assert np.abs(y[:num_rows] - want[:num_rows]).max() <= 1e-2 * np.abs(want).max()
    unscaled_rows = np.asarray(expected(x, w[1], jnp.mean(scale) * w_scales[1]))
    assert np.abs(y[:num_rows] - unscaled_rows[:num_rows]).max() > 0.1 * np.abs(want).max()

"""sgl_jax_lora/layers/fp8.py: 8-bit float linears (--quantization fp8).

The quantizers against e4m3's arithmetic (one scale per weight matrix and per activation row, the largest
magnitude at 448, saturation, all-zero inputs), `fp8_product` against a float32 product of the same 8-bit operands and against the 16-bit product
it stands for, a row's product independent of the other rows of the step, on both paths: XLA's dot for layers that do not fit the kernel's tiles, and the kernel's reference
under shard_map for those that do, at tp 1 and 2 (fake CPU devices), column- and row-parallel. A `Linear` built with
the fp8 setting holds an 8-bit K-major kernel and a per-layer scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sgl_jax_lora.layers.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Gemm,
    fp8_product,
    make_fp8_gemm,
    quantize_activation,
    quantize_weight,
)
from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.layers.linear import Fp8Kernel, Fp8Scale, Linear, LinearAxes
from sgl_jax_lora.layers.sharding import logical_to_sharding, make_mesh

COLUMN_PARALLEL = LinearAxes("embed", "mlp", ("mlp",))
ROW_PARALLEL = LinearAxes("mlp", "embed", ("embed",))
E4M3_STEP = 2.0**-3  # e4m3 keeps 3 mantissa bits: a normal value rounds within half of 2^-3 of itself, relative


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_quantize_weight_is_k_major_with_one_scale_per_matrix():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((3, 64, 96)) * np.array([0.01, 1.0, 50.0])[:, None, None], jnp.float32)
    q, scale = quantize_weight(w)
    assert q.shape == (3, 96, 64) and q.dtype == FP8_DTYPE and scale.shape == (3,)
    amax = np.abs(np.asarray(w)).max(axis=(1, 2))
    np.testing.assert_allclose(np.asarray(scale), amax / FP8_MAX, rtol=1e-6)
    dequantized = np.asarray(q, np.float32) * np.asarray(scale)[:, None, None]
    expected = np.swapaxes(np.asarray(w), 1, 2)
    # every value within e4m3's rounding of itself (or of the smallest subnormal step, for tiny values)
    bound = E4M3_STEP / 2 * np.abs(expected) + np.asarray(scale)[:, None, None] * 2.0**-9
    assert np.all(np.abs(dequantized - expected) <= bound + 1e-12)
    assert np.allclose(np.abs(np.asarray(q, np.float32)).max(axis=(1, 2)), FP8_MAX)  # each matrix's largest at 448


def test_quantize_activation_has_one_scale_per_row_and_survives_zeros():
    """Each row's largest magnitude maps to 448 on its own: a small row keeps its precision beside a large one."""
    x = jnp.asarray([[1.0, -2.0, 4.0], [0.0, 0.5, -0.25], [1e-3, -3e-3, 2e-3]], jnp.float32)
    xq, scale = quantize_activation(x)
    assert xq.dtype == FP8_DTYPE and scale.shape == (3,)
    np.testing.assert_allclose(np.asarray(scale), np.array([4.0, 0.5, 3e-3]) / FP8_MAX, rtol=1e-6)
    dequantized = np.asarray(xq, np.float32) * np.asarray(scale)[:, None]
    np.testing.assert_allclose(dequantized, np.asarray(x), rtol=E4M3_STEP / 2)
    assert np.allclose(np.abs(np.asarray(xq, np.float32)).max(axis=1), FP8_MAX)  # every row's largest at 448
    zq, zero_scale = quantize_activation(jnp.zeros((4, 8), jnp.bfloat16))
    assert np.all(np.asarray(zq, np.float32) == 0)
    assert np.all(np.isfinite(np.asarray(zero_scale))) and np.all(np.asarray(zero_scale) > 0)
    big = jnp.asarray([[3e38, -3e38, 1.0]], jnp.float32)  # float32 near its max: finite, saturated, never inf or nan
    bq, _ = quantize_activation(big)
    assert np.all(np.isfinite(np.asarray(bq, np.float32)))
    assert np.asarray(bq, np.float32).tolist()[0][:2] == [FP8_MAX, -FP8_MAX]


def _operands(seed: int, num_tokens: int, in_dim: int, out_dim: int, layers: int = 2):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, in_dim)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((layers, in_dim, out_dim)) / np.sqrt(in_dim), jnp.float32)
    q, scale = quantize_weight(w)
    return x, w, q, scale[:, None]


def _exact(x, q, scale, layer):
    """The float32 product of the same 8-bit operands fp8_product computes, scaled."""
    xq, x_scale = quantize_activation(x)
    product = np.asarray(xq, np.float64) @ np.asarray(q[layer], np.float64).T
    return product * np.asarray(x_scale, np.float64)[:, None] * float(scale[layer, 0])


@pytest.mark.parametrize("in_dim,out_dim", [(48, 80), (256, 512)], ids=["xla-dot", "kernel-reference"])
def test_fp8_product_is_the_scaled_product_of_the_8_bit_operands(in_dim, out_dim):
    """A layer of a stack, read through a LayerStack view as the model's layer loop hands it over: exact against the
    float64 product of the quantized operands, and within fp8's error of the float32 product it stands for."""
    x, w, q, scale = _operands(1, 37, in_dim, out_dim)
    run = jax.jit(
        lambda x, q, scale, layer: fp8_product(
            x, LayerStack(q, layer), LayerStack(scale, layer), Fp8Gemm(None, reference=True), COLUMN_PARALLEL
        )
    )
    y = run(x, q, scale, jnp.int32(1))
    assert y.shape == (37, out_dim) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), _exact(x, q, scale, 1), rtol=1e-4, atol=1e-4)
    assert rel(y, np.asarray(x) @ np.asarray(w[1])) < 0.08  # the quantization error of both operands
    assert rel(y, np.asarray(x) @ np.asarray(w[0])) > 0.5  # the other layer's W would be far off


@pytest.mark.parametrize("in_dim,out_dim", [(48, 80), (256, 512)], ids=["xla-dot", "kernel-reference"])
def test_a_rows_fp8_product_does_not_depend_on_the_other_rows_of_the_step(in_dim, out_dim):
    """Requests share a step: one whose activations are a thousand times larger (another tenant's adapter, a long
    prompt's outliers) leaves the other rows' 8-bit inputs, and so their outputs, exactly as they are. One scale for
    the whole step would coarsen every other row's quantization by that factor."""
    x, w, q, scale = _operands(4, 16, in_dim, out_dim)
    loud = x.at[8:].multiply(1000.0)
    run = jax.jit(
        lambda x, q, scale: fp8_product(
            x,
            LayerStack(q, jnp.int32(0)),
            LayerStack(scale, jnp.int32(0)),
            Fp8Gemm(None, reference=True),
            COLUMN_PARALLEL,
        )
    )
    quiet_rows, loud_rows = np.asarray(run(x, q, scale)), np.asarray(run(loud, q, scale))
    np.testing.assert_array_equal(loud_rows[:8], quiet_rows[:8])
    assert rel(quiet_rows[:8], np.asarray(x[:8]) @ np.asarray(w[0])) < 0.08


@pytest.mark.parametrize("axes", [COLUMN_PARALLEL, ROW_PARALLEL], ids=["column-parallel", "row-parallel"])
def test_fp8_product_under_tensor_parallelism(axes):
    """tp 2 on fake devices, the weight placed as the loader places it: the kernel's reference under shard_map.
    Column-parallel shards quantize the same x; row-parallel ones each their own columns of x with their own row
    scales before the all-reduce, so the result differs from tp 1 by quantization error only."""
    x, w, q, scale = _operands(2, 64, 512, 512)
    outputs = {}
    for tp in (1, 2):
        mesh = make_mesh(tp)
        placed = jax.device_put(q, logical_to_sharding(mesh, ("layers", axes.out_axis, axes.in_axis), q.shape))
        run = jax.jit(
            lambda x, q, scale, layer, mesh=mesh: fp8_product(
                x, LayerStack(q, layer), LayerStack(scale, layer), Fp8Gemm(mesh, reference=True), axes
            )
        )
        outputs[tp] = np.asarray(run(x, placed, scale, jnp.int32(0)))
    want = np.asarray(x) @ np.asarray(w[0])
    assert rel(outputs[1], want) < 0.08 and rel(outputs[2], want) < 0.08
    if axes is COLUMN_PARALLEL:
        np.testing.assert_allclose(outputs[2], outputs[1], rtol=1e-5, atol=1e-5)
    else:
        assert rel(outputs[2], outputs[1]) < 0.05


def test_make_fp8_gemm_takes_the_reference_off_hopper():
    assert make_fp8_gemm(make_mesh(1)).reference  # CPU


def test_a_linear_with_the_fp8_setting_holds_8_bit_k_major_weights():
    linear = Linear(256, (512,), 1, False, jnp.bfloat16, COLUMN_PARALLEL, fp8=Fp8Gemm(None))
    state = nnx.state(linear)
    kinds = {type(v).__name__: v.get_value() for _, v in nnx.to_flat_state(state)}
    assert kinds["Fp8Kernel"].shape == (512, 256) and kinds["Fp8Kernel"].dtype == FP8_DTYPE
    assert kinds["Fp8Scale"].shape == (1,) and kinds["Fp8Scale"].dtype == jnp.float32
    assert isinstance(linear.kernel, Fp8Kernel) and isinstance(linear.kernel_scale, Fp8Scale)
    x, w, q, scale = _operands(3, 16, 256, 512, layers=1)
    linear.kernel.set_value(q[0])
    linear.kernel_scale.set_value(scale[0])
    y = linear(x.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and rel(np.asarray(y, np.float32), np.asarray(x) @ np.asarray(w[0])) < 0.08

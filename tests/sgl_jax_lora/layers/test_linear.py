"""sgl_jax_lora/layers/linear.py: the base product comes out of the GEMM in the activations' dtype (so a row-parallel
layer all-reduces bfloat16 partials, not float32 ones), equals the float32-accumulated product rounded once, the
shard-major packing of split_packed / pack_parts round-trips, and `zero_padding` reaches the GEMM kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax_lora.layers.base_gemm import BaseGemm
from sgl_jax_lora.layers.fp8 import Fp8Gemm, quantize_weight
from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.layers.linear import Linear, LinearAxes, base_product, pack_parts, split_packed


def _inputs(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 256)), dtype)
    kernel = jnp.asarray(rng.standard_normal((256, 64)) / 16, dtype)
    return x, kernel


def test_the_gemm_itself_returns_bfloat16():
    x, kernel = _inputs(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda x, k: base_product(x, k, None))(x, kernel)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1 and dots[0].outvars[0].aval.dtype == jnp.bfloat16  # no float32 [T, out] to all-reduce


def test_bfloat16_product_is_the_float32_product_rounded_once():
    x, kernel = _inputs(jnp.bfloat16)
    exact = np.asarray(x, np.float32) @ np.asarray(kernel, np.float32)
    ours = np.asarray(base_product(x, kernel, None), np.float32)
    # one bfloat16 rounding of a float32 sum: within half a bfloat16 ulp (2^-8 relative), plus summation order
    np.testing.assert_allclose(ours, exact, rtol=2**-8, atol=1e-3)


def test_row_parallel_product_over_two_devices_equals_one_device():
    x, kernel = _inputs(jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "tensor")))
    ks = jax.device_put(kernel, NamedSharding(mesh, P("tensor", None)))
    split = jax.jit(lambda x, k: base_product(x, k, None))(xs, ks)
    np.testing.assert_allclose(np.asarray(split), np.asarray(base_product(x, kernel, None)), rtol=1e-5, atol=1e-5)


def test_split_packed_and_pack_parts_round_trip():
    tp, parts = 2, (8, 4, 4)
    y = jnp.arange(3 * sum(parts), dtype=jnp.float32).reshape(3, sum(parts))
    split = split_packed(y, parts, tp)
    assert [p.shape for p in split] == [(3, 8), (3, 4), (3, 4)]
    np.testing.assert_array_equal(np.asarray(pack_parts(split, tp)), np.asarray(y))
    # shard-major: device 0 holds the first half of every part
    np.testing.assert_array_equal(np.asarray(split[1][:, :2]), np.asarray(y[:, 4:6]))


def kernel_linear(setting: str, part_sizes: tuple[int, ...], axes: LinearAxes, seed: int):
    """x [256, 128] and a Linear whose bucket runs a GEMM kernel's CPU reference: the base GEMM kernel on a LayerStack
    view (as the model hands it over), or the 8-bit kernel on the same layer's weight quantized."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((256, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 128, sum(part_sizes))) / 12, jnp.bfloat16)
    if setting == "base_gemm":
        linear = Linear(128, part_sizes, 1, False, jnp.bfloat16, axes, base_gemm=BaseGemm(128, reference=True))
        linear.kernel.set_value(LayerStack(w, jnp.int32(1)))
    else:
        linear = Linear(128, part_sizes, 1, False, jnp.bfloat16, axes, fp8=Fp8Gemm(None, reference=True))
        q, scale = quantize_weight(w[1])
        linear.kernel.set_value(q)
        linear.kernel_scale.set_value(scale.reshape(1))
    return x, linear


@pytest.mark.parametrize("setting", ["base_gemm", "fp8"])
def test_zero_padding_false_leaves_the_gemm_kernels_padding_rows(setting):
    """The rows from num_rows[0] on, which the GEMM kernels skip: zero by default; with zero_padding=False as the
    kernel left them (its reference on CPU: the padding rows' own products), for a consumer that masks them."""
    x, linear = kernel_linear(setting, (512,), LinearAxes("embed", "qkv", ("qkv",)), seed=3)
    rows = jnp.array([100], jnp.int32)
    full = np.asarray(linear(x), np.float32)
    zeroed = np.asarray(linear(x, num_rows=rows), np.float32)
    kept = np.asarray(linear(x, num_rows=rows, zero_padding=False), np.float32)
    assert full[100:].any() and not zeroed[100:].any()
    np.testing.assert_array_equal(zeroed[:100], full[:100])
    np.testing.assert_array_equal(kept, full)


@pytest.mark.parametrize("setting", ["base_gemm", "fp8"])
def test_unfused_activation_zeroes_the_padding_rows_itself(setting):
    """The unfused silu_and_mul (a LoRA gate|up in small buckets, 8-bit weights) takes the product with its padding
    rows as the kernel left them and zeroes them in the activation: real rows as from the whole product, padding
    rows zero, though the product's own padding rows (the reference's products on CPU) are not."""
    x, linear = kernel_linear(setting, (256, 256), LinearAxes("embed", "mlp", ("mlp", "mlp")), seed=4)
    rows = jnp.array([100], jnp.int32)
    assert np.asarray(linear(x, num_rows=rows, zero_padding=False), np.float32)[100:].any()
    ours = np.asarray(linear.unfused_silu_and_mul(x, num_rows=rows), np.float32)
    gate, up = split_packed(linear(x), (256, 256), 1)
    want = np.asarray(jax.nn.silu(gate) * up, np.float32)
    assert not ours[100:].any()
    np.testing.assert_array_equal(ours[:100], want[:100])

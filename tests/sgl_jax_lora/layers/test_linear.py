"""sgl_jax_lora/layers/linear.py: the base product comes out of the GEMM in the activations' dtype (so a row-parallel
layer all-reduces bfloat16 partials, not float32 ones), equals the float32-accumulated product rounded once, and the
shard-major packing of split_packed / pack_parts round-trips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax_lora.layers.linear import base_product, pack_parts, split_packed


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

"""Down taking gate|up's product: the Pallas GPU backend's `apply_from_gated_product` (the activation and down's
shrink in one kernel, then the expand into the residual) against the activation followed by `apply_packed`, at tp 1
and over 4 devices; which backends and buckets take it; and LoRALinear's path from a `GatedProduct`."""

from __future__ import annotations

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.layers.linear import GatedProduct, LinearAxes, pack_parts
from sgl_jax_lora.lora.backend.auto import AutoBackend
from sgl_jax_lora.lora.backend.einsum import EinsumBackend
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend, prepare_on_host
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from sgl_jax_lora.lora.lora_linear import LoRALinear, LoRAModelSpec

NUM_TOKENS, MLP, HIDDEN, RANK, NUM_SLOTS, NUM_LAYERS = 32, 64, 48, 16, 4, 2


def inputs(seed: int = 0):
    """gate and up [T, MLP], down's A [L, slots, R, MLP] and B [L, slots, HIDDEN, R] stacks, a residual, and the
    step's metadata with the Pallas GPU work list (slot 0: base)."""
    rng = np.random.default_rng(seed)
    is_adapter = (np.arange(NUM_SLOTS) > 0)[None, :, None, None]
    a = rng.standard_normal((NUM_LAYERS, NUM_SLOTS, RANK, MLP)) * is_adapter / np.sqrt(MLP)
    b = rng.standard_normal((NUM_LAYERS, NUM_SLOTS, HIDDEN, RANK)) * is_adapter
    ranks = np.array([0] + [RANK] * (NUM_SLOTS - 1), np.int32)
    lora = build_lora_batch(
        rng.integers(0, NUM_SLOTS, NUM_TOKENS).astype(np.int32), 4, np.full(4, 0.5, np.float32), ranks
    )
    meta = jax.tree_util.tree_map(jnp.asarray, prepare_on_host(lora, 16))
    gate, up = (jnp.asarray(2 * rng.standard_normal((NUM_TOKENS, MLP)), jnp.float32) for _ in range(2))
    residual = jnp.asarray(rng.standard_normal((NUM_TOKENS, HIDDEN)), jnp.float32)
    return gate, up, jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), residual, meta


def expected(gate, up, a, b, residual, meta, num_rows: int):
    """The activation (padding rows zero), then the einsum backend's delta of layer 1 added into the residual."""
    h = jnp.where(jnp.arange(NUM_TOKENS)[:, None] < num_rows, jax.nn.silu(gate) * up, 0)
    out = EinsumBackend(None).apply_packed(h, a[1], (b[1],), meta, residual, tp_size=1, input_sharded=True)
    return out, h


def gated_shrink_backend(mesh=None) -> PallasGPUBackend:
    backend = PallasGPUBackend(mesh, interpret=True)
    backend.gated_shrink = True
    return backend


def test_the_activation_and_the_delta_match_the_activation_then_apply_packed():
    gate, up, a, b, residual, meta = inputs()
    rows = jnp.array([27], jnp.int32)
    backend = gated_shrink_backend()
    layer = jnp.int32(1)
    out, h = backend.apply_from_gated_product(
        jnp.concatenate([gate, up], axis=1), LayerStack(a, layer), (LayerStack(b, layer),), meta, residual,
        tp_size=1, num_rows=rows,
    )  # fmt: skip
    want_out, want_h = expected(gate, up, a, b, residual, meta, 27)
    np.testing.assert_allclose(np.asarray(h), np.asarray(want_h), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-4)
    is_base = np.asarray(meta.batch.token_slot) == 0
    assert np.array_equal(np.asarray(out)[is_base], np.asarray(residual)[is_base]), "base rows' residual untouched"


def test_over_four_devices_each_takes_its_gate_and_up_columns():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    gate, up, a, b, residual, meta = inputs(1)
    want_out, want_h = expected(gate, up, a, b, residual, meta, NUM_TOKENS)

    def put(value, spec):
        return jax.device_put(value, NamedSharding(mesh, spec))

    product = put(pack_parts([gate, up], 4), P(None, "tensor"))  # gate|up's output, shard-major
    a_s, b_s = put(a, P(None, None, None, "tensor")), put(b, P())
    backend = gated_shrink_backend(mesh)

    @jax.jit
    def run(product, a, b, residual, meta):
        layer = jnp.int32(1)
        return backend.apply_from_gated_product(
            product, LayerStack(a, layer), (LayerStack(b, layer),), meta, residual, tp_size=4, num_rows=None
        )

    out, h = run(product, a_s, b_s, put(residual, P()), jax.tree_util.tree_map(lambda v: put(v, P()), meta))
    np.testing.assert_allclose(np.asarray(h), np.asarray(want_h), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-4)


def test_which_backends_and_buckets_take_the_product():
    pallas = PallasGPUBackend(None, interpret=True, fused_gemm_min_tokens=1024, fused_gemm_other_min_tokens=2048)
    assert not pallas.takes_gated_product(1024, 48, 4096)  # off by default
    pallas.gated_shrink = True
    assert pallas.takes_gated_product(1024, 48, 4096)  # down on the SGMV path: its shrink can come with h
    assert not pallas.takes_gated_product(2048, 48, 4096)  # down on the fused GEMM, which reads h whole
    pallas.gated_shrink = False
    assert not pallas.takes_gated_product(1024, 48, 4096)
    assert not EinsumBackend(None).takes_gated_product(64, 8, 4096)
    assert not AutoBackend(None).takes_gated_product(64, 8, 4096)  # CPU: the einsum baseline


def make_down(backend) -> LoRALinear:
    spec = LoRAModelSpec(NUM_SLOTS, RANK, backend, frozenset({"down_proj"}))
    axes = LinearAxes("mlp", "embed", ("embed",))
    down = LoRALinear(MLP, (HIDDEN,), ("",), 1, False, jnp.float32, spec, row_parallel=True, axes=axes)
    _, _, a, b, _, _ = inputs()
    down.kernel[...] = jnp.asarray(np.random.default_rng(2).standard_normal((MLP, HIDDEN)), jnp.float32)
    down.lora_a[...], down.lora_b[...] = a[1], b[1]
    return down


def _ops(jaxpr, outside_pallas: bool = True) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if outside_pallas and eqn.primitive.name == "pallas_call":
            continue
        for inner in jax_core.jaxprs_in_params(eqn.params):
            names |= _ops(inner, outside_pallas)
    return names


@pytest.mark.parametrize("name", ["pallas_gpu", "einsum"])
def test_down_given_the_product_computes_what_it_computes_from_the_activation(name):
    backend = gated_shrink_backend() if name == "pallas_gpu" else EinsumBackend(None)
    down = make_down(backend)
    gate, up, _, _, residual, meta = inputs()
    rows = jnp.array([29], jnp.int32)
    product = GatedProduct(jnp.concatenate([gate, up], axis=1), rows, (MLP, MLP), 1)
    assert down.takes_gated_product(meta, NUM_TOKENS) == (name == "pallas_gpu")
    assert not down.takes_gated_product(None, NUM_TOKENS)  # no adapter in the step
    got = down(product, meta, residual=residual, num_rows=rows)
    want = down(product.activation(), meta, residual=residual, num_rows=rows)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    ops = _ops(jax.make_jaxpr(lambda p: down(p, meta, residual=residual, num_rows=rows))(product).jaxpr)
    # the Pallas backend's kernel applies the activation: XLA has no sigmoid left; the einsum backend applies it in XLA
    assert ("logistic" in ops) == (name == "einsum")

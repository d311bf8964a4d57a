"""`apply_gated`: a gate|up module's activation with its LoRA delta from the backend's gated expand, against the
delta added by `apply_packed` and XLA's activation; stacked buffers, tp 4 on fake devices, and the backends that
have no such kernel (None)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.layers.linear import pack_parts, split_packed
from sgl_jax_lora.lora.backend.auto import AutoBackend
from sgl_jax_lora.lora.backend.einsum import EinsumBackend
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend
from sgl_jax_lora.lora.backend.pallas_tpu import PallasTPUBackend
from tests.sgl_jax_lora.lora.backend.test_backends import assert_close, packed_inputs, stack_layers

WIDTH = 128  # gate's and up's width


def gate_up_inputs(seed: int, num_rows: int):
    """A gate|up module: x, A, (gate B, up B), metadata, and the [T, 2I] base product with NaN in its rows from
    num_rows on (the GEMM kernels leave them unwritten)."""
    x, lora_a, lora_bs, meta, base_out = packed_inputs(seed, num_tokens=24, dtype=jnp.float32, widths=(WIDTH, WIDTH))
    lora_a = lora_a * 0.5
    base_out = base_out.at[num_rows:].set(jnp.nan)
    return x, lora_a, lora_bs, meta, base_out


def unfused(x, lora_a, lora_bs, meta, base_out, num_rows: int) -> jax.Array:
    """The einsum backend's delta added to the product, then silu(gate) * up, rows from num_rows on zero."""
    y = EinsumBackend(None).apply_packed(x, lora_a, lora_bs, meta, base_out, tp_size=1)
    y = jnp.where(jnp.arange(y.shape[0])[:, None] < num_rows, y, 0.0)
    gate, up = split_packed(y, (WIDTH, WIDTH), 1)
    return jax.nn.silu(gate) * up


@pytest.mark.parametrize("stacked", [False, True], ids=["layer_slice", "layer_stack"])
def test_pallas_gpu_gated_expand_matches_delta_then_activation(stacked):
    num_rows = 19
    x, lora_a, lora_bs, meta, base_out = gate_up_inputs(3, num_rows)
    backend = PallasGPUBackend(None, interpret=True)
    if stacked:
        layer = jnp.int32(1)
        lora_a = LayerStack(stack_layers(lora_a, 3, 1), layer)
        lora_bs = tuple(LayerStack(stack_layers(b, 3, 1), layer) for b in lora_bs)
    rows = jnp.array([num_rows], jnp.int32)

    @jax.jit
    def run(x, lora_a, lora_bs, meta, base_out, rows):
        return backend.apply_gated(x, lora_a, lora_bs, meta, base_out, tp_size=1, num_rows=rows)

    y = run(x, lora_a, lora_bs, meta, base_out, rows)
    plain = gate_up_inputs(3, num_rows)
    expected = unfused(*plain, num_rows)
    assert y.shape == (24, WIDTH)
    assert np.all(np.isfinite(np.asarray(y))) and np.all(np.asarray(y)[num_rows:] == 0.0)
    assert_close(y, expected, jnp.float32)


def test_backends_without_a_gated_kernel_return_none():
    x, lora_a, lora_bs, meta, base_out = gate_up_inputs(4, 24)
    for backend in (
        EinsumBackend(None),
        PallasTPUBackend(None, interpret=True),
        AutoBackend(None),  # on CPU auto picks the einsum backend
        PallasGPUBackend(None, interpret=True, gated_expand=False),
    ):
        assert backend.apply_gated(x, lora_a, lora_bs, meta, base_out, tp_size=1) is None
    q_k_v = packed_inputs(4, num_tokens=24, dtype=jnp.float32)  # three parts: not a gate|up module
    assert PallasGPUBackend(None, interpret=True).apply_gated(*q_k_v, tp_size=1) is None


def test_gated_expand_at_tp_4_matches_unsharded():
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    num_rows = 21
    x, lora_a, lora_bs, meta, base_out = gate_up_inputs(5, num_rows)
    expected = unfused(*gate_up_inputs(5, num_rows), num_rows)

    def put(value, spec):
        return jax.device_put(value, NamedSharding(mesh, spec))

    a_stack = put(stack_layers(lora_a, 3, 2), P())
    b_stacks = tuple(put(stack_layers(b, 3, 2), P(None, None, "tensor", None)) for b in lora_bs)
    # the column-parallel packed product is shard-major over tp (layers/linear.py): each shard [gate_k | up_k]
    packed = pack_parts(jnp.split(base_out, 2, axis=1), 4)
    backend = PallasGPUBackend(mesh, interpret=True)

    @jax.jit
    def run(x, a_stack, b_stacks, meta, base_out, rows):
        layer = jnp.int32(2)
        a, bs = LayerStack(a_stack, layer), tuple(LayerStack(b, layer) for b in b_stacks)
        return backend.apply_gated(x, a, bs, meta, base_out, tp_size=4, output_sharded=True, num_rows=rows)

    meta_s = jax.tree_util.tree_map(lambda v: put(v, P()), meta)
    rows = jnp.array([num_rows], jnp.int32)
    y = run(put(x, P()), a_stack, b_stacks, meta_s, put(packed, P(None, "tensor")), rows)
    assert_close(y, expected, jnp.float32)

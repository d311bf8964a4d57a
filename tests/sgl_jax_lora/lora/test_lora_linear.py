"""LoRALinear: the residual form (row-parallel o/down) equals adding the residual, and its LoRA kernels do not
wait for the base GEMM."""

from __future__ import annotations

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.layers.linear import LinearAxes
from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from sgl_jax_lora.lora.backend.einsum import EinsumBackend
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend
from sgl_jax_lora.lora.lora_batch import build_lora_batch
from sgl_jax_lora.lora.lora_linear import LoRALinear, LoRAModelSpec

BACKENDS = {
    "einsum": lambda: EinsumBackend(None),
    "bgmv": lambda: BgmvBackend(None),
    "pallas_gpu": lambda: PallasGPUBackend(None, interpret=True),
}
NUM_TOKENS, IN_DIM, OUT_DIM, MAX_RANK, NUM_SLOTS = 24, 64, 32, 16, 4


def make_layer(backend, seed: int = 0) -> LoRALinear:
    """A row-parallel LoRALinear (o_proj-like) with random base and adapter weights; slot 0 is the base."""
    rng = np.random.default_rng(seed)
    spec = LoRAModelSpec(num_slots=NUM_SLOTS, max_rank=MAX_RANK, backend=backend, target_modules=frozenset({"o_proj"}))
    layer = LoRALinear(
        IN_DIM,
        (OUT_DIM,),
        ("",),
        tp_size=1,
        use_bias=False,
        dtype=jnp.float32,
        spec=spec,
        row_parallel=True,
        axes=LinearAxes("heads", "embed", ("embed",)),
    )
    layer.kernel[...] = jnp.asarray(rng.standard_normal((IN_DIM, OUT_DIM)), jnp.float32)
    is_adapter = (np.arange(NUM_SLOTS) > 0)[:, None, None]
    layer.lora_a[...] = jnp.asarray(rng.standard_normal((NUM_SLOTS, MAX_RANK, IN_DIM)) * is_adapter, jnp.float32)
    layer.lora_b[...] = jnp.asarray(rng.standard_normal((NUM_SLOTS, OUT_DIM, MAX_RANK)) * is_adapter, jnp.float32)
    return layer


def prepared(layer: LoRALinear, lora):
    """The step's metadata from the layer's backend, as the model's forward builds it."""
    return layer.backend.prepare(lora, num_seqs=NUM_TOKENS)


def make_batch(seed: int = 1):
    rng = np.random.default_rng(seed)
    token_slot = rng.integers(0, NUM_SLOTS, NUM_TOKENS).astype(np.int32)
    ranks = np.array([0] + [MAX_RANK] * (NUM_SLOTS - 1), np.int32)
    scale = np.where(ranks > 0, 0.5, 0.0).astype(np.float32)
    lora = jax.tree_util.tree_map(jnp.asarray, build_lora_batch(token_slot, 4, scale, ranks))
    x = jnp.asarray(rng.standard_normal((NUM_TOKENS, IN_DIM)), jnp.float32)
    residual = jnp.asarray(rng.standard_normal((NUM_TOKENS, OUT_DIM)), jnp.float32)
    return x, residual, lora


@pytest.mark.parametrize("name", list(BACKENDS))
def test_residual_form_equals_adding_the_residual(name):
    layer = make_layer(BACKENDS[name]())
    x, residual, lora = make_batch()
    expected = np.asarray(residual) + np.asarray(layer(x, prepared(layer, lora)))
    np.testing.assert_allclose(
        np.asarray(layer(x, prepared(layer, lora), residual=residual)), expected, rtol=1e-5, atol=1e-4
    )
    without_lora = np.asarray(residual) + np.asarray(layer.base(x))
    np.testing.assert_allclose(np.asarray(layer(x, None, residual=residual)), without_lora, rtol=1e-6)


def _contains(eqn, primitive: str) -> bool:
    """Whether eqn is, or its sub-jaxprs (jit, shard_map, ...) hold, an op of this primitive."""
    inner = (e for j in jax_core.jaxprs_in_params(eqn.params) for e in j.eqns)
    return eqn.primitive.name == primitive or any(_contains(e, primitive) for e in inner)


def kernels_after_base_gemm(jaxpr) -> int:
    """How many top-level ops that run a Pallas kernel take (directly or through other ops) the output of the
    first top-level op that runs the base GEMM (the first dot_general that is not inside a Pallas op)."""
    depends: set = set()
    count = 0
    for eqn in jaxpr.eqns:
        is_kernel = _contains(eqn, "pallas_call")
        if not depends and not is_kernel and _contains(eqn, "dot_general"):
            depends.update(eqn.outvars)
            continue
        if any(v in depends for v in eqn.invars if isinstance(v, jax_core.Var)):
            depends.update(eqn.outvars)
            count += is_kernel
    return count


def test_row_parallel_lora_kernels_do_not_wait_for_the_base_gemm():
    # with the residual, the expand kernel adds into the residual, so neither kernel needs the GEMM's result and
    # the GPU may run them beside it; without it, the expand adds into the GEMM's output and must wait
    layer = make_layer(BACKENDS["pallas_gpu"]())
    x, residual, lora = make_batch()
    with_residual = jax.make_jaxpr(lambda x, r: layer(x, prepared(layer, lora), residual=r))(x, residual).jaxpr
    into_base = jax.make_jaxpr(lambda x: layer(x, prepared(layer, lora)))(x).jaxpr
    assert kernels_after_base_gemm(into_base) >= 1
    assert kernels_after_base_gemm(with_residual) == 0

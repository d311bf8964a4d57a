"""LoRALinear: the residual form (row-parallel o/down) equals adding the residual, its LoRA kernels do not
wait for the base GEMM, a column-parallel module's shrink runs before its base GEMM (the Pallas GPU backend's
`shrink_first`), and `zero_padding` reaches the GEMM with the LoRA inside it and the base GEMM kernel."""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.layers.base_gemm import BaseGemm
from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.layers.linear import LinearAxes
from sgl_jax_lora.lora.backend.base import LoRAMeta
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


@dataclasses.dataclass(frozen=True)
class RunsBaseGemm(LoRAMeta):
    runs_base_gemm = True  # the layers hand the backend their base weight this step


class DeclinesTheBaseGemm(EinsumBackend):
    """Records the zero_padding of each apply_with_base call and declines it (as for a module that does not fit)."""

    def __init__(self):
        super().__init__(None)
        self.zero_padding = []

    def apply_with_base(self, *args, zero_padding: bool = True, **kwargs):
        self.zero_padding.append(zero_padding)
        return None


def make_qkv_layer(
    backend,
    seed: int = 5,
    in_dim: int = IN_DIM,
    parts: tuple[int, int, int] = (32, 16, 16),
    dtype=jnp.float32,
    base_gemm: BaseGemm | None = None,
    weight_scale: float = 1.0,
) -> LoRALinear:
    """A column-parallel LoRALinear of three packed parts (q|k|v-like), random base and adapter weights (standard
    normal times weight_scale); slot 0 is the base."""
    rng = np.random.default_rng(seed)
    spec = LoRAModelSpec(num_slots=NUM_SLOTS, max_rank=MAX_RANK, backend=backend, target_modules=frozenset({"qkv"}))
    layer = LoRALinear(
        in_dim,
        parts,
        ("q", "k", "v"),
        tp_size=1,
        use_bias=False,
        dtype=dtype,
        spec=spec,
        row_parallel=False,
        axes=LinearAxes("embed", "qkv", ("heads", "kv_heads", "kv_heads")),
        base_gemm=base_gemm,
    )

    def random(shape, mask=1.0):
        return jnp.asarray(rng.standard_normal(shape) * weight_scale * mask, dtype)

    layer.kernel[...] = random((in_dim, sum(parts)))
    is_adapter = (np.arange(NUM_SLOTS) > 0)[:, None, None]
    layer.lora_a[...] = random((NUM_SLOTS, len(parts) * MAX_RANK, in_dim), is_adapter)
    for name, width in zip(("q", "k", "v"), parts):
        getattr(layer, f"lora_b_{name}")[...] = random((NUM_SLOTS, width, MAX_RANK), is_adapter)
    return layer


def test_zero_padding_reaches_the_fused_gemm_and_the_base_gemm_kernel():
    """q|k|v-like (column-parallel, three parts) in a bucket that runs the base GEMM kernel (its reference on CPU):
    zero_padding goes to apply_with_base; where that declines, to the base GEMM, whose padding rows (from
    num_rows[0] on, base tokens: no delta) are zero by default and the padding tokens' own products with False."""
    rng = np.random.default_rng(4)
    backend = DeclinesTheBaseGemm()
    layer = make_qkv_layer(
        backend, 4, 128, (256, 128, 128), jnp.bfloat16, BaseGemm(128, reference=True), weight_scale=1 / 12
    )
    w = jnp.asarray(rng.standard_normal((2, 128, 512)) / 12, jnp.bfloat16)
    layer.kernel.set_value(LayerStack(w, jnp.int32(0)))  # the view the model hands over in such buckets
    token_slot = np.where(np.arange(256) < 200, rng.integers(1, NUM_SLOTS, 256), 0).astype(np.int32)
    ranks = np.array([0] + [MAX_RANK] * (NUM_SLOTS - 1), np.int32)
    scale = np.where(ranks > 0, 0.5, 0.0).astype(np.float32)
    meta = RunsBaseGemm(jax.tree_util.tree_map(jnp.asarray, build_lora_batch(token_slot, 4, scale, ranks)))
    x = jnp.asarray(rng.standard_normal((256, 128)), jnp.bfloat16)
    rows = jnp.array([200], jnp.int32)
    full = np.asarray(layer(x, meta), np.float32)
    zeroed = np.asarray(layer(x, meta, num_rows=rows), np.float32)
    kept = np.asarray(layer(x, meta, num_rows=rows, zero_padding=False), np.float32)
    assert backend.zero_padding == [True, True, False]
    assert full[200:].any() and not zeroed[200:].any()
    np.testing.assert_array_equal(zeroed[:200], full[:200])
    np.testing.assert_array_equal(kept, full)
    without_lora = np.asarray(layer(x, None, num_rows=rows, zero_padding=False), np.float32)  # Linear's path
    np.testing.assert_array_equal(without_lora[200:], full[200:])


def gemm_waits_for_a_kernel(jaxpr) -> bool:
    """Whether the first top-level op that runs the base GEMM (a dot_general outside any Pallas op) takes, directly
    or through other ops, the output of an op that runs a Pallas kernel."""
    after_kernel: set = set()
    for eqn in jaxpr.eqns:
        reads_kernel_output = any(v in after_kernel for v in eqn.invars if isinstance(v, jax_core.Var))
        is_kernel = _contains(eqn, "pallas_call")
        if not is_kernel and _contains(eqn, "dot_general"):
            return reads_kernel_output
        if is_kernel or reads_kernel_output:
            after_kernel.update(eqn.outvars)
    raise AssertionError("no base GEMM in the jaxpr")


def test_shrink_first_orders_the_shrink_before_the_base_gemm():
    # the Pallas GPU backend's default: the base GEMM reads x held behind the shrink, and no kernel reads the GEMM's
    # output, so the expand runs beside it; without shrink_first the GEMM and the shrink both read x (the GEMM's
    # tiles may then take every SM first); the outputs are the same
    backend = BACKENDS["pallas_gpu"]()
    assert backend.shrink_first
    layer = make_qkv_layer(backend)
    x, _, lora = make_batch()
    meta = prepared(layer, lora)
    held = np.asarray(layer(x, meta))
    held_jaxpr = jax.make_jaxpr(lambda x: layer(x, meta))(x).jaxpr
    backend.shrink_first = False
    unordered = np.asarray(layer(x, meta))
    unordered_jaxpr = jax.make_jaxpr(lambda x: layer(x, meta))(x).jaxpr
    assert gemm_waits_for_a_kernel(held_jaxpr) and kernels_after_base_gemm(held_jaxpr) == 0
    assert not gemm_waits_for_a_kernel(unordered_jaxpr)
    np.testing.assert_array_equal(held, unordered)
    without_lora = np.asarray(layer(x, None))
    assert np.abs(held - without_lora).max() > 1.0  # the adapters' delta is in it


def test_shrink_first_leaves_row_parallel_modules_as_they_were():
    # o|down add their delta into the residual (their kernels already free of the GEMM): no held input, and called
    # without a residual they add in place after the GEMM as before
    layer = make_layer(BACKENDS["pallas_gpu"]())
    x, residual, lora = make_batch()
    with_residual = jax.make_jaxpr(lambda x, r: layer(x, prepared(layer, lora), residual=r))(x, residual).jaxpr
    into_base = jax.make_jaxpr(lambda x: layer(x, prepared(layer, lora)))(x).jaxpr
    assert not gemm_waits_for_a_kernel(with_residual) and not gemm_waits_for_a_kernel(into_base)

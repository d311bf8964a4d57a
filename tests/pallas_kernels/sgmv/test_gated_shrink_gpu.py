"""The activation + shrink kernel (pallas_kernels/sgmv/gated_shrink_gpu.py) against its pure-JAX reference.

On CPU the Triton kernel runs in interpret mode; the `gpu` test runs it for real at down's shape in the 1024 bucket
(skipped without CUDA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sgmv.gated_shrink_gpu import silu_mul_shrink_gpu, silu_mul_shrink_ref
from pallas_kernels.sgmv.gpu import choose_tiles, sgmv_shrink_gpu_partials
from pallas_kernels.sgmv.work_list import make_work_list, padded_perm
from sgl_jax_lora.lora.lora_batch import build_lora_batch

HAS_CUDA = jax.default_backend() == "gpu"


def make_batch(seed: int, num_tokens: int, in_dim: int, max_rank: int, slot_ranks, num_segments: int, dtype):
    """A [T, 2 * in] product with wide values (silu's curve on both sides), A zero above each slot's rank, and a
    LoRABatch of tokens on random slots (slot 0: base)."""
    rng = np.random.default_rng(seed)
    ranks = np.array(slot_ranks, np.int32)
    token_slot = rng.integers(0, len(ranks), num_tokens).astype(np.int32)
    lora_a = rng.standard_normal((len(ranks), max_rank, in_dim)) * (
        np.arange(max_rank)[None, :, None] < ranks[:, None, None]
    )
    scale = np.where(ranks > 0, 1.0, 0.0).astype(np.float32)
    lora = jax.tree_util.tree_map(jnp.asarray, build_lora_batch(token_slot, num_segments, scale, ranks))
    product = jnp.asarray(3 * rng.standard_normal((num_tokens, 2 * in_dim)), dtype)
    return product, jnp.asarray(lora_a / np.sqrt(in_dim), dtype), lora


def run(product, lora_a, lora, num_rows: int, *, interpret: bool, layer=None, stack=None):
    meta = (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)
    rank = lora_a.shape[-2]
    tiles = choose_tiles(product.shape[0], lora.num_segments, product.shape[1] // 2, None, shrink_rank=rank)
    rows = jnp.array([num_rows], jnp.int32)
    a = lora_a if stack is None else stack
    return silu_mul_shrink_gpu(
        product, a, *meta, rows, layer=layer, tiles=tiles, rank_block=rank, interpret=interpret
    )  # fmt: skip


def check(product, lora_a, lora, num_rows: int, tolerance: float, *, interpret: bool = True) -> None:
    meta = (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)
    h, partials = run(product, lora_a, lora, num_rows, interpret=interpret)
    h_ref, s_ref = silu_mul_shrink_ref(product, lora_a, *meta, jnp.array([num_rows]), rank_block=lora_a.shape[-2])
    assert h.dtype == product.dtype and partials.dtype == jnp.float32
    h, h_ref = np.asarray(h, np.float32), np.asarray(h_ref, np.float32)
    np.testing.assert_allclose(h, h_ref, rtol=tolerance, atol=tolerance * np.abs(h_ref).max())
    assert not h[num_rows:].any(), "the padding rows' activation must be zero"
    s, s_ref = np.asarray(partials.sum(0)), np.asarray(s_ref)
    np.testing.assert_allclose(s, s_ref, rtol=tolerance, atol=tolerance * np.abs(s_ref).max())
    is_base = np.asarray(lora.token_slot) == 0
    assert not s[is_base].any(), "base tokens' shrink must be exactly zero"


@pytest.mark.parametrize(
    "num_tokens,in_dim,num_rows,num_segments",
    [(40, 256, 40, 8), (64, 384, 37, 8), (16, 88, 11, 4)],
    ids=["every-row-real", "padding-rows-after-37", "odd-in-88"],
)
def test_the_activation_and_shrink_match_the_reference(num_tokens, in_dim, num_rows, num_segments):
    product, lora_a, lora = make_batch(0, num_tokens, in_dim, 16, (0, 4, 8, 16), num_segments, jnp.float32)
    check(product, lora_a, lora, num_rows, 1e-5)


def test_bf16_product_rounds_h_as_the_shrink_reads_it():
    """In bf16 the shrink multiplies the stored h: its partials equal the SGMV shrink kernel's over that h."""
    product, lora_a, lora = make_batch(1, 48, 256, 16, (0, 16, 16), 4, jnp.bfloat16)
    check(product, lora_a, lora, 48, 2e-2)
    h, partials = run(product, lora_a, lora, 48, interpret=True)
    meta = (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)
    tiles = choose_tiles(48, lora.num_segments, 256, None, shrink_rank=16)
    shrink = sgmv_shrink_gpu_partials(h, lora_a, *meta, tiles=tiles, rank_block=16, interpret=True)
    np.testing.assert_array_equal(np.asarray(partials), np.asarray(shrink))


def test_a_layer_of_a_stack_and_the_work_list_given():
    product, lora_a, lora = make_batch(2, 32, 128, 16, (0, 8, 16), 4, jnp.float32)
    stack = jnp.stack([jnp.zeros_like(lora_a), lora_a])
    meta = (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)
    tiles = choose_tiles(32, lora.num_segments, 128, None, shrink_rank=16)
    work = make_work_list(lora.seg_start, lora.seg_slot, lora.slot_rank, 32, tiles.block_rows)
    perm = padded_perm(lora.sort_perm, tiles.block_rows, jnp)
    rows = jnp.array([30], jnp.int32)
    h, partials = silu_mul_shrink_gpu(
        product, stack, *meta, rows, work, perm, jnp.int32(1), tiles=tiles, rank_block=16, interpret=True
    )
    h_ref, s_ref = silu_mul_shrink_ref(product, lora_a, *meta, rows, rank_block=16)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(partials.sum(0)), np.asarray(s_ref), rtol=1e-5, atol=1e-4)


def test_shapes_that_do_not_pair_are_refused():
    product, lora_a, lora = make_batch(3, 16, 64, 16, (0, 16), 2, jnp.float32)
    tiles = choose_tiles(16, lora.num_segments, 64, None, shrink_rank=16)
    meta = (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)
    with pytest.raises(ValueError, match=r"must be \[T, 2 \* in\]"):
        silu_mul_shrink_gpu(product[:, :96], lora_a, *meta, jnp.array([16]), tiles=tiles, interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_the_kernel_on_the_gpu_at_downs_shape_in_the_1024_bucket():
    """751 real rows of 32 adapters in the 1024 bucket, down's in = 14336, rank 16, bf16."""
    product, lora_a, lora = make_batch(4, 1024, 14336, 16, (0,) + (16,) * 32, 48, jnp.bfloat16)
    check(product, lora_a, lora, 751, 2e-2, interpret=False)

"""sgl_jax_lora/models/forward_batch.py: ForwardBatch is a pytree of its arrays in field order (an absent LoRA batch
or `input_from_prev` contributes no leaf, a LoRABatch its own leaves), so it crosses into jit whole and comes back
out of tree_map as a ForwardBatch; its token and sequence counts are the bucket's shapes, and each bucket (or the
presence of a LoRA batch) is its own compiled program while new values of one bucket reuse it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.lora.lora_batch import build_lora_batch
from sgl_jax_lora.models.forward_batch import ForwardBatch


def batch(num_tokens: int = 6, num_seqs: int = 2, pages: int = 3, lora=None, input_from_prev=None) -> ForwardBatch:
    """Sequence 0 has tokens [0, 4) at positions 5..8, sequence 1 tokens [4, 5); the rest is padding."""
    i32 = np.int32
    return ForwardBatch(
        input_ids=np.arange(10, 10 + num_tokens, dtype=i32),
        positions=np.array([5, 6, 7, 8, 0] + [0] * (num_tokens - 5), i32),
        cache_loc=np.array([9, 10, 11, 12, 4] + [0] * (num_tokens - 5), i32),
        seq_lens=np.array([9, 1] + [0] * (num_seqs - 2), i32),
        page_table=np.arange(num_seqs * pages, dtype=i32).reshape(num_seqs, pages),
        cu_q_lens=np.array([0, 4] + [5] * (num_seqs - 1), i32),
        last_token_index=np.array([3, 4] + [0] * (num_seqs - 2), i32),
        lora=lora,
        input_from_prev=input_from_prev,
    )


def test_counts_are_the_bucket_shapes():
    fb = batch(num_tokens=8, num_seqs=4)
    assert (fb.num_tokens, fb.num_seqs) == (8, 4)


def test_leaves_are_the_arrays_in_field_order_without_absent_ones():
    fb = batch()
    leaves = jax.tree_util.tree_leaves(fb)
    assert len(leaves) == 7
    assert leaves[0] is fb.input_ids and leaves[3] is fb.seq_lens and leaves[6] is fb.last_token_index
    with_prev = batch(input_from_prev=np.full(6, -1, np.int32))
    assert jax.tree_util.tree_leaves(with_prev)[-1] is with_prev.input_from_prev


def test_a_lora_batch_adds_its_leaves():
    lora = build_lora_batch(np.array([1, 1, 0, 2, 0, 0]), 4, np.array([0, 2.0, 0.5]), np.array([0, 4, 8]))
    fb = batch(lora=lora)
    assert len(jax.tree_util.tree_leaves(fb)) == 7 + 6
    doubled = jax.tree_util.tree_map(lambda a: a * 2, fb)
    assert isinstance(doubled, ForwardBatch)
    np.testing.assert_array_equal(doubled.lora.slot_scale, [0, 4.0, 1.0])
    np.testing.assert_array_equal(doubled.cu_q_lens, [0, 8, 10])


def test_it_crosses_into_jit_and_back():
    @jax.jit
    def step(fb: ForwardBatch):
        last_ids = fb.input_ids[fb.last_token_index]
        return last_ids, dataclasses.replace(fb, positions=fb.positions + 1)

    last_ids, out = step(batch())
    np.testing.assert_array_equal(last_ids, [13, 14])
    assert isinstance(out, ForwardBatch) and out.lora is None and out.input_from_prev is None
    np.testing.assert_array_equal(out.positions, [6, 7, 8, 9, 1, 1])


def test_each_bucket_is_its_own_program_and_values_reuse_it():
    traced = []

    @jax.jit
    def step(fb: ForwardBatch):
        traced.append((fb.num_tokens, fb.num_seqs, fb.lora is None))
        return jnp.sum(fb.input_ids) + jnp.sum(fb.seq_lens)

    step(batch(6, 2))
    other_values = dataclasses.replace(batch(6, 2), input_ids=np.zeros(6, np.int32))
    assert int(step(other_values)) == 10
    step(batch(8, 2))
    step(batch(8, 4))
    step(batch(8, 4, lora=build_lora_batch(np.zeros(8), 2, np.zeros(3), np.zeros(3))))
    assert traced == [(6, 2, True), (8, 2, True), (8, 4, True), (8, 4, False)]


def test_it_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch().lora = None

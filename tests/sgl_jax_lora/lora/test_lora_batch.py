"""sgl_jax_lora/lora/lora_batch.py: build_lora_batch sorts tokens stably by slot, cuts the sorted order into one
segment per distinct slot, pads the segment bucket with empty slot-0 segments at the end, snapshots the pool's
scales and ranks, refuses a batch with more slots than segments; LoRABatch is a pytree that crosses jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.lora.lora_batch import LoRABatch, build_lora_batch, lora_runs, max_lora_runs

SCALE = np.array([0.0, 2.0, 0.5, 1.0], np.float32)
RANK = np.array([0, 8, 4, 0], np.int32)


def test_segments_of_a_mixed_batch():
    token_slot = np.array([2, 0, 1, 2, 0, 1, 1, 0], np.int32)
    lora = build_lora_batch(token_slot, 5, SCALE, RANK)
    # stable: slot 0 tokens 1, 4, 7; slot 1 tokens 2, 5, 6; slot 2 tokens 0, 3
    assert lora.sort_perm.tolist() == [1, 4, 7, 2, 5, 6, 0, 3]
    assert lora.seg_start.tolist() == [0, 3, 6, 8, 8, 8]
    assert lora.seg_slot.tolist() == [0, 1, 2, 0, 0]
    assert lora.num_segments == 5
    assert lora.token_slot.tolist() == token_slot.tolist()


def test_every_token_lies_in_the_segment_of_its_own_slot():
    rng = np.random.default_rng(0)
    token_slot = rng.integers(0, 4, 50).astype(np.int32)
    lora = build_lora_batch(token_slot, 6, SCALE, RANK)
    assert sorted(lora.sort_perm.tolist()) == list(range(50))
    for g in range(lora.num_segments):
        tokens = lora.sort_perm[lora.seg_start[g] : lora.seg_start[g + 1]]
        assert (token_slot[tokens] == lora.seg_slot[g]).all()
        assert list(tokens) == sorted(tokens)  # stable: original order within a segment
    assert lora.seg_start[-1] == 50


def test_one_adapter_without_base_tokens():
    lora = build_lora_batch(np.array([3, 3, 3]), 2, SCALE, RANK)
    assert lora.seg_start.tolist() == [0, 3, 3]
    assert lora.seg_slot.tolist() == [3, 0]  # the padded segment is empty, slot 0


def test_empty_batch_has_only_empty_segments():
    lora = build_lora_batch(np.zeros((0,), np.int32), 3, SCALE, RANK)
    assert lora.sort_perm.shape == (0,)
    assert lora.seg_start.tolist() == [0, 0, 0, 0]
    assert lora.seg_slot.tolist() == [0, 0, 0]


def test_too_many_slots_for_the_segment_bucket_is_refused():
    build_lora_batch(np.array([0, 1, 2]), 3, SCALE, RANK)  # exactly fits
    with pytest.raises(ValueError, match="3 distinct LoRA slots but the segment bucket is 2"):
        build_lora_batch(np.array([0, 1, 2]), 2, SCALE, RANK)


def test_dtypes_and_a_snapshot_of_scales_and_ranks():
    scale, rank = SCALE.copy(), RANK.copy()
    lora = build_lora_batch([1, 0], 2, scale, rank)
    scale[1], rank[1] = 99.0, 99  # the pool changes for the next step
    assert lora.slot_scale.tolist() == [0.0, 2.0, 0.5, 1.0]
    assert lora.slot_rank.tolist() == [0, 8, 4, 0]
    for field in ("token_slot", "sort_perm", "seg_start", "seg_slot", "slot_rank"):
        assert getattr(lora, field).dtype == np.int32, field
    assert lora.slot_scale.dtype == np.float32


def test_lora_batch_crosses_jit_as_a_pytree():
    lora = build_lora_batch(np.array([2, 0, 2, 1]), 4, SCALE, RANK)
    leaves, treedef = jax.tree_util.tree_flatten(lora)
    assert len(leaves) == 6

    @jax.jit
    def per_token_scale(batch: LoRABatch) -> jax.Array:
        return batch.slot_scale[batch.token_slot] + batch.num_segments

    np.testing.assert_array_equal(np.asarray(per_token_scale(lora)), [4.5, 4.0, 4.5, 6.0])
    rebuilt = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(leaf) for leaf in leaves])
    assert isinstance(rebuilt, LoRABatch) and rebuilt.num_segments == 4


def test_adapter_runs_are_checked_against_slots_and_chunks():
    """The engine's steps group decode rows by slot before their prefill chunks, so a step has at most one run of
    adapter tokens per adapter slot plus one per chunk (`max_lora_runs`); a step past that is refused on the host,
    where the GPU backend's entry table would otherwise drop its runs past the bound."""
    assert lora_runs(np.array([1, 1, 0, 2, 2, 0, 0, 1, 3], np.int32)) == 4
    assert lora_runs(np.array([0, 0], np.int32)) == 0 and lora_runs(np.zeros(0, np.int32)) == 0
    assert max_lora_runs(num_slots=4, max_chunks=2) == 5
    scale, rank = np.array([0, 1, 1, 1], np.float32), np.array([0, 8, 8, 8], np.int32)
    grouped = np.array([1, 1, 2, 3, 3, 0, 2, 2, 1, 0], np.int32)  # 3 slots' decode rows, then 2 chunks
    assert build_lora_batch(grouped, 4, scale, rank, max_chunks=2).token_slot.shape == (10,)
    interleaved = np.array([1, 2, 1, 2, 3, 1], np.int32)  # decode rows not grouped: 6 runs > 3 + 2
    with pytest.raises(ValueError, match="6 runs of adapter tokens, more than 5"):
        build_lora_batch(interleaved, 4, scale, rank, max_chunks=2)
    build_lora_batch(interleaved, 4, scale, rank)  # without max_chunks (tests, benchmarks) nothing is checked

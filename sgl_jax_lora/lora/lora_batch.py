"""LoRABatch: the per-step LoRA metadata that crosses into jit inside ForwardBatch.

Flow: the Scheduler admits requests, LoRAManager.reserve giving each adapter its device slot ->
LoRAManager.lora_batch (`build_lora_batch`) turns the per-token slots into this pytree on the host (numpy) ->
ForwardBatch carries it to the model -> every LoRALinear hands it to the LoRA backend (einsum / bgmv / sgmv / pallas).

Slot 0 is the base model: its A/B rows are all zeros, so base tokens get an exactly-zero delta.
Segments are the runs of equal slot after a stable sort of the tokens by slot; the number of segments
is padded to a static bucket G with empty segments (start == end == T) whose slot is 0.

The batch may also carry the GPU SGMV kernels' work list (pallas_kernels/sgmv/work_list.py), so that no
layer's kernel call rebuilds it: the model builds it once per forward inside jit (`with_work_list`, a few
tiny device ops; no host time and no extra host->device transfers per step), or a caller may build it here
on the host (`build_lora_batch(work_block_rows=...)`, numpy, same values). In prefill buckets that run the base
GEMM with the LoRA inside it, the model adds that kernel's entry table the same way (`with_entry_table`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sgmv.gemm_lora_gpu import EntryTable, build_entry_table
from pallas_kernels.sgmv.work_list import WorkList, make_work_list, make_work_list_host, padded_perm


@dataclasses.dataclass(frozen=True)
class LoRABatch:
    token_slot: jax.Array  # [T] i32   device slot of each token's adapter; 0 = base (all-zero weights)
    sort_perm: jax.Array  # [T] i32    token indices ordered by slot (stable); sorted[i] = x[sort_perm[i]]
    seg_start: jax.Array  # [G+1] i32  segment boundaries in sorted order; seg g = [seg_start[g], seg_start[g+1])
    seg_slot: jax.Array  # [G] i32     slot of each segment; padded (empty) segments use slot 0
    slot_scale: jax.Array  # [A] f32   scaling of each slot's adapter (alpha/r, alpha/sqrt(r) with rslora); 0 for slot 0
    slot_rank: jax.Array  # [A] i32    true rank of each slot (<= max rank); 0 for slot 0 and empty slots
    work: WorkList | None = None  # (row tile, segment) items for row tiles of `work_block_rows`
    work_perm: jax.Array | None = None  # [T rounded up to work_block_rows] i32 sort_perm padded with T
    work_block_rows: int = 0  # static; 0 = no precomputed work list
    entries: EntryTable | None = None  # runs of one adapter per row tile, for the GEMM with the LoRA inside it

    @property
    def num_segments(self) -> int:
        return self.seg_slot.shape[0]


jax.tree_util.register_dataclass(
    LoRABatch,
    data_fields=[
        "token_slot",
        "sort_perm",
        "seg_start",
        "seg_slot",
        "slot_scale",
        "slot_rank",
        "work",
        "work_perm",
        "entries",
    ],
    meta_fields=["work_block_rows"],
)


def build_lora_batch(
    token_slot: np.ndarray,
    num_segments: int,
    slot_scale: np.ndarray,
    slot_rank: np.ndarray,
    work_block_rows: int = 0,
) -> LoRABatch:
    """Host-side construction of a LoRABatch (numpy leaves).

    token_slot: [T] i32, already padded to the token bucket (padding tokens use slot 0).
    num_segments: G, the static segment bucket; must be >= the number of distinct slots in token_slot.
    slot_scale: [A] f32; slot_rank: [A] i32.
    work_block_rows: > 0 also builds the kernels' work list for row tiles of this size.
    """
    token_slot = np.asarray(token_slot, dtype=np.int32)
    num_tokens = token_slot.shape[0]
    sort_perm = np.argsort(token_slot, kind="stable").astype(np.int32)
    sorted_slots = token_slot[sort_perm]
    if num_tokens:
        is_new = np.concatenate([[True], sorted_slots[1:] != sorted_slots[:-1]])
        starts = np.flatnonzero(is_new).astype(np.int32)
        slots = sorted_slots[starts]
    else:
        starts = np.zeros((0,), np.int32)
        slots = np.zeros((0,), np.int32)
    num_used = starts.shape[0]
    if num_used > num_segments:
        raise ValueError(
            f"batch has {num_used} distinct LoRA slots but the segment bucket is {num_segments}; "
            "raise the active-adapter bucket (this is an engine bug if the scheduler admitted the batch)"
        )
    seg_start = np.full((num_segments + 1,), num_tokens, np.int32)
    seg_start[:num_used] = starts
    seg_slot = np.zeros((num_segments,), np.int32)
    seg_slot[:num_used] = slots
    slot_rank = np.array(slot_rank, np.int32)  # copies: a snapshot of the pool, which the next step may change
    work, work_perm = None, None
    if work_block_rows:
        work = make_work_list_host(seg_start, seg_slot, slot_rank, num_tokens, work_block_rows)
        work_perm = padded_perm(sort_perm, work_block_rows)
    return LoRABatch(
        token_slot=token_slot,
        sort_perm=sort_perm,
        seg_start=seg_start,
        seg_slot=seg_slot,
        slot_scale=np.array(slot_scale, np.float32),
        slot_rank=slot_rank,
        work=work,
        work_perm=work_perm,
        work_block_rows=work_block_rows,
    )


def with_work_list(lora: LoRABatch, block_rows: int) -> LoRABatch:
    """The batch with the kernels' work list for row tiles of `block_rows`, built inside jit unless the batch
    already carries one for those tiles (block_rows 0: the batch as it is)."""
    if not block_rows or lora.work_block_rows == block_rows:
        return lora
    num_tokens = lora.token_slot.shape[0]
    work = make_work_list(lora.seg_start, lora.seg_slot, lora.slot_rank, num_tokens, block_rows)
    return dataclasses.replace(
        lora, work=work, work_perm=padded_perm(lora.sort_perm, block_rows, jnp), work_block_rows=block_rows
    )


def with_entry_table(lora: LoRABatch, tile_rows: int, num_seqs: int) -> LoRABatch:
    """The batch with the entry table of the GEMM that has the LoRA inside it (pallas_kernels/sgmv/gemm_lora_gpu.py),
    built inside jit for row tiles of `tile_rows` (0: the batch as it is).

    Its static size is a bound that holds for every extend batch of the bucket. An entry is a (row tile, run of
    one adapter) pair. Each sequence's tokens are contiguous (managers/schedule_batch.py), so there are at most
    `num_seqs` runs; a run meets one tile more than the tile boundaries it crosses, and each of the
    T / tile_rows - 1 boundaries is crossed by one run at most: at most T / tile_rows + num_seqs - 1 entries."""
    if not tile_rows:
        return lora
    num_tokens = lora.token_slot.shape[0]
    max_entries = num_tokens // tile_rows + num_seqs - 1
    table = build_entry_table(lora.token_slot, lora.slot_scale, tile_m=tile_rows, max_entries=max_entries)
    return dataclasses.replace(lora, entries=table)

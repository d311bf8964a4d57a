"""LoRABatch: the per-step LoRA metadata that crosses into jit inside ForwardBatch.

Flow: the Scheduler admits requests, LoRAManager.reserve giving each adapter its device slot ->
LoRAManager.lora_batch (`build_lora_batch`) turns the per-token slots into this pytree on the host (numpy) ->
ForwardBatch carries it to the model -> every LoRALinear hands it to the LoRA backend (einsum / bgmv / sgmv / pallas).

Slot 0 is the base model: its A/B rows are all zeros, so base tokens get an exactly-zero delta.
Segments are the runs of equal slot after a stable sort of the tokens by slot; the number of segments
is padded to a static bucket G with empty segments (start == end == T) whose slot is 0.

`max_lora_runs` bounds the runs of one adapter's tokens in an engine step (checked here on the host, given
max_chunks). A LoRABatch is plain per-step data: no kernel's structures. Each backend turns it into its own
metadata once per forward (`LoRABackend.prepare`, lora/backend/base.py), e.g. the Pallas GPU kernels' work list.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class LoRABatch:
    token_slot: jax.Array  # [T] i32   device slot of each token's adapter; 0 = base (all-zero weights)
    sort_perm: jax.Array  # [T] i32    token indices ordered by slot (stable); sorted[i] = x[sort_perm[i]]
    seg_start: jax.Array  # [G+1] i32  segment boundaries in sorted order; seg g = [seg_start[g], seg_start[g+1])
    seg_slot: jax.Array  # [G] i32     slot of each segment; padded (empty) segments use slot 0
    slot_scale: jax.Array  # [A] f32   scaling of each slot's adapter (alpha/r, alpha/sqrt(r) with rslora); 0 for slot 0
    slot_rank: jax.Array  # [A] i32    true rank of each slot (<= max rank); 0 for slot 0 and empty slots

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
    ],
    meta_fields=[],
)


def max_lora_runs(num_slots: int, max_chunks: int) -> int:
    """The most runs of one adapter's tokens (in token order) a step of the engine holds: its decode rows grouped by
    slot (managers/schedule_batch.py `group_rows_by_slot`) give one run per adapter slot, and each of at most
    max_chunks prefill chunks (--max-prefill-seqs) one more."""
    return num_slots - 1 + max_chunks


def lora_runs(token_slot: np.ndarray) -> int:
    """Runs of equal non-zero slot in token order (host)."""
    is_start = token_slot[1:] != token_slot[:-1]
    return int(np.count_nonzero(token_slot[:1]) + np.count_nonzero(is_start & (token_slot[1:] != 0)))


def build_lora_batch(
    token_slot: np.ndarray,
    num_segments: int,
    slot_scale: np.ndarray,
    slot_rank: np.ndarray,
    max_chunks: int | None = None,
) -> LoRABatch:
    """Host-side construction of a LoRABatch (numpy leaves).

    token_slot: [T] i32, already padded to the token bucket (padding tokens use slot 0).
    num_segments: G, the static segment bucket; must be >= the number of distinct slots in token_slot.
    slot_scale: [A] f32; slot_rank: [A] i32.
    max_chunks: the engine's --max-prefill-seqs; given, the adapter runs of token_slot must stay within
    `max_lora_runs` (the bound the GPU backend sizes the fused GEMM's entry table by), else ValueError.
    """
    token_slot = np.asarray(token_slot, dtype=np.int32)
    if max_chunks is not None:
        runs, bound = lora_runs(token_slot), max_lora_runs(len(slot_scale), max_chunks)
        if runs > bound:
            raise ValueError(
                f"step has {runs} runs of adapter tokens, more than {bound} (adapter slots + --max-prefill-seqs "
                f"{max_chunks}): its decode rows must be grouped by adapter slot before the prefill chunks (an engine bug)"
            )
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
    return LoRABatch(
        token_slot=token_slot,
        sort_perm=sort_perm,
        seg_start=seg_start,
        seg_slot=seg_slot,
        slot_scale=np.array(slot_scale, np.float32),
        slot_rank=slot_rank,
    )


def padding_lora_batches(
    num_tokens: int, segment_buckets: tuple[int, ...], slot_scale: np.ndarray, slot_rank: np.ndarray, base_program: bool
) -> list[LoRABatch | None]:
    """One all-base LoRABatch of num_tokens per segment bucket (and None first for the LoRA-free program when
    base_program): the batches that compile every LoRA program of a token bucket (the warmup's, and the ahead-of-time
    compile's, model_executor/tpu_aot.py)."""
    zeros = np.zeros(num_tokens, np.int32)
    return ([None] if base_program else []) + [
        build_lora_batch(zeros, g, slot_scale, slot_rank) for g in segment_buckets
    ]

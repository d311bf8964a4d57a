"""ForwardBatch: everything one model step needs, as one explicit pytree that crosses into jit.

Flow:
  Scheduler builds a ScheduleBatch (host, python objects)
    -> ScheduleBatch.to_forward_batch(bucket) pads everything to a compiled bucket (numpy)
    -> ModelRunner.forward(params, kv_cache, forward_batch, prev_ids) (one host->device transfer of this pytree;
       tokens sampled by the step still in flight come from `prev_ids` on the device, see `input_from_prev`)
    -> model layers read the fields they need; LoRALinear layers read `lora`.

Static facts (the bucket) are meta fields, so each bucket is its own compiled program; arrays are data
fields. Padding tokens write their K/V to cache slot 0 (page 0 is never handed out) and padding sequences
have seq_len 0, so padding never changes a real request's result.
"""

from __future__ import annotations

import dataclasses

import jax

from sgl_jax_lora.lora.lora_batch import LoRABatch


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    # Tokens of this step, flat over sequences (each sequence's tokens contiguous).
    input_ids: jax.Array  # [T] i32
    positions: jax.Array  # [T] i32   absolute position of each token in its sequence
    cache_loc: jax.Array  # [T] i32   KV-cache slot (page * page_size + offset) each token writes; 0 = padding
    # Sequences of this step.
    seq_lens: jax.Array  # [S] i32      tokens in the KV cache after this step (prefix + new); 0 = padding
    page_table: jax.Array  # [S, P] i32 pages of each sequence, in order; unused entries 0
    # Query rows: the new tokens laid out [R, Q], each row holding up to Q consecutive tokens of one sequence.
    # Decode: R = S, Q = 1 (row i = sequence i). Extend: Q = the query tile, a sequence takes ceil(n / Q) rows.
    query_seq: jax.Array  # [R] i32     sequence of each query row
    query_index: jax.Array  # [R, Q] i32 flat token index of each row's q-th token
    query_valid: jax.Array  # [R, Q] bool
    token_row: jax.Array  # [T] i32     position r * Q + q of each token in the [R, Q] layout
    last_token_index: jax.Array  # [S] i32  flat index of each sequence's last token (its logits are sampled)
    lora: LoRABatch | None  # per-token adapter slots and segments; None when LoRA is disabled
    is_decode: bool  # meta: decode step (one new token per sequence) vs extend (prefill chunk)
    # [T] i32: row of the previous step's sampled ids that holds this token's id, for a token sampled by the
    # step still in flight (overlap schedule; its id is not on the host yet); -1: input_ids holds the id.
    # None: every id is in input_ids (callers outside the engine loop).
    input_from_prev: jax.Array | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


jax.tree_util.register_dataclass(
    ForwardBatch,
    data_fields=[
        "input_ids",
        "positions",
        "cache_loc",
        "seq_lens",
        "page_table",
        "query_seq",
        "query_index",
        "query_valid",
        "token_row",
        "last_token_index",
        "lora",
        "input_from_prev",
    ],
    meta_fields=["is_decode"],
)

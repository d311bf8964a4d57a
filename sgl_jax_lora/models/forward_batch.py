"""ForwardBatch: everything one model step needs, as one explicit pytree that crosses into jit.

Flow:
  Scheduler builds a ScheduleBatch (host, python objects): decode rows and prefill chunks of one ragged step
    -> ScheduleBatch.to_forward_batch(buckets) pads everything to a compiled token bucket (numpy)
    -> ModelRunner.forward(forward_batch, prev_ids) (one host->device transfer of this pytree; tokens sampled by
       the step still in flight come from `prev_ids` on the device, see `input_from_prev`)
    -> the model (models/llama.py) reads the fields it needs and hands the layers theirs: attention gets the
       ragged layout (cu_q_lens, seq_lens, page_table), the LoRA backend `lora`.

Every field is an array but the static `decode_only`; the bucket is the arrays' shapes (and decode_only), so each
bucket is its own compiled program. Padding tokens write their K/V to cache slot 0 (page 0 is never handed out) and
padding sequences have no tokens and seq_len 0, so padding never changes a real request's result.

Where it sits: models, the lowest package that reads a whole ForwardBatch (the model's input, with the KV cache);
the layers below take the arrays they need, and the runner, the multi-host commands and the scheduler's
ScheduleBatch above build or carry it.
"""

from __future__ import annotations

import dataclasses

import jax

from sgl_jax_lora.lora.lora_batch import LoRABatch


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    # Tokens of this step, flat over sequences (each sequence's tokens contiguous, sequences in order).
    input_ids: jax.Array  # [T] i32
    positions: jax.Array  # [T] i32   absolute position of each token in its sequence
    cache_loc: jax.Array  # [T] i32   KV-cache slot (page * page_size + offset) each token writes; 0 = padding
    # Sequences of this step: a decode row has one token, a prefill chunk many.
    seq_lens: jax.Array  # [S] i32      tokens in the KV cache after this step (prefix + new); 0 = padding
    page_table: jax.Array  # [S, P] i32 pages of each sequence, in order; unused entries 0
    cu_q_lens: jax.Array  # [S+1] i32   sequence s's tokens are [cu_q_lens[s], cu_q_lens[s+1]); padding after
    last_token_index: jax.Array  # [S] i32  flat index of each sequence's last token (its logits are sampled)
    lora: LoRABatch | None  # per-token adapter slots and segments; None when no token uses an adapter
    # [T] i32: row of the previous step's sampled ids that holds this token's id, for a token sampled by the
    # step still in flight (overlap schedule; its id is not on the host yet); -1: input_ids holds the id.
    # None: every id is in input_ids (callers outside the engine loop).
    input_from_prev: jax.Array | None = None
    # Every sequence has one token (a decode step), and the engine runs such steps in programs of their own
    # (Buckets.decode_programs): the attention backend may leave out its prefill path. Static: its own program.
    decode_only: bool = False

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
        "cu_q_lens",
        "last_token_index",
        "lora",
        "input_from_prev",
    ],
    meta_fields=["decode_only"],
)

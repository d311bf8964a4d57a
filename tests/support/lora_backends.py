"""LoRA backends one operation at a time, for tests: a module's shrink, expand or whole LoRA (`apply`) over a
LoRABatch, through whichever backend `AutoBackend` picks for the bucket (the engine itself only calls
`prepare`, `apply_packed` and `apply_with_base`); random slot weights as the memory pool lays them out and a
per-token numpy reference of the delta."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax_lora.lora.backend.auto import AutoBackend
from sgl_jax_lora.lora.backend.base import LoRABackend
from sgl_jax_lora.lora.lora_batch import LoRABatch


def resolved(backend: LoRABackend, num_tokens: int, lora: LoRABatch, out_features: int = 0) -> LoRABackend:
    """The backend that runs a module of `out_features` columns in this bucket (AutoBackend: its choice)."""
    if isinstance(backend, AutoBackend):
        return backend.chosen(num_tokens, lora.num_segments, out_features)
    return backend


def shrink(
    backend: LoRABackend,
    x: jax.Array,
    lora_a: jax.Array,
    lora: LoRABatch,
    *,
    input_sharded: bool = False,
    rank_block: int | None = None,
) -> jax.Array:
    """x [T, in], lora_a [A, R, in] -> [T, R] float32."""
    chosen = resolved(backend, x.shape[0], lora)
    return chosen.shrink(x, lora_a, lora, input_sharded=input_sharded, rank_block=rank_block)


def expand(
    backend: LoRABackend,
    s: jax.Array,
    lora_b: jax.Array,
    lora: LoRABatch,
    *,
    output_sharded: bool = False,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """s [T, R] float32, lora_b [A, out, R] -> [T, out] out_dtype."""
    chosen = resolved(backend, s.shape[0], lora, lora_b.shape[1])
    return chosen.expand(s, lora_b, lora, output_sharded=output_sharded, out_dtype=out_dtype)


def apply(
    backend: LoRABackend,
    x: jax.Array,
    lora_a: jax.Array,
    lora_b: jax.Array,
    lora: LoRABatch,
    *,
    input_sharded: bool = False,
    output_sharded: bool = False,
    base_out: jax.Array | None = None,
) -> jax.Array:
    """One single-part module's LoRA as the engine runs it (`prepare`, then `apply_packed`): base_out + delta
    in base_out's dtype, or (no base_out) the delta alone in x.dtype."""
    if base_out is None:
        base_out = jnp.zeros((x.shape[0], lora_b.shape[1]), x.dtype)
    meta = backend.prepare(lora, num_seqs=x.shape[0])
    return backend.apply_packed(
        x, lora_a, (lora_b,), meta, base_out, tp_size=1, input_sharded=input_sharded, output_sharded=output_sharded
    )


def random_slots(
    seed: int, *, num_tokens: int, in_dim: int, out_dim: int, slot_ranks: tuple[int, ...], max_rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x [T, in], lora_a [A, R, in], lora_b [A, out, R], token_slot [T]) float32 / int32, as the memory pool lays
    slots out: slot 0 (the base model) and the rows and columns above each slot's rank are zero."""
    rng = np.random.default_rng(seed)
    ranks = np.array(slot_ranks)
    x = rng.standard_normal((num_tokens, in_dim)).astype(np.float32)
    row = np.arange(max_rank)
    live = row[None, :] < ranks[:, None]  # [A, R]
    lora_a = (rng.standard_normal((len(ranks), max_rank, in_dim)) * live[:, :, None]).astype(np.float32)
    lora_b = (rng.standard_normal((len(ranks), out_dim, max_rank)) * live[:, None, :]).astype(np.float32)
    token_slot = rng.integers(0, len(ranks), num_tokens).astype(np.int32)
    return x, lora_a, lora_b, token_slot


def per_token_reference(
    x: np.ndarray, lora_a: np.ndarray, lora_b: np.ndarray, token_slot: np.ndarray, slot_scale: np.ndarray
) -> np.ndarray:
    """[T, out] float64: scale[slot_t] * (x_t @ A[slot_t].T) @ B[slot_t].T, one token at a time in numpy."""
    x, lora_a, lora_b = (np.asarray(t, np.float64) for t in (x, lora_a, lora_b))
    out = np.zeros((x.shape[0], lora_b.shape[1]))
    for t, slot in enumerate(np.asarray(token_slot)):
        out[t] = slot_scale[slot] * ((x[t] @ lora_a[slot].T) @ lora_b[slot].T)
    return out

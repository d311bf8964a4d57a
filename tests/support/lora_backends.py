"""LoRA backends one operation at a time, for tests: a module's shrink, expand or whole LoRA (`apply`) over a
LoRABatch, through whichever backend `AutoBackend` picks for the bucket (the engine itself only calls
`prepare`, `apply_packed` and `apply_with_base`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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

"""Pure-JAX reference for ragged paged attention: what every attention kernel of this package must compute.

One call covers a whole step: sequence s owns the query tokens q[cu_q_lens[s] : cu_q_lens[s+1]] (decode rows of one
token and prefill chunks of many, in any mix) and, after this step's K/V were written, kv_lens[s] tokens in the cache.
Its i-th query sits at absolute position p = kv_lens[s] - q_len + i and attends causally to the keys at positions up
to its own, or, with a sliding window W, to the W keys ending at its own (positions p - W + 1 .. p: Mistral's and
Qwen2's `sliding_window`, as HF transformers masks it). Key position j of sequence s lives in cache slot
page_table[s, j // page_size] * page_size + j % page_size of layer `layer` of the caches [L, K, N, D] (the engine's
layout, mem_cache/kv_cache.py). Query head h reads kv head h // (H / K) (GQA). Tokens past cu_q_lens[S] (padding)
give zeros.

The reference is written for clarity, not speed: it gathers every key of each token's sequence ([T, P * page_size]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ragged_paged_attention_ref(
    q: jax.Array,  # [T, H, D]
    k_cache: jax.Array,  # [L, K, N, D]
    v_cache: jax.Array,  # [L, K, N, D]
    layer: jax.Array,  # [] i32
    kv_lens: jax.Array,  # [S] i32   tokens of each sequence in the cache, this step's included
    page_table: jax.Array,  # [S, P] i32
    cu_q_lens: jax.Array,  # [S+1] i32 cumulative query lengths; cu_q_lens[0] = 0
    *,
    page_size: int,
    scale: float,
    sliding_window: jax.Array | int | None = None,
) -> jax.Array:
    """-> [T, H, D] in q's dtype; products in float32. sliding_window: W ([] or [1] i32, or an int), the keys a
    query attends to, itself included; None: every key up to its own."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_seqs, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads
    key_len = pages_per_seq * page_size

    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, token, side="right") - 1, 0, num_seqs - 1)  # [T]
    is_real = token < cu_q_lens[-1]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    query_pos = kv_lens[seq] - q_len + (token - cu_q_lens[seq])  # [T]

    key_pos = jnp.arange(key_len, dtype=jnp.int32)
    slots = page_table[:, key_pos // page_size] * page_size + key_pos % page_size  # [S, Lk]
    k_layer = jax.lax.dynamic_index_in_dim(k_cache, layer, keepdims=False)  # [K, N, D]
    v_layer = jax.lax.dynamic_index_in_dim(v_cache, layer, keepdims=False)
    keys = k_layer[:, slots[seq]].astype(jnp.float32)  # [K, T, Lk, D]
    values = v_layer[:, slots[seq]].astype(jnp.float32)

    queries = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,ktld->tkgl", queries, keys, precision=jax.lax.Precision.HIGHEST) * scale
    mask = (key_pos[None, :] <= query_pos[:, None]) & is_real[:, None]  # [T, Lk]
    if sliding_window is not None:
        window = jnp.asarray(sliding_window, jnp.int32).reshape(())
        mask &= key_pos[None, :] > query_pos[:, None] - window
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jnp.where(mask[:, None, None, :], jax.nn.softmax(jnp.where(mask[:, None, None, :], scores, -1e30), -1), 0.0)
    values = jnp.where(mask[None, :, :, None], values, 0.0)  # unread slots may hold stale, non-finite values
    out = jnp.einsum("tkgl,ktld->tkgd", probs, values, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)

"""Paged attention in pure JAX (CPU, GPU and TPU alike).

Flow: a decoder layer writes this step's K/V into the paged cache at ForwardBatch.cache_loc, then calls
`paged_attention`, which gathers each sequence's pages (page_table), lays the new query tokens out in rows
[R, Q] (query_index; each row holds tokens of one sequence, query_seq) and applies a causal mask by absolute
position. Decode steps (R = S, Q = 1) run batched; extend steps loop over rows (buckets.extend_query_layout),
so the score matrix is [heads, Q, keys] for one row at a time and its size follows the step's tokens, not S x T.

The KV cache per layer is [kv_heads, num_slots, head_dim] with slot = page * page_size + offset; page 0
is a scratch page that padding tokens write into and no sequence reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sgl_jax_lora.model_executor.forward_batch import ForwardBatch

_MASKED = -1e30


def write_kv(
    k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, k: jax.Array, v: jax.Array, cache_loc: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's k/v [T, K, D] into layer `layer` of the caches [L, K, N, D]."""
    k_cache = k_cache.at[layer, :, cache_loc].set(k.astype(k_cache.dtype))  # indexed dims first: value is [T, K, D]
    v_cache = v_cache.at[layer, :, cache_loc].set(v.astype(v_cache.dtype))
    return k_cache, v_cache


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    batch: ForwardBatch,
    page_size: int,
    scale: float,
) -> jax.Array:
    """q [T, H, D], caches [L, K, N, D] (layer `layer` already holding this step's tokens) -> [T, H, D].

    Heads lead the cache layout, so gathering a sequence's slots yields [K, S, L, D] with the batch dims of the
    score and value products already in front: no transpose of the gathered K/V. The caches come whole and
    each gather picks the layer itself: extend steps gather inside a loop over rows, and a layer slice made
    outside that loop would be a copy of the layer's cache (2 x 328 MB per layer for Llama-3-8B with 160k
    cached tokens; docs/benchmarks.md "Session 19").
    """
    num_seqs, pages_per_seq = batch.page_table.shape
    num_rows, num_queries = batch.query_index.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    key_len = pages_per_seq * page_size

    key_slots = (batch.page_table[:, :, None] * page_size + jnp.arange(page_size)[None, None, :]).reshape(
        num_seqs, key_len
    )  # [S, L]
    queries = q[batch.query_index].reshape(num_rows, num_queries, num_kv_heads, group, head_dim)  # [R, Q, K, G, D]
    query_pos = batch.positions[batch.query_index]  # [R, Q]
    key_pos = jnp.arange(key_len)

    if batch.is_decode:  # row i is sequence i
        key_valid = key_pos[None, :] < batch.seq_lens[:, None]
        mask = (key_pos[None, :] <= query_pos) & key_valid & batch.query_valid  # [S, L]
        qs = queries[:, 0].transpose(1, 0, 2, 3)  # [K, S, G, D]
        keys, values = _gather_layer(k_cache, layer, key_slots), _gather_layer(v_cache, layer, key_slots)  # [K, S, L, D]
        scores = jnp.einsum("ksgd,ksld->ksgl", qs, keys, preferred_element_type=jnp.float32) * scale
        probs = _masked_softmax(scores, mask[None, :, None, :]).astype(values.dtype)
        out = jnp.einsum("ksgl,ksld->ksgd", probs, values, preferred_element_type=jnp.float32)
        out = out.transpose(1, 0, 2, 3)[:, None]  # [S, 1, K, G, D]
    else:
        row_lens = batch.seq_lens[batch.query_seq]  # [R]
        mask = (
            (key_pos[None, None, :] <= query_pos[:, :, None])
            & (key_pos[None, None, :] < row_lens[:, None, None])
            & batch.query_valid[:, :, None]
        )  # [R, Q, L]

        def attend_row(args):
            qs, slots, m = args  # [Q, K, G, D], [L], [Q, L]
            keys, values = _gather_layer(k_cache, layer, slots), _gather_layer(v_cache, layer, slots)  # [K, L, D]
            qs = qs.transpose(1, 2, 0, 3)  # [K, G, Q, D]
            scores = jnp.einsum("kgqd,kld->kgql", qs, keys, preferred_element_type=jnp.float32) * scale
            probs = _masked_softmax(scores, m[None, None]).astype(values.dtype)
            out = jnp.einsum("kgql,kld->kgqd", probs, values, preferred_element_type=jnp.float32)
            return out.transpose(2, 0, 1, 3)  # [Q, K, G, D]

        out = jax.lax.map(attend_row, (queries, key_slots[batch.query_seq], mask))
    out = out.astype(q.dtype).reshape(num_rows * num_queries, num_heads, head_dim)
    return out[batch.token_row]


def _gather_layer(cache: jax.Array, layer: jax.Array, slots: jax.Array) -> jax.Array:
    """cache [L, K, N, D] -> [K, *slots.shape, D]: layer `layer`'s rows at `slots` (slice and gather fuse)."""
    return jax.lax.dynamic_index_in_dim(cache, layer, keepdims=False)[:, slots]


def _masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis where mask holds; fully masked rows (padding) give zeros, not NaN."""
    scores = jnp.where(mask, scores, _MASKED)
    return jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)

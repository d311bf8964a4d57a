"""The TPU attention kernel's static tiling and a step's q-block layout (which sequences each q block holds).

Where it sits: `tpu.py`'s `ragged_paged_attention_tpu` tiles every call with `choose_tiling`; the q-block layout is
the same in every layer of a step, so the model builds it once per forward (`plan_ragged_attention_tpu`, through
`sgl_jax_lora.layers.attention.plan_attention`) and hands the `TpuAttentionPlan` to each layer's call; a call given
none builds its own. What exists here: `Tiling`, `sublane_tile`, `round_up`, `tokens_per_q_block`, `choose_tiling`,
`num_q_blocks`, `block_sequences`, `TpuAttentionPlan` and `plan_ragged_attention_tpu`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

LANES = 128
_DEFAULT_ROWS_PER_Q_BLOCK = 128
_DEFAULT_KEYS_PER_KV_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static block sizes of one call."""

    page_size: int
    pages_per_seq: int  # P: columns of the page table
    pages_per_kv_block: int
    tokens_per_q_block: int  # BQ
    group: int  # G: query heads per kv head

    @property
    def keys_per_kv_block(self) -> int:
        return self.pages_per_kv_block * self.page_size

    @property
    def rows(self) -> int:
        return self.tokens_per_q_block * self.group


def sublane_tile(dtype: jnp.dtype) -> int:
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def tokens_per_q_block(num_tokens: int, group: int, q_dtype, num_queries_per_block: int | None = None) -> int:
    """BQ: the tokens of a q tile, BQ * G about 128 rows on q's sublane tile and at most T rounded up (or the
    caller's num_queries_per_block)."""
    if num_queries_per_block is not None:
        return num_queries_per_block
    sublane = sublane_tile(q_dtype)
    token_align = sublane // math.gcd(group, sublane)  # smallest BQ with BQ * G on the sublane tile
    wanted = round_up(max(1, _DEFAULT_ROWS_PER_Q_BLOCK // group), token_align)
    return min(wanted, round_up(max(num_tokens, 1), token_align))


def choose_tiling(
    q: jax.Array,
    k_cache: jax.Array,
    page_table: jax.Array,
    page_size: int,
    num_kv_pages_per_block: int | None,
    num_queries_per_block: int | None,
) -> Tiling:
    num_tokens, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[1]
    pages_per_seq = page_table.shape[1]
    num_queries_per_block = tokens_per_q_block(num_tokens, group, q.dtype, num_queries_per_block)
    if num_kv_pages_per_block is None:  # short page tables need no 512-key block, but keep it whole lanes
        lane_pages = max(1, LANES // page_size)
        wanted = max(1, _DEFAULT_KEYS_PER_KV_BLOCK // page_size)
        num_kv_pages_per_block = min(wanted, round_up(pages_per_seq, lane_pages))
    if num_queries_per_block < 1 or num_kv_pages_per_block < 1:
        raise ValueError("ragged_paged_attention_tpu: num_queries_per_block and num_kv_pages_per_block must be >= 1")
    return Tiling(page_size, pages_per_seq, num_kv_pages_per_block, num_queries_per_block, group)


def num_q_blocks(num_tokens: int, tokens_per_block: int) -> int:
    """The q blocks of a call: T tokens in tiles of BQ (at least one)."""
    return max(1, -(-num_tokens // tokens_per_block))


def block_sequences(cu_q_lens: jax.Array, num_blocks: int, tokens_per_block: int) -> tuple[jax.Array, jax.Array]:
    """[NB] i32 first and last sequence with tokens in each q block; last < first for blocks of padding only."""
    num_seqs = cu_q_lens.shape[0] - 1
    first_token = jnp.arange(num_blocks, dtype=jnp.int32) * tokens_per_block
    num_real = cu_q_lens[-1]
    last_token = jnp.minimum(first_token + tokens_per_block, num_real) - 1
    seq_of = lambda token: jnp.clip(jnp.searchsorted(cu_q_lens, token, side="right") - 1, 0, num_seqs - 1)  # noqa: E731
    first_seq = seq_of(first_token).astype(jnp.int32)
    last_seq = jnp.where(first_token < num_real, seq_of(last_token), first_seq - 1).astype(jnp.int32)
    return first_seq, last_seq


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["block_first_seq", "block_last_seq"],
    meta_fields=["tokens_per_q_block"],
)
@dataclasses.dataclass(frozen=True)
class TpuAttentionPlan:
    """A step's q-block layout (`block_sequences`) for q tiles of `tokens_per_q_block` tokens (static): the same in
    every layer. block_first_seq, block_last_seq: [ceil(T / BQ)] i32."""

    block_first_seq: jax.Array
    block_last_seq: jax.Array
    tokens_per_q_block: int


def plan_ragged_attention_tpu(
    cu_q_lens: jax.Array, *, num_tokens: int, group: int, q_dtype, num_queries_per_block: int | None = None
) -> TpuAttentionPlan:
    """The layout `ragged_paged_attention_tpu` builds for a step of num_tokens tokens of q's dtype and GQA group
    `group` (query heads per kv head): build it once per forward and pass it as `plan=` to every layer's call."""
    bq = tokens_per_q_block(num_tokens, group, q_dtype, num_queries_per_block)
    return TpuAttentionPlan(*block_sequences(cu_q_lens.astype(jnp.int32), num_q_blocks(num_tokens, bq), bq), bq)

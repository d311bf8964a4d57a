"""Ragged paged attention for CUDA GPUs (Pallas on Triton); also runs in interpret mode on CPU.

Where it sits: a decoder layer writes this step's K/V into the paged cache, then its attention calls
`ragged_paged_attention_gpu` with the whole caches [L, K, N, D] and the layer index; the result is exactly
`reference.ragged_paged_attention_ref` (same signature, same masking, zeros for padding tokens).

Two kernels, both reading K/V in place through the page table (row j of a key block lives in slot
page_table[s, j // page_size] * page_size + j % page_size, so a block needs no whole pages and any page size
works) with an online softmax in float32:

decode (the decode rows: sequences of one query token): flash-decoding. Grid (kv head, row, kv split), the kv head
fastest, so a row's programs launch together. A program holds the G query heads of one kv head as the rows of a tile
padded to a power of two of at least 16 (the smallest `dot`), walks its split of the sequence's key blocks and, with
one split, writes the normalized result straight into the output; with several it writes float32 partials (o,
running max, denominator) that a few jnp ops combine. The split count comes from the static shapes so that small
batches still fill the GPU. Rows mapped to no sequence have no keys and come out as zeros. In a step the rows launch
longest first (`_longest_first`): a served step's longest context is 2-3.5x its mean, and a long row launched last
would run alone at the end of the kernel.

general (prefill chunks): flash attention over q blocks. A q block holds up to BQ tokens of ONE sequence; the GQA
group is folded into the rows of the q tile (row = token * G + head-in-group; BQ whole tokens in a tile of a power
of two rows, the rows past BQ * G masked when G is not a power of two: Qwen2.5-7B's 7), so each K/V block loaded
serves all G heads; any group up to 64 query heads per kv head is served. The block -> (sequence, first token,
count) table is built in jit from cu_q_lens (static bound T // BQ + C + 1 blocks, C the sequences that may hold a
chunk: S, or the caller's `max_chunks`); padding tokens get blocks of their own that write zeros. Keys are walked up
to the causal limit of the block's last token: blocks wholly below the block's first query position without a mask,
the diagonal blocks with the causal mask.

A step of any mix runs both in one program, with no branch on the step's kind: the general kernel over the q blocks
of the longer sequences and the padding (it leaves the decode rows' tokens unwritten), then the decode kernel over
one row a sequence (other sequences map to no sequence), which reads q at each row's token (no gather of q) and,
unsplit, writes its result into the general kernel's output in place (aliased: no scatter); split, the combined rows
are scattered into it. In a mixed step the general kernel would serve a decode row with a q tile of G real rows out
of BQ * G, at about twice the decode kernel's time (docs/benchmarks.md); in a decode step it launches only the
padding's blocks. A decode-only step (`decode_only=True`, or a decode-only plan) launches the decode kernel alone,
one row a token, longest first; its padding tokens' rows come out as zeros.

The step's layout for both kernels (the decode rows longest first, the q block table) is the same in every layer:
`plan_ragged_attention_gpu` computes it as a `RaggedAttentionPlan`, which the model builds once per forward and hands
to every layer's call (a rolled layer loop would otherwise sort and scan it again in each iteration); a call given
no plan builds its own.

A sliding window (`sliding_window`, a traced [] i32: the layer's) moves each kernel's first key block up: a decode
row starts at its window's first key (a row its window covers runs the full kernel's loop), a q block at the window
of its first query, and only the blocks at the window's edge load and mask by it; without one the kernels are the
programs they were before windows.

An 8-bit cache (`--kv-cache-dtype fp8_*`) is widened as its rows load, to float16 beside 16-bit queries (q is
saturated into float16's range) and to q's dtype beside float32 ones, with float32 accumulation as for a 16-bit
cache; the decode kernel then walks 64 keys a step (`choose_decode_block_kv`: the bytes of 32 bf16) with 4 warps a
program where a 16-bit cache takes 2 (`choose_decode_num_warps`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_LOG2E = math.log2(math.e)
_MASK_INIT = -1e30  # finite running-max start: fully masked rows give exp2(-inf) = 0, never inf - inf
_MIN_DOT = 16  # smallest rows/cols/inner dim of a Triton dot
_MAX_GROUP = 64  # query heads per kv head: a decode program's rows, padded to a power of two
_TARGET_DECODE_PROGRAMS = 264  # two programs for each of 132 SMs (H100/H200); more splits only add partials
_FIX_HINT = "restart with --attention-backend native"


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    block_kv: int = 0  # keys per loop step; 0: 32 for 16-bit caches, 64 for 8-bit ones (`choose_decode_block_kv`)
    num_splits: int = 0  # key splits per (token, kv head); 0: chosen from the static shapes
    num_warps: int = 0  # warps a program; 0: 2 for 16-bit caches, 4 for 8-bit ones (`choose_decode_num_warps`)
    num_stages: int = 3


@dataclasses.dataclass(frozen=True)
class PrefillTiles:
    block_rows: int = 0  # q tile rows (a power of two), whole tokens of G rows each; 0: chosen from the static shapes
    block_kv: int = 64  # keys per loop step
    num_warps: int = 8
    num_stages: int = 3


class RaggedAttentionPlan(NamedTuple):
    """The step's row layout for both kernels, from the batch alone (the same in every layer). Decode rows, longest
    first (`_longest_first`): row_token, row_seq, row_kv_len, one a sequence ([S] i32, `_decode_rows`) in a plan for
    steps of any mix, one a token ([T] i32, `_token_rows`) in a decode-only plan. The general kernel's q blocks
    (`_q_block_table`): block_seq, block_start, block_count [T // BQ + C + 1] i32; None in a decode-only plan."""

    row_token: jax.Array
    row_seq: jax.Array
    row_kv_len: jax.Array
    block_seq: jax.Array | None = None
    block_start: jax.Array | None = None
    block_count: jax.Array | None = None

    @property
    def decode_only(self) -> bool:
        return self.block_seq is None


def plan_ragged_attention_gpu(
    kv_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    *,
    num_tokens: int,
    group: int,
    max_chunks: int | None = None,
    prefill_tiles: PrefillTiles = PrefillTiles(),
    decode_only: bool = False,
) -> RaggedAttentionPlan:
    """The layout `ragged_paged_attention_gpu` computes for a step of num_tokens tokens and GQA group `group` (query
    heads per kv head): build it once per forward and pass it as `plan=` to every layer's call. A step of any mix:
    with the same max_chunks and prefill_tiles as the calls. decode_only (every q_len <= 1): the decode kernel's
    rows alone, one a token, and no q block table."""
    kv_lens, cu_q_lens = kv_lens.astype(jnp.int32), cu_q_lens.astype(jnp.int32)
    if decode_only:
        return RaggedAttentionPlan(*_longest_first(*_token_rows(cu_q_lens, kv_lens, num_tokens)))
    rows = _longest_first(*_decode_rows(cu_q_lens, kv_lens, num_tokens))
    block_tokens = _prefill_block_rows(num_tokens, page_table.shape[0], group, prefill_tiles) // group
    blocks = _q_block_table(cu_q_lens, num_tokens, block_tokens, skip_decode_rows=True, max_chunks=max_chunks)
    return RaggedAttentionPlan(*rows, *blocks)


def _prefill_block_rows(num_tokens: int, num_seqs: int, group: int, tiles: PrefillTiles) -> int:
    """The general kernel's q tile rows, a power of two holding at least one token's group of heads: a tile holds
    rows // group whole tokens, and a group of 7 leaves rows % 7 padding rows at its end (masked)."""
    return max(tiles.block_rows or choose_block_rows(num_tokens, num_seqs), _MIN_DOT, _next_pow2(group))


def _next_pow2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def check_shapes(q_shape: tuple[int, ...], cache_shape: tuple[int, ...], page_size: int) -> None:
    """Raise a ValueError naming the flag to change when these kernels cannot serve the model's shapes."""
    _, num_heads, head_dim = q_shape
    num_kv_heads, cache_dim = cache_shape[1], cache_shape[3]
    if cache_dim != head_dim:
        raise ValueError(f"GPU attention: q head_dim {head_dim} != cache head_dim {cache_dim}")
    if head_dim < _MIN_DOT or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(
            f"GPU attention kernels need a power-of-two head_dim in [16, 256], got {head_dim}; {_FIX_HINT}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"GPU attention: {num_heads} query heads are not a multiple of {num_kv_heads} kv heads; {_FIX_HINT}"
        )
    group = num_heads // num_kv_heads
    if group > _MAX_GROUP:
        raise ValueError(
            f"GPU attention kernels take at most {_MAX_GROUP} query heads per kv head, got {group}; {_FIX_HINT}"
        )
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}; restart with --page-size 16")


def choose_decode_splits(num_tokens: int, num_kv_heads: int, max_kv_len: int, block_kv: int) -> int:
    """Key splits per (token, kv head) so that at least _TARGET_DECODE_PROGRAMS programs run, each walking at least
    two key blocks. Splits cost a float32 round trip of partials and a combine step: on an H100, batch 64 x 517 ran
    faster unsplit (512 programs) than in 2 or 4 splits, so split only when the programs are too few."""
    max_blocks = -(-max_kv_len // block_kv)
    splits = 1
    while num_tokens * num_kv_heads * splits < _TARGET_DECODE_PROGRAMS and max_blocks // (splits * 2) >= 2:
        splits *= 2
    return splits


def choose_decode_block_kv(cache_dtype) -> int:
    """Keys per decode loop step: 32 for a 16-bit cache, 64 for an 8-bit one (the same bytes a step). On an H100
    with shuffled pages an fp8 cache took 0.645 ms for 256 x 2053 with 64 keys against 0.815 with 32, and 0.223
    against 0.247 ms for 256 x 517. With a bf16 cache 64 keys made the H100's 32-layer decode forwards 0.2-3% longer
    (docs/benchmarks.md)."""
    return 64 if jnp.dtype(cache_dtype).itemsize == 1 else 32


def choose_decode_num_warps(cache_dtype) -> int:
    """Warps a decode program: 2 for a 16-bit cache, 4 for an 8-bit one. With a bf16 cache 2 warps read the pages
    faster than 4 on two H100s: in all seven shapes on one (0.1-1.6%), in five of six on the other (0.2-1.4%; 0.2%
    slower at 256 x 2053); the 32-layer decode forwards timed alternately in one process were within 0.6% either way
    (docs/benchmarks.md "The decode kernel's own device time"). An 8-bit cache was not timed with 2."""
    return 4 if jnp.dtype(cache_dtype).itemsize == 1 else 2


def choose_block_rows(num_tokens: int, num_seqs: int) -> int:
    """q tile rows for the general kernel: 256 when the step averages 16 or more tokens a sequence (prefill: on an
    H100, 8 x 2048 tokens ran 18% faster than with 128 rows), else 128, since a decode row in a 256-row tile would
    spend more time on padded products than on reading its keys."""
    return 256 if num_tokens >= 16 * num_seqs else 128


def _dot_nt(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """lhs [M, D] @ rhs [N, D].T in float32; IEEE f32 (not tf32) when both are f32."""
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    dims = (((1,), (1,)), ((), ()))
    return jax.lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=jnp.float32)


def _dot_nn(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """lhs [M, N] @ rhs [N, D] in float32."""
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    dims = (((1,), (0,)), ((), ()))
    return jax.lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=jnp.float32)


_F16_MAX = 65504.0


def _compute_dtype(cache_dtype, q_dtype):
    """The dtype of the products' operands: the cache's; with 8-bit floats in the cache (widened on load), float16
    for 16-bit queries (8-bit floats widen to float16 in one instruction a pair, to bfloat16 in several: on an H100
    the decode kernel took 0.587 against 0.656 ms at 256 x 2053), else q's dtype."""
    if jnp.dtype(cache_dtype).itemsize != 1:
        return jnp.dtype(cache_dtype)
    return jnp.dtype(jnp.float16) if jnp.dtype(q_dtype).itemsize == 2 else jnp.dtype(q_dtype)


def _load_q(q_ref, at, mask, cache_dtype):
    """The q rows at `at` in the products' dtype; a bfloat16 q going to float16 saturates at float16's largest value."""
    q = plgpu.load(q_ref.at[at], mask=mask, other=0)
    compute = _compute_dtype(cache_dtype, q.dtype)
    if compute == jnp.float16 and q.dtype != jnp.float16:
        q = jnp.clip(q.astype(jnp.float32), -_F16_MAX, _F16_MAX)
    return q.astype(compute)


def _load_kv_block(
    k_ref,
    v_ref,
    page_table_ref,
    layer,
    kv_head,
    seq,
    block,
    kv_len,
    *,
    block_kv,
    page_size,
    compute_dtype,
    lowest_key=None,
):
    """K and V rows [block_kv, D] of key block `block` of sequence `seq`, gathered through the page table; rows at
    or past kv_len, or below lowest_key (a sliding window's first key), are not read (zeros). An 8-bit cache's rows
    come widened to compute_dtype (q's, as `_load_q` chose it). Returns (k, v, key positions, key row is valid)."""
    cols = jnp.arange(k_ref.shape[-1], dtype=jnp.int32)
    pos = block * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
    is_key = pos < kv_len
    if lowest_key is not None:
        is_key &= pos >= lowest_key
    page = plgpu.load(page_table_ref.at[seq, jax.lax.div(pos, page_size)], mask=is_key, other=0)
    slot = page * page_size + jax.lax.rem(pos, page_size)
    at = (layer, kv_head, slot[:, None], cols[None, :])
    row_mask = jnp.broadcast_to(is_key[:, None], (block_kv, cols.shape[0]))
    if jnp.dtype(k_ref.dtype).itemsize == 1:  # an 8-bit cache: widened here (Triton fills no 8-bit `other`)
        k = jnp.where(row_mask, plgpu.load(k_ref.at[at], mask=row_mask).astype(compute_dtype), 0)
        v = jnp.where(row_mask, plgpu.load(v_ref.at[at], mask=row_mask).astype(compute_dtype), 0)
        return k, v, pos, is_key
    k = plgpu.load(k_ref.at[at], mask=row_mask, other=0)
    v = plgpu.load(v_ref.at[at], mask=row_mask, other=0)
    return k, v, pos, is_key


def _softmax_step(carry, q, k, v, mask, scale_log2):
    """One online-softmax step over a key block; mask [rows, block_kv] or None (every key counts)."""
    o, m, l = carry
    scores = _dot_nt(q, k) * scale_log2  # log2 domain: exp2 below
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    alpha = jnp.exp2(m - m_new)
    probs = jnp.exp2(scores - m_new[:, None])
    l = l * alpha + jnp.sum(probs, axis=1)
    o = o * alpha[:, None] + _dot_nn(probs.astype(v.dtype), v)
    return o, m_new, l


def _normalize(o: jax.Array, l: jax.Array) -> jax.Array:
    return o / jnp.where(l > 0, l, 1.0)[:, None]  # rows with no keys (padding) stay 0


def _decode_kernel(
    row_seq_ref,
    row_kv_len_ref,
    *refs,
    group,
    group_pad,
    num_splits,
    block_kv,
    page_size,
    scale_log2,
    in_place,
    windowed,
):
    # row_seq_ref, row_kv_len_ref, row_token_ref [R] i32 (-1 and 0: no sequence; its token may lie past the step's
    # tokens); q_ref is the step's [T, H, D] and row r reads token row_token[r]. Unsplit, row r writes its result at
    # that token of out [T, H, D]: in place, out is aliased to the general kernel's output (refs' `into`) and rows of
    # no sequence write nothing; otherwise the rows are every token (a decode-only plan's) and a row of no sequence
    # writes zeros. Split, row r writes partials o [splits, R, H, D], m and l [splits, R, H] at r.
    # windowed: a window_ref [1] i32 (the sliding window) follows layer_ref.
    row_token_ref, layer_ref, *refs = refs
    window_ref = refs.pop(0) if windowed else None
    page_table_ref, q_ref, k_ref, v_ref = refs[:4]
    out_refs = refs[5:] if in_place else refs[4:]  # in place: `into` (aliased to the output) comes first
    kv_head, row, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    head_dim = q_ref.shape[-1]
    seq = row_seq_ref[row]
    safe_seq = jnp.maximum(seq, 0)
    kv_len = row_kv_len_ref[row]  # read beside the sequence, not through it: one dependent load less
    layer = layer_ref[0]
    rows = jnp.arange(group_pad, dtype=jnp.int32)
    heads = kv_head * group + rows
    is_head = rows < group
    cols = jnp.arange(head_dim, dtype=jnp.int32)
    row_mask = jnp.broadcast_to(is_head[:, None], (group_pad, head_dim))
    row_at = (row, heads[:, None], cols[None, :])
    token = jnp.minimum(row_token_ref[row], q_ref.shape[0] - 1)  # a row of no sequence may point past the tokens
    token_at = (token, heads[:, None], cols[None, :])
    store_mask = row_mask & (seq >= 0) if in_place else row_mask
    q = _load_q(q_ref, token_at, row_mask, k_ref.dtype)

    num_blocks = pl.cdiv(kv_len, block_kv)
    init = (
        jnp.zeros((group_pad, head_dim), jnp.float32),
        jnp.full((group_pad,), _MASK_INIT, jnp.float32),
        jnp.zeros((group_pad,), jnp.float32),
    )

    def walk(lowest_key):
        """This split's share of the key blocks from the one holding lowest_key on, the keys below it not read; None:
        every block, as the full kernel walks them."""

        def body(block, carry):
            k, v, _, is_key = _load_kv_block(
                k_ref,
                v_ref,
                page_table_ref,
                layer,
                kv_head,
                safe_seq,
                block,
                kv_len,
                block_kv=block_kv,
                page_size=page_size,
                compute_dtype=q.dtype,
                lowest_key=lowest_key,
            )
            mask = jnp.broadcast_to(is_key[None, :], (group_pad, block_kv))
            return _softmax_step(carry, q, k, v, mask, scale_log2)

        if lowest_key is None:
            per_split = pl.cdiv(num_blocks, num_splits)
            first = split * per_split
        else:
            first_block = jax.lax.div(lowest_key, block_kv)
            per_split = pl.cdiv(num_blocks - first_block, num_splits)
            first = first_block + split * per_split
        return jax.lax.fori_loop(first, jnp.minimum(num_blocks, first + per_split), body, init)

    if windowed:
        # the row's query sits at kv_len - 1, so a window W starts at key kv_len - W; the blocks below are not read.
        # A row its window covers walks every block as the full kernel does, from a block the compiler knows: walked
        # from the window's first block, known only at run time, it took 1.11x as long (docs/benchmarks.md)
        lowest_key = jnp.maximum(kv_len - window_ref[0], 0)
        o, m, l = jax.lax.cond(lowest_key == 0, lambda: walk(None), lambda: walk(lowest_key))
    else:
        o, m, l = walk(None)
    if num_splits == 1:
        (out_ref,) = out_refs
        plgpu.store(out_ref.at[token_at], _normalize(o, l).astype(out_ref.dtype), mask=store_mask)
        return
    o_ref, m_ref, l_ref = out_refs
    plgpu.store(o_ref.at[(split,) + row_at], o, mask=row_mask)
    plgpu.store(m_ref.at[split, row, heads], m, mask=is_head)
    plgpu.store(l_ref.at[split, row, heads], l, mask=is_head)


def _token_rows(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, ...]:
    """The decode rows of a decode-only step, one a token: ([T] i32 the token, [T] i32 its sequence, [T] i32 that
    sequence's kv_len); -1 and 0 for padding tokens past cu_q_lens[S]."""
    num_seqs = cu_q_lens.shape[0] - 1
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    # compare_all: one fused elementwise pass; the default scan method is a while loop, which on GPU costs a
    # device-to-host round trip per step
    seq = jnp.searchsorted(cu_q_lens, token, side="right", method="compare_all") - 1
    seq = jnp.clip(seq, 0, num_seqs - 1).astype(jnp.int32)
    is_real = token < cu_q_lens[-1]
    return token, jnp.where(is_real, seq, -1), jnp.where(is_real, kv_lens[seq], 0)


def _decode_rows(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, ...]:
    """The decode rows of a step, one slot per sequence: ([S] i32 token of the sequence's one query row, or
    num_tokens + s (past the output, distinct) when its q_len is not 1; [S] i32 the sequence, or -1; [S] i32 its
    kv_len, or 0)."""
    num_seqs = cu_q_lens.shape[0] - 1
    is_row = cu_q_lens[1:] - cu_q_lens[:-1] == 1
    seqs = jnp.arange(num_seqs, dtype=jnp.int32)
    token = jnp.where(is_row, cu_q_lens[:-1], num_tokens + seqs)
    return token, jnp.where(is_row, seqs, -1), jnp.where(is_row, kv_lens, 0)


def _longest_first(row_token: jax.Array, row_seq: jax.Array, row_kv_len: jax.Array) -> tuple[jax.Array, ...]:
    """`_decode_rows`' or `_token_rows`' arrays reordered by decreasing kv_len (ties in row order): the decode
    kernel's programs then launch the longest rows first and end on the shortest. Each row still reads and writes its
    own token; only the launch order changes (one sort of S or T keys a forward: `plan_ragged_attention_gpu` runs it
    once for every layer)."""
    order = jnp.argsort(-row_kv_len, stable=True)
    return row_token[order], row_seq[order], row_kv_len[order]


def _decode_attention(
    q,
    row_token,
    row_seq,
    row_kv_len,
    k_cache,
    v_cache,
    layer,
    page_table,
    *,
    page_size,
    scale,
    tiles,
    interpret,
    into=None,
    window=None,
) -> jax.Array:
    """q [T, H, D], the step's; row r is the query of token row_token[r] ([R] i32), of sequence row_seq[r] (-1:
    none) with row_kv_len[r] keys -> [T, H, D]. window: [1] i32, the sliding window (each row reads its last window
    keys); None: every key. The kernel reads each row's q at its token (no gather of q).

    With into ([T, H, D]): the rows' results are written into `into` at their tokens (rows of no sequence leave it as
    it is, and may point past the tokens) and `into` is returned; unsplit, the kernel writes `into` in place (no
    scatter of the results). Without: the rows are every token once (a decode-only plan's), and a row of no sequence
    comes out as zeros. Split, the combined rows are scattered to their tokens."""
    num_rows = row_seq.shape[0]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_kv = tiles.block_kv or choose_decode_block_kv(k_cache.dtype)
    splits = tiles.num_splits or choose_decode_splits(num_rows, num_kv_heads, page_table.shape[1] * page_size, block_kv)
    num_warps = tiles.num_warps or choose_decode_num_warps(k_cache.dtype)
    in_place = into is not None and splits == 1
    kernel = functools.partial(
        _decode_kernel,
        group=group,
        group_pad=max(_MIN_DOT, _next_pow2(group)),
        num_splits=splits,
        block_kv=block_kv,
        page_size=page_size,
        scale_log2=scale * _LOG2E,
        in_place=in_place,
        windowed=window is not None,
    )
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((splits, num_rows, num_heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_rows, num_heads), jnp.float32),
            jax.ShapeDtypeStruct((splits, num_rows, num_heads), jnp.float32),
        )
    operands = (row_seq, row_kv_len, row_token, layer) + ((window,) if window is not None else ())
    operands += (page_table, q, k_cache, v_cache)
    result = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_kv_heads, num_rows, splits),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        input_output_aliases={len(operands): 0} if in_place else {},
        name="ragged_paged_attention_decode",
    )(*operands, *((into,) if in_place else ()))
    if splits == 1:
        return result
    o, m, l = result
    weight = jnp.exp2(m - jnp.max(m, axis=0))  # [splits, R, H]
    denom = jnp.sum(weight * l, axis=0)
    out = (jnp.sum(weight[..., None] * o, axis=0) / jnp.where(denom > 0, denom, 1.0)[..., None]).astype(q.dtype)
    into = jnp.zeros_like(q) if into is None else into
    # the rows' results to their tokens; rows of no sequence in a plan of any mix point past the output (dropped)
    return into.at[row_token].set(out, mode="drop", unique_indices=True)


def _prefill_kernel(
    block_seq_ref,
    block_start_ref,
    block_count_ref,
    layer_ref,
    *refs,
    group,
    block_rows,
    block_kv,
    page_size,
    scale_log2,
    windowed,
):
    # block_* [num_blocks] i32 (seq -1: padding tokens, count 0: unused); q_ref/o_ref [T, H, D]; windowed: a
    # window_ref [1] i32 (the sliding window) follows layer_ref
    window_ref, refs = (refs[0], refs[1:]) if windowed else (None, refs)
    kv_lens_ref, cu_q_lens_ref, page_table_ref, q_ref, k_ref, v_ref, o_ref = refs
    block, kv_head = pl.program_id(0), pl.program_id(1)
    head_dim = q_ref.shape[-1]
    seq, start, count = block_seq_ref[block], block_start_ref[block], block_count_ref[block]
    safe_seq = jnp.maximum(seq, 0)
    rows = jnp.arange(block_rows, dtype=jnp.int32)
    token_in_block = jax.lax.div(rows, group)
    is_row = token_in_block < count
    cols = jnp.arange(head_dim, dtype=jnp.int32)
    row_mask = jnp.broadcast_to(is_row[:, None], (block_rows, head_dim))
    q_at = (start + token_in_block[:, None], kv_head * group + jax.lax.rem(rows, group)[:, None], cols[None, :])

    kv_len = jnp.where(seq >= 0, kv_lens_ref[safe_seq], 0)
    seq_start = cu_q_lens_ref[safe_seq]
    q_len = cu_q_lens_ref[safe_seq + 1] - seq_start
    first_pos = kv_len - q_len + (start - seq_start)  # absolute position of the block's first query
    query_pos = first_pos + token_in_block
    num_blocks = jnp.where(seq >= 0, pl.cdiv(first_pos + count, block_kv), 0)  # up to the last query's position
    num_full = jnp.clip(jax.lax.div(jnp.maximum(first_pos + 1, 0), block_kv), 0, num_blocks)
    # key blocks [first_block, unmasked_from) hold keys below some query's window (masked), [unmasked_from,
    # num_full) keys every query reads, [num_full, num_blocks) the causal diagonal (masked)
    first_block, unmasked_from, lowest_key = 0, 0, None
    if windowed:
        window = window_ref[0]
        lowest_key = jnp.maximum(first_pos - window + 1, 0)  # the window's first key for the block's first query
        first_block = jnp.clip(jax.lax.div(lowest_key, block_kv), 0, num_full)
        last_pos = first_pos + count - 1
        unmasked_from = jnp.clip(pl.cdiv(jnp.maximum(last_pos - window + 1, 0), block_kv), first_block, num_full)
    q = _load_q(q_ref, q_at, row_mask, k_ref.dtype)
    load = functools.partial(
        _load_kv_block,
        k_ref,
        v_ref,
        page_table_ref,
        layer_ref[0],
        kv_head,
        safe_seq,
        kv_len=kv_len,
        block_kv=block_kv,
        page_size=page_size,
        compute_dtype=q.dtype,
    )

    def full_block(kv_block, carry):  # every key at or below every query of the block, and inside its window
        k, v, _, _ = load(kv_block)
        return _softmax_step(carry, q, k, v, None, scale_log2)

    def masked_block(kv_block, carry):  # keys below the window of the block's first query are not read
        k, v, key_pos, _ = load(kv_block, lowest_key=lowest_key)
        mask = key_pos[None, :] <= query_pos[:, None]
        if windowed:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        return _softmax_step(carry, q, k, v, mask, scale_log2)

    init = (
        jnp.zeros((block_rows, head_dim), jnp.float32),
        jnp.full((block_rows,), _MASK_INIT, jnp.float32),
        jnp.zeros((block_rows,), jnp.float32),
    )
    carry = init
    if windowed:
        carry = jax.lax.fori_loop(first_block, unmasked_from, masked_block, carry)
    carry = jax.lax.fori_loop(unmasked_from, num_full, full_block, carry)
    o, _, l = jax.lax.fori_loop(num_full, num_blocks, masked_block, carry)
    plgpu.store(o_ref.at[q_at], _normalize(o, l).astype(o_ref.dtype), mask=row_mask)


def _q_block_table(
    cu_q_lens: jax.Array,
    num_tokens: int,
    block_tokens: int,
    skip_decode_rows: bool = False,
    max_chunks: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(seq, first token, token count) of every q block, [T // BQ + C + 1] i32 each (C: the sequences that may own
    blocks): each sequence's tokens in blocks of up to BQ, then the padding tokens past cu_q_lens[S] (seq -1,
    written as zeros), then unused blocks (count 0). A sequence's blocks come last token first: the blocks with the
    most keys start first, so the launch does not end on a tail of long programs. skip_decode_rows: sequences of
    one query token get no block (the decode kernel serves them), and C = min(S, max_chunks) when the caller
    promises at most max_chunks longer sequences (each sequence's partial block is what C counts)."""
    num_seqs = cu_q_lens.shape[0] - 1
    owners = min(num_seqs, max_chunks) if skip_decode_rows and max_chunks is not None else num_seqs
    max_blocks = num_tokens // block_tokens + owners + 1
    q_lens = jnp.diff(cu_q_lens)
    if skip_decode_rows:
        q_lens = jnp.where(q_lens == 1, 0, q_lens)
    pad_len = num_tokens - cu_q_lens[-1]
    lens = jnp.concatenate([q_lens, pad_len[None]])  # padding as sequence S
    starts = cu_q_lens  # sequence S starts at cu_q_lens[S]
    blocks_per = (lens + block_tokens - 1) // block_tokens
    block_end = jnp.cumsum(blocks_per)
    block = jnp.arange(max_blocks, dtype=jnp.int32)
    owner = jnp.searchsorted(block_end, block, side="right", method="compare_all")
    owner = jnp.minimum(owner, num_seqs).astype(jnp.int32)
    index_in_owner = block_end[owner] - 1 - block  # last block of the owner first
    first = starts[owner] + index_in_owner * block_tokens
    count = jnp.clip(lens[owner] - index_in_owner * block_tokens, 0, block_tokens)
    is_used = block < block_end[-1]
    count = jnp.where(is_used, count, 0)
    first = jnp.where(is_used, first, 0)
    seq = jnp.where(owner < num_seqs, owner, -1)
    return seq.astype(jnp.int32), first.astype(jnp.int32), count.astype(jnp.int32)


def _prefill_attention(
    q,
    k_cache,
    v_cache,
    layer,
    kv_lens,
    page_table,
    cu_q_lens,
    *,
    page_size,
    scale,
    tiles,
    interpret,
    skip_decode_rows,
    max_chunks=None,
    blocks=None,
    window=None,
) -> jax.Array:
    """The general kernel over every token; with skip_decode_rows, the rows of one-token sequences are left
    unwritten (the caller fills them) and max_chunks bounds the longer sequences (`_q_block_table`). blocks: that
    table, built beforehand for these arguments (a `RaggedAttentionPlan`'s), or None to build it here. window:
    [1] i32, the sliding window; None: every key up to each query's own."""
    num_tokens, num_heads, _ = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_rows = _prefill_block_rows(num_tokens, page_table.shape[0], group, tiles)
    if blocks is None:
        blocks = _q_block_table(cu_q_lens, num_tokens, block_rows // group, skip_decode_rows, max_chunks)
    block_seq, block_start, block_count = blocks
    kernel = functools.partial(
        _prefill_kernel,
        group=group,
        block_rows=block_rows,
        block_kv=tiles.block_kv,
        page_size=page_size,
        scale_log2=scale * _LOG2E,
        windowed=window is not None,
    )
    windows = (window,) if window is not None else ()
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(block_seq.shape[0], num_kv_heads),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="ragged_paged_attention_prefill",
    )(block_seq, block_start, block_count, layer, *windows, kv_lens, cu_q_lens, page_table, q, k_cache, v_cache)


@functools.partial(
    jax.jit,
    static_argnames=("page_size", "scale", "decode_only", "max_chunks", "interpret", "decode_tiles", "prefill_tiles"),
)
def ragged_paged_attention_gpu(
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
    decode_only: bool | None = None,
    max_chunks: int | None = None,
    interpret: bool = False,
    decode_tiles: DecodeTiles = DecodeTiles(),
    prefill_tiles: PrefillTiles = PrefillTiles(),
    plan: RaggedAttentionPlan | None = None,
    sliding_window: jax.Array | int | None = None,
) -> jax.Array:
    """-> [T, H, D] in q's dtype, as `ragged_paged_attention_ref`; products in float32.

    decode_only: True: the caller promises every q_len <= 1 (a decode step); the flash-decoding kernel then serves
    every token, longest row first, and the general kernel is not launched (a longer row would attend as its last
    token for each of its tokens). False (any mix, decode steps included): the sequences of one query token take
    the decode kernel and the others the general kernel, both in the same program, so a step needs no branch on its
    kind. None: the plan's kind, or any mix without a plan.
    max_chunks: the caller promises at most this many sequences of more than one query token (the engine's
    --max-prefill-seqs); the general kernel's grid then has T // BQ + max_chunks + 1 q blocks instead of
    T // BQ + S + 1, which in a step of decode rows is the launch of hundreds of programs with nothing to do.
    The tiles are static tuning knobs (block sizes, warps, pipeline stages); the defaults suit Hopper.
    plan: the step's layout from `plan_ragged_attention_gpu` (the same kv_lens, page_table, cu_q_lens, max_chunks
    and prefill_tiles, and decode_only where given), built once for all layers; None: built here.
    sliding_window: the keys a query attends to, its own included ([] i32, traced: a layer's); the key blocks
    wholly below a query block's window are not read. None: every key up to the query's own.
    """
    check_shapes(q.shape, k_cache.shape, page_size)
    if plan is not None and decode_only is not None and decode_only != plan.decode_only:
        kind = "decode-only" if plan.decode_only else "any-mix"
        raise ValueError(
            f"ragged_paged_attention_gpu: decode_only={decode_only} with a {kind} plan; build the plan "
            f"with plan_ragged_attention_gpu(..., decode_only={decode_only})"
        )
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    kv_lens, page_table, cu_q_lens = (a.astype(jnp.int32) for a in (kv_lens, page_table, cu_q_lens))
    window = None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32).reshape(1)
    decode = functools.partial(
        _decode_attention, page_size=page_size, scale=scale, tiles=decode_tiles, interpret=interpret, window=window
    )
    if plan is None:
        group = q.shape[1] // k_cache.shape[1]
        options = dict(num_tokens=q.shape[0], group=group, max_chunks=max_chunks, prefill_tiles=prefill_tiles)
        plan = plan_ragged_attention_gpu(kv_lens, page_table, cu_q_lens, decode_only=bool(decode_only), **options)
    if plan.decode_only:
        return decode(q, plan.row_token, plan.row_seq, plan.row_kv_len, k_cache, v_cache, layer, page_table)
    general = functools.partial(
        _prefill_attention,
        page_size=page_size,
        scale=scale,
        tiles=prefill_tiles,
        interpret=interpret,
        max_chunks=max_chunks,
        window=window,
    )
    return _mixed_attention(decode, general, q, k_cache, v_cache, layer, kv_lens, page_table, cu_q_lens, plan)


def _mixed_attention(decode, general, q, k_cache, v_cache, layer, kv_lens, page_table, cu_q_lens, plan) -> jax.Array:
    """Any mix of decode rows and prefill chunks: the general kernel serves every token but those of sequences of one
    query token (it leaves their rows unwritten), then the decode kernel serves those, one program row a sequence,
    reading q at each row's token and writing its result into the general kernel's output in place, the longest rows
    first (the plan's)."""
    blocks = (plan.block_seq, plan.block_start, plan.block_count)
    out = general(q, k_cache, v_cache, layer, kv_lens, page_table, cu_q_lens, skip_decode_rows=True, blocks=blocks)
    rows = (plan.row_token, plan.row_seq, plan.row_kv_len)
    return decode(q, *rows, k_cache, v_cache, layer, page_table, into=out)

"""Rotary embedding and the K/V write in one kernel, for CUDA GPUs (Pallas on Triton); runs in interpret mode on CPU.

Where it sits: a decoder layer's attention block (sgl_jax_lora/layers/attention.py `rotate_and_write_kv`, called
from models/llama.py) between the q|k|v GEMM and the attention kernels of gpu.py, when the step runs the GPU
attention backend. In XLA the same work is four ops a layer: the rotary angles' cosines and sines, q rotated (a
concatenate fusion), k rotated and scattered into the cache, v scattered; each a launch on the critical path
between the GEMM and the attention. Here one launch reads the packed q|k|v output once, writes q rotated, and writes
k rotated and v into the caches [L, K, N, D] at the step's slots, in place (the caches are aliased to the outputs).

The packed output [T, (H + 2K) * D] holds q's H heads, then k's K, then v's K (layers/linear.py, one tensor
shard's columns under tensor parallelism). Grid (token block, head group): a program takes `block_tokens` tokens of
`group` heads (q's, k's or v's: the group divides both counts) as [tokens, heads, D / 2] tiles, one per half of a
head, and rotates them (q, k) or copies them (v). Rotation is HF's "rotate half" in float32 by the forward's tables
(layers/rotary.py `rotary_tables`: computed once per forward, not per layer), as `rotate` does; an 8-bit cache gets
k and v saturated to its finite range first, as layers/attention.py `write_kv` does. Padding tokens, whose slot is
0 (the reserved page 0's scratch slot, which no sequence reads), write nothing.

The bucket's padding rows: given `num_rows` (the step's real tokens), the kernel reads the rows from num_rows[0] on
as zeros (a masked load, so whatever they hold, NaN included, never enters the math): their q rows are stored as
rotate(0) = 0 and their k and v are not written, whatever their slot. So the q|k|v GEMM need not zero those rows
(the GEMM kernels skip their row tiles and leave them unwritten; models/llama.py calls the projection with
`zero_padding=False` when this kernel takes its output): the results equal those of the same call on q|k|v with its
padding rows zeroed.

What exists here: `fits_head_dim` (the head dims it takes), `check_rope_kv_shapes` (raises, naming the way out, on
shapes it does not take), `head_group` (heads per program) and `rope_kv_write_gpu` (the call); `rope_kv_write_ref`
is the same in plain JAX (the CPU tests' reference).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.sgmv.gemm_lora_gpu import rows_operand

BLOCK_TOKENS = 8  # tokens per program
MAX_HEAD_GROUP = 8  # heads per program: 8 tokens x 8 heads x D = 16 KB of bf16 rows at D = 128
NUM_WARPS = 4


def fits_head_dim(head_dim: int) -> bool:
    """Whether the kernel takes this head dim: D / 2 a power of two of at least 16 (a Triton tile of half a head)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and half & (half - 1) == 0


def check_rope_kv_shapes(num_heads: int, num_kv_heads: int, head_dim: int, qkv_width: int) -> None:
    """Raises ValueError, naming the fix, when the shapes do not fit the kernel: the packed width must be
    (H + 2K) x D, and D fit (`fits_head_dim`)."""
    if not fits_head_dim(head_dim):
        raise ValueError(
            f"rope_kv_write_gpu: head_dim {head_dim} is not twice a power of two >= 16; rotate q and k and write K/V "
            "with XLA ops for such heads (layers/rotary.py rotate, layers/attention.py write_kv), as the model does"
        )
    if qkv_width != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"rope_kv_write_gpu: q|k|v width {qkv_width} is not ({num_heads} + 2 x {num_kv_heads}) heads x {head_dim}"
        )


def head_group(num_heads: int, num_kv_heads: int) -> int:
    """Heads per program: the largest power of two up to MAX_HEAD_GROUP dividing both head counts (so a group never
    mixes q, k and v heads)."""
    common = math.gcd(num_heads, num_kv_heads)
    return min(MAX_HEAD_GROUP, common & -common)


def _saturated(rows: jax.Array, dtype) -> jax.Array:
    """rows cast to the cache's dtype; an 8-bit float first clipped to its finite range (float8_e4m3fn has no inf)."""
    if jnp.dtype(dtype).itemsize == 1:
        limit = float(jnp.finfo(dtype).max)
        rows = jnp.clip(rows.astype(jnp.float32), -limit, limit)
    return rows.astype(dtype)


def _kernel(
    layer_ref,
    num_rows_ref,
    cache_loc_ref,
    cos_ref,
    sin_ref,
    qkv_ref,
    _k_in,
    _v_in,
    q_ref,
    k_ref,
    v_ref,
    *,
    num_heads,
    group,
    block_tokens,
):
    """One program: heads group * g .. of the H + 2K, for tokens block * block_tokens .. (rows past T masked off;
    rows from num_rows[0] on, the bucket's padding, read as zeros and never written to the caches); values are
    [tokens, heads of the group, D / 2] tiles (one per half of a head)."""
    num_tokens, num_kv_heads, head_dim = q_ref.shape[0], k_ref.shape[1], k_ref.shape[-1]
    half = head_dim // 2
    block, first_head = pl.program_id(0), pl.program_id(1) * group
    tokens = block * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
    is_token = tokens < num_tokens
    is_real = is_token & (tokens < num_rows_ref[0])
    heads, halves = jnp.arange(group, dtype=jnp.int32), jnp.arange(half, dtype=jnp.int32)
    tile = (block_tokens, group, half)
    mask = jnp.broadcast_to(is_token[:, None, None], tile)
    real = jnp.broadcast_to(is_real[:, None, None], tile)
    rows, head_cols = tokens[:, None, None], (first_head + heads)[None, :, None] * head_dim + halves[None, None, :]

    def load(start):  # [tokens, group, half]: columns start .. of each head of the group; padding rows read as 0
        return plgpu.load(qkv_ref.at[rows, head_cols + start], mask=real, other=0)

    def rotated():
        """Both halves of the group's heads rotated, float32 (the tables' rows past T read as angle 0)."""
        table_mask = jnp.broadcast_to(is_token[:, None], (block_tokens, half))
        at = (tokens[:, None], halves[None, :])
        cos = plgpu.load(cos_ref.at[at], mask=table_mask, other=1)[:, None, :]
        sin = plgpu.load(sin_ref.at[at], mask=table_mask, other=0)[:, None, :]
        x1, x2 = load(0).astype(jnp.float32), load(half).astype(jnp.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    def write_cache(cache_ref, kv_head, first, second):
        slots = plgpu.load(cache_loc_ref.at[tokens], mask=is_token, other=0)
        # padding tokens (slot 0, the scratch slot no sequence reads) write nothing: hundreds of stores to one row
        # would queue behind each other; nor do the rows from num_rows[0] on, whatever their slot
        written = jnp.broadcast_to((slots != 0)[:, None, None], tile) & real
        at = (layer_ref[0], (kv_head + heads)[None, :, None], slots[:, None, None])
        plgpu.store(cache_ref.at[(*at, halves[None, None, :])], _saturated(first, cache_ref.dtype), mask=written)
        plgpu.store(
            cache_ref.at[(*at, half + halves[None, None, :])], _saturated(second, cache_ref.dtype), mask=written
        )

    @pl.when(first_head < num_heads)
    def _q():
        r1, r2 = rotated()  # zero in the padding rows (read as zeros), stored as such
        plgpu.store(q_ref.at[rows, head_cols], r1.astype(q_ref.dtype), mask=mask)
        plgpu.store(q_ref.at[rows, head_cols + half], r2.astype(q_ref.dtype), mask=mask)

    @pl.when((first_head >= num_heads) & (first_head < num_heads + num_kv_heads))
    def _k():
        r1, r2 = rotated()  # rounded to q's dtype first, as XLA's rotary rounds k before the write
        write_cache(k_ref, first_head - num_heads, r1.astype(q_ref.dtype), r2.astype(q_ref.dtype))

    @pl.when(first_head >= num_heads + num_kv_heads)
    def _v():
        write_cache(v_ref, first_head - num_heads - num_kv_heads, load(0), load(half))


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "interpret"), donate_argnums=(5, 6))
def rope_kv_write_gpu(
    qkv: jax.Array,  # [T, (H + 2K) * D] the packed q|k|v output
    cos: jax.Array,  # [T, D / 2] f32 the rotary tables of the step's positions (layers/rotary.py rotary_tables)
    sin: jax.Array,  # [T, D / 2] f32
    cache_loc: jax.Array,  # [T] i32 cache slot of each token
    layer: jax.Array,  # [] i32
    k_cache: jax.Array,  # [L, K, N, D] donated: written in place
    v_cache: jax.Array,  # [L, K, N, D] donated: written in place
    *,
    num_heads: int,
    num_kv_heads: int,
    num_rows: jax.Array | None = None,  # [1] i32 the step's real tokens (the bucket's padding after them)
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """-> (q rotated [T, H, D] in qkv's dtype, k_cache, v_cache with this step's k rotated and v at cache_loc of
    layer `layer`). num_rows: the rows of qkv from num_rows[0] on may hold anything (the q|k|v GEMM left them
    unwritten): their q rows come out zero and their k and v are not written, as if those rows were zeros and their
    slots 0; None: every row is real."""
    num_tokens, width = qkv.shape
    head_dim = k_cache.shape[-1]
    check_rope_kv_shapes(num_heads, num_kv_heads, head_dim, width)
    group = head_group(num_heads, num_kv_heads)
    kernel = functools.partial(_kernel, num_heads=num_heads, group=group, block_tokens=BLOCK_TOKENS)
    q, k_cache, v_cache = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((num_tokens, num_heads * head_dim), qkv.dtype),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ),
        grid=(pl.cdiv(num_tokens, BLOCK_TOKENS), (num_heads + 2 * num_kv_heads) // group),
        input_output_aliases={6: 1, 7: 2},
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="rope_kv_write",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        rows_operand(num_rows, num_tokens).astype(jnp.int32),
        cache_loc.astype(jnp.int32),
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        qkv,
        k_cache,
        v_cache,
    )
    return q.reshape(num_tokens, num_heads, head_dim), k_cache, v_cache


def rope_kv_write_ref(qkv, cos, sin, cache_loc, layer, k_cache, v_cache, *, num_heads, num_kv_heads, num_rows=None):
    """The same in plain JAX: rotate q and k (float32 math, rounded to qkv's dtype), write k and v at cache_loc.
    num_rows ([1] i32, None: every row): qkv's rows from num_rows[0] on are taken as zeros (a select, so NaN there
    does not leak), so their q rows are zero, and their k and v are not written (dropped from the scatter)."""
    num_tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
    if num_rows is not None:
        is_real = jnp.arange(num_tokens, dtype=jnp.int32) < num_rows[0]
        qkv = jnp.where(is_real[:, None], qkv, jnp.zeros((), qkv.dtype))
        cache_loc = jnp.where(is_real, cache_loc, k_cache.shape[2])  # out of range: dropped by mode="drop"
    heads = qkv.reshape(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        x1, x2 = x[..., : head_dim // 2].astype(jnp.float32), x[..., head_dim // 2 :].astype(jnp.float32)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(qkv.dtype)

    q = rotate(heads[:, :num_heads])
    k = rotate(heads[:, num_heads : num_heads + num_kv_heads])
    v = heads[:, num_heads + num_kv_heads :]
    k_cache = k_cache.at[layer, :, cache_loc].set(_saturated(k, k_cache.dtype), unique_indices=True, mode="drop")
    v_cache = v_cache.at[layer, :, cache_loc].set(_saturated(v, v_cache.dtype), unique_indices=True, mode="drop")
    return q, k_cache, v_cache

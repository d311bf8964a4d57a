"""Attention over the paged KV cache for a ragged step: decode rows and prefill chunks in one call.

Flow: a decoder layer writes this step's K/V into the paged cache at ForwardBatch.cache_loc (`write_kv`), then calls
`paged_attention`, which runs the step's attention backend on the whole caches and the layer index:
    native      pure JAX (the CPU path): each sequence's pages are gathered and the queries attend in rows
                (`_native_attention`); its row layout is derived inside jit from cu_q_lens
    pallas_tpu  the Mosaic kernel (pallas_kernels/attention/tpu.py), K/V pages read in place
    pallas_gpu  the Pallas GPU kernels (pallas_kernels/attention/gpu.py): flash-decoding for the decode rows and
                flash attention over q blocks for the prefill chunks, both in a step of any mix
    pallas_interpret  the TPU kernel in Pallas interpret mode (`--attention-backend pallas` on CPU: tests)
`resolve_attention_backend` turns the `--attention-backend` flag (auto, native, pallas) into one of these; an
`AttentionBackend` holds it with the mesh; `runs_decode_programs` says whether steps of decode rows alone get
programs of their own (`--decode-step-programs`), whose plan leaves pallas_gpu's general kernel out. `plan_attention`
builds, once per forward, the step's layout that a backend's kernels share across layers (pallas_gpu: a
`RaggedAttentionPlan`; pallas_tpu and pallas_interpret: a `TpuAttentionPlan`; native: None), which the model hands to
every layer's `paged_attention`. Pallas kernels do not take part in GSPMD partitioning, so with tensor parallelism
they run under shard_map, each device on its own query heads and KV heads (the caches are sharded on kv heads,
replicated copies when tp > kv heads, so every shard keeps the model's GQA ratio).

What every backend computes is pallas_kernels/attention/reference.py. The KV cache per layer is
[kv_heads, num_slots, head_dim] with slot = page * page_size + offset; page 0 is a scratch page that padding tokens
write into and no sequence reads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

ATTENTION_BACKENDS = ("native", "pallas_tpu", "pallas_gpu", "pallas_interpret")
QUERY_TILE = 128  # fewest query tokens per native row when a step has many more tokens than sequences
NATIVE_GATHER_BYTES = 1 << 28  # the native path's gathered keys per lax.map iteration (bounds its host memory)
_MASKED = -1e30
# the window of a full-attention layer in a model that mixes windowed and full layers: wider than any context, and
# small enough that the kernels' index arithmetic (window * GQA group) stays in int32
FULL_ATTENTION_WINDOW = 1 << 24


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str = "native"  # one of ATTENTION_BACKENDS
    mesh: Mesh | None = None  # the ("data", "tensor") mesh; Pallas kernels run per "tensor" shard when it has several
    # the most prefill chunks a step holds (--max-prefill-seqs): bounds the GPU q-block kernel's grid; None: any
    max_chunks: int | None = None


def resolve_attention_backend(flag: str, platform: str) -> str:
    """--attention-backend {auto, native, pallas} on `platform` (cpu, gpu, tpu) -> one of ATTENTION_BACKENDS."""
    if flag == "native" or (flag == "auto" and platform == "cpu"):
        return "native"
    if flag not in ("auto", "pallas"):
        raise ValueError(f"--attention-backend '{flag}' is not supported; choose auto, native or pallas")
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(platform, "pallas_interpret")


def runs_decode_programs(flag: str, backend: str) -> bool:
    """--decode-step-programs {auto, on, off} with the resolved attention backend: auto is on where a decode step's
    own program leaves a kernel out of every layer (pallas_gpu: the general kernel, which in a step of decode rows
    only writes the padding tokens' zeros)."""
    return flag == "on" or (flag == "auto" and backend == "pallas_gpu")


def layer_windows(sliding_windows: tuple[int, ...]) -> jax.Array | None:
    """ModelConfig.sliding_windows -> [L] i32, each layer's window (FULL_ATTENTION_WINDOW for its full layers),
    which the layer loop indexes by layer; None for a model without windows (its layers attend to every key)."""
    if not sliding_windows:
        return None
    return jnp.asarray([w or FULL_ATTENTION_WINDOW for w in sliding_windows], jnp.int32)


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache_loc: jax.Array,
    backend: AttentionBackend = AttentionBackend(),
    page_size: int = 0,
    num_seqs: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """This step's k/v [T, K, D] into layer `layer` of the caches [L, K, N, D] at cache_loc (in place: the caches
    are donated to the step). On the pallas_tpu backend a Mosaic kernel writes whole sublane tiles of the layout the
    attention kernel reads (pallas_kernels/attention/kv_write_tpu.py; page_size and num_seqs, the step's sequence
    bucket, bound its blocks): XLA's row scatter there copied the whole cache into another layout and back around
    each layer's write. Elsewhere XLA's scatter (`_scatter_rows`)."""
    if backend.name != "pallas_tpu":
        return _scatter_rows(k_cache, layer, cache_loc, k), _scatter_rows(v_cache, layer, cache_loc, v)
    from pallas_kernels.attention.kv_write_tpu import write_kv_tpu

    def local(k_cache, v_cache, layer, k, v, cache_loc):
        k, v = _cache_rows(k, k_cache.dtype), _cache_rows(v, v_cache.dtype)
        return write_kv_tpu(k_cache, v_cache, layer, k, v, cache_loc, page_size=page_size, num_seqs=num_seqs)

    if backend.mesh is None or backend.mesh.shape["tensor"] == 1:
        return local(k_cache, v_cache, layer, k, v, cache_loc)
    heads, caches = P(None, "tensor", None), P(None, "tensor", None, None)
    in_specs = (caches, caches, P(), heads, heads, P())
    sharded = jax.shard_map(local, mesh=backend.mesh, in_specs=in_specs, out_specs=(caches, caches), check_vma=False)
    return sharded(k_cache, v_cache, layer, k, v, cache_loc)


def fuses_rope_kv_write(backend: AttentionBackend, head_dim: int) -> bool:
    """Whether a layer rotates q and k and writes K/V in one kernel (`rotate_and_write_kv`): on the GPU attention
    backend, for the head dims that kernel takes; elsewhere `rotate` and `write_kv` run as XLA ops."""
    from pallas_kernels.attention.kv_write_gpu import fits_head_dim

    return backend.name == "pallas_gpu" and fits_head_dim(head_dim)


def rotate_and_write_kv(
    qkv: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    rotary: tuple[jax.Array, jax.Array],
    cache_loc: jax.Array,
    num_heads: int,
    backend: AttentionBackend,
    interpret: bool = False,
    num_rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The packed q|k|v output [T, (H + 2K) * D] (shard-major: each "tensor" shard's columns hold its q, k and v
    heads) -> (q rotated [T, H, D], the caches with this step's k rotated and v written at cache_loc of layer
    `layer`), in one GPU kernel (pallas_kernels/attention/kv_write_gpu.py; `interpret`: Pallas interpret mode, for
    CPU tests). rotary: the forward's (cos, sin) tables (layers/rotary.py `rotary_tables`). The same as `rotate` on
    q and k, then `write_kv`. num_rows ([1] i32): the step's real tokens; qkv's rows from num_rows[0] on (the
    bucket's padding) may hold any values, NaN included (the q|k|v projection called with `zero_padding=False`
    leaves them as its GEMM kernel did): the kernel reads them as zeros, so their q rows are zero and their k and v
    are not written. None: every row is real."""
    from pallas_kernels.attention.kv_write_gpu import rope_kv_write_gpu

    tp = 1 if backend.mesh is None else backend.mesh.shape["tensor"]
    num_kv_heads = k_cache.shape[1]
    counts = dict(num_heads=num_heads // tp, num_kv_heads=num_kv_heads // tp, interpret=interpret)

    def local(qkv, k_cache, v_cache, layer, cos, sin, cache_loc, num_rows):
        return rope_kv_write_gpu(qkv, cos, sin, cache_loc, layer, k_cache, v_cache, num_rows=num_rows, **counts)

    if tp == 1:
        return local(qkv, k_cache, v_cache, layer, *rotary, cache_loc, num_rows)
    heads, caches = P(None, "tensor", None), P(None, "tensor", None, None)
    in_specs = (P(None, "tensor"), caches, caches, P(), P(), P(), P(), P())
    out_specs = (heads, caches, caches)
    sharded = jax.shard_map(local, mesh=backend.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return sharded(qkv, k_cache, v_cache, layer, *rotary, cache_loc, num_rows)


def _scatter_rows(cache: jax.Array, layer: jax.Array, cache_loc: jax.Array, rows: jax.Array) -> jax.Array:
    """cache[layer, :, cache_loc] = rows ([T, K, D]: the indexed dims come first), in place on GPU and TPU.

    On CPU, XLA has no bfloat16 (or float16, or 8-bit float) scatter: it would convert the whole cache to float32 and
    back for each layer's write. A program lowered for CPU scatters the cache as raw bits instead, which still copies it
    but converts nothing: a demo-model decode step is 1.8-3.5x faster (docs/benchmarks.md "CPU: the demo model's
    decode step"). Programs lowered for GPU or TPU (a TPU export on a CPU host included) keep the plain write."""
    rows = _cache_rows(rows, cache.dtype)
    if cache.dtype.itemsize > 2 or not jnp.issubdtype(cache.dtype, jnp.floating):
        return _set_rows(cache, layer, cache_loc, rows)
    return jax.lax.platform_dependent(cache, layer, cache_loc, rows, cpu=_set_rows_as_bits, default=_set_rows)


def _cache_rows(rows: jax.Array, dtype) -> jax.Array:
    """K/V rows as the cache stores them: an 8-bit float cache (--kv-cache-dtype fp8_*) saturates them first
    (float8_e4m3fn has no inf)."""
    if jnp.dtype(dtype).itemsize == 1:
        limit = float(jnp.finfo(dtype).max)
        rows = jnp.clip(rows, -limit, limit)
    return rows.astype(dtype)


def _set_rows(cache: jax.Array, layer: jax.Array, cache_loc: jax.Array, rows: jax.Array) -> jax.Array:
    """The write, its slots declared unique. They are, but for the step's padding tokens, which all write slot 0
    of the reserved page 0 (scratch no sequence reads), so any of their rows may land there. Without the
    declaration XLA orders the colliding writes: on an H100 one layer's write of 4,016 tokens and 80 padding
    tokens took 41 us instead of 11 (docs/benchmarks.md "The K/V write and the padding tokens")."""
    return cache.at[layer, :, cache_loc].set(rows, unique_indices=True)


def _set_rows_as_bits(cache: jax.Array, layer: jax.Array, cache_loc: jax.Array, rows: jax.Array) -> jax.Array:
    bits, word = jax.lax.bitcast_convert_type, jnp.uint16 if cache.dtype.itemsize == 2 else jnp.uint8
    return bits(_set_rows(bits(cache, word), layer, cache_loc, bits(rows, word)), cache.dtype)


def plan_attention(
    backend: AttentionBackend,
    seq_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    num_tokens: int,
    group: int,
    q_dtype,
    decode_only: bool = False,
):
    """The step's layout that the backend's kernels share across layers, built once per forward (the ForwardBatch's
    seq_lens, page_table, cu_q_lens and decode_only; num_tokens: the step's bucket; group: query heads per kv head;
    q_dtype: the queries' dtype, which sets the TPU kernel's q tile) -> a `RaggedAttentionPlan` for pallas_gpu (a
    decode-only one for a decode_only step: the decode kernel alone, no launch of the general kernel), a
    `TpuAttentionPlan` for pallas_tpu and pallas_interpret (one ragged kernel for every step), None for native (it
    derives its layout per call)."""
    if backend.name in ("pallas_tpu", "pallas_interpret"):
        from pallas_kernels.attention.tpu_layout import plan_ragged_attention_tpu

        return plan_ragged_attention_tpu(cu_q_lens, num_tokens=num_tokens, group=group, q_dtype=q_dtype)
    if backend.name != "pallas_gpu":
        return None
    from pallas_kernels.attention.gpu import plan_ragged_attention_gpu

    options = dict(num_tokens=num_tokens, group=group, max_chunks=backend.max_chunks, decode_only=decode_only)
    return plan_ragged_attention_gpu(seq_lens, page_table, cu_q_lens, **options)


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    cu_q_lens: jax.Array,
    page_size: int,
    scale: float,
    backend: AttentionBackend = AttentionBackend(),
    plan=None,
    sliding_window: jax.Array | None = None,
) -> jax.Array:
    """q [T, H, D], caches [L, K, N, D] (layer `layer` already holding this step's tokens) -> [T, H, D]. The step's
    ragged layout is the ForwardBatch's (models/forward_batch.py): seq_lens [S], page_table [S, P], cu_q_lens [S+1].
    plan: `plan_attention`'s for this step and backend (None: the kernels derive it in this call).
    sliding_window: [] i32, the keys each query attends to, its own included (a traced value: the layer's, so a
    rolled layer loop can mix windowed and full layers); None: every key up to its own."""
    args = (q, k_cache, v_cache, layer, seq_lens, page_table, cu_q_lens)
    if backend.name == "native":  # plain JAX: GSPMD partitions it
        return _native_attention(*args, page_size=page_size, scale=scale, sliding_window=sliding_window)
    call = _pallas_kernel(backend.name, page_size, scale, backend.max_chunks)
    # the plan and the window travel as trailing operands (replicated: every shard keeps the model's GQA group)
    extras = {name: value for name, value in (("plan", plan), ("sliding_window", sliding_window)) if value is not None}
    names = tuple(extras)

    def kernel(*operands):
        fixed = len(operands) - len(names)
        return call(*operands[:fixed], **dict(zip(names, operands[fixed:], strict=True)))

    args = (*args, *extras.values())
    mesh = backend.mesh
    if mesh is None or mesh.shape["tensor"] == 1:
        return kernel(*args)
    heads, caches = P(None, "tensor", None), P(None, "tensor", None, None)
    in_specs = (heads, caches, caches, P(), P(), P(), P()) + (P(),) * len(names)
    return jax.shard_map(kernel, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(*args)


def _pallas_kernel(name: str, page_size: int, scale: float, max_chunks: int | None = None):
    """The kernel of a Pallas backend, as a function of (q, k_cache, v_cache, layer, kv_lens, page_table, cu_q_lens)
    and the keywords `plan` (`plan_attention`'s) and `sliding_window`."""
    if name in ("pallas_tpu", "pallas_interpret"):
        from pallas_kernels.attention.tpu import ragged_paged_attention_tpu

        options = dict(page_size=page_size, scale=scale, interpret=name == "pallas_interpret")
        return functools.partial(ragged_paged_attention_tpu, **options)
    if name == "pallas_gpu":
        from pallas_kernels.attention.gpu import ragged_paged_attention_gpu

        # decode rows take the flash-decoding kernel and prefill chunks the q-block kernel, in every step: no branch
        # on the step's kind (pallas_kernels/attention/gpu.py)
        options = dict(page_size=page_size, scale=scale, max_chunks=max_chunks)
        return functools.partial(ragged_paged_attention_gpu, **options)
    raise ValueError(f"unknown attention backend '{name}'; one of {ATTENTION_BACKENDS}")


def _widened(cached: jax.Array, dtype) -> jax.Array:
    """K/V read from the cache, in `dtype` (q's) when the cache holds 8-bit floats; else as stored."""
    return cached.astype(dtype) if cached.dtype.itemsize == 1 else cached


def native_query_layout(num_seqs: int, num_tokens: int) -> tuple[int, int]:
    """-> (rows R, tile Q) of the native path's query layout for a step of at most S sequences and T tokens. Each
    sequence's n tokens fill ceil(n / Q) rows, so R rows hold any split of T tokens over S sequences; a row gathers
    its sequence's keys once and scores Q queries against them. Steps with about as many sequences as tokens
    (decode-heavy) use Q = 1; others Q >= QUERY_TILE and >= T / S (one sequence keeps a single row of T)."""
    if num_tokens <= 4 * num_seqs:
        return num_tokens, 1
    tile = min(num_tokens, max(QUERY_TILE, num_tokens // num_seqs))
    return (num_tokens + num_seqs * (tile - 1)) // tile, tile


def _row_layout(cu_q_lens: jax.Array, num_rows: int, tile: int, num_tokens: int):
    """Rows of the native layout from the cumulative query lengths (inside jit):
    -> (row_seq [R], row_index [R, Q] flat token of each row slot, row_valid [R, Q], token_slot [T] r * Q + q)."""
    num_seqs = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    rows_per_seq = (q_lens + tile - 1) // tile
    first_row = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(rows_per_seq).astype(jnp.int32)])  # [S+1]
    row = jnp.arange(num_rows, dtype=jnp.int32)
    row_seq = jnp.clip(jnp.searchsorted(first_row, row, side="right") - 1, 0, num_seqs - 1)
    row_start = cu_q_lens[row_seq] + (row - first_row[row_seq]) * tile
    row_index = row_start[:, None] + jnp.arange(tile, dtype=jnp.int32)[None, :]
    row_valid = (row < first_row[-1])[:, None] & (row_index < cu_q_lens[row_seq + 1][:, None])
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, token, side="right") - 1, 0, num_seqs - 1)
    offset = token - cu_q_lens[seq]
    token_slot = (first_row[seq] + offset // tile) * tile + offset % tile
    return row_seq, jnp.minimum(row_index, num_tokens - 1), row_valid, jnp.minimum(token_slot, num_rows * tile - 1)


def _native_attention(
    q, k_cache, v_cache, layer, kv_lens, page_table, cu_q_lens, *, page_size: int, scale: float, sliding_window=None
):
    """Pure-JAX ragged paged attention: rows of Q query tokens of one sequence, each row's keys gathered from its
    pages, a causal mask by absolute position (within the sliding window, if any); rows run C at a time (lax.map)
    so gathers stay under NATIVE_GATHER_BYTES."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, pages_per_seq = page_table.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    key_len = pages_per_seq * page_size
    num_rows, tile = native_query_layout(num_seqs, num_tokens)
    row_seq, row_index, row_valid, token_slot = _row_layout(cu_q_lens, num_rows, tile, num_tokens)

    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    query_pos = (kv_lens - q_lens)[row_seq][:, None] + (row_index - cu_q_lens[row_seq][:, None])  # [R, Q]
    key_pos = jnp.arange(key_len, dtype=jnp.int32)
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & row_valid[:, :, None]  # [R, Q, Lk]
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - jnp.asarray(sliding_window, jnp.int32).reshape(())
    key_slots = (page_table[:, :, None] * page_size + jnp.arange(page_size)[None, None, :]).reshape(num_seqs, key_len)
    queries = q[row_index].reshape(num_rows, tile, num_kv_heads, group, head_dim)
    k_layer = jax.lax.dynamic_index_in_dim(k_cache, layer, keepdims=False)  # fuses with the gathers below
    v_layer = jax.lax.dynamic_index_in_dim(v_cache, layer, keepdims=False)

    def attend(args):
        qs, slots, m = args  # [C, Q, K, G, D], [C, Lk], [C, Q, Lk]
        keys, values = _widened(k_layer[:, slots], q.dtype), _widened(v_layer[:, slots], q.dtype)  # [K, C, Lk, D]
        # slots no query of the row may read hold another request's stale K/V, maybe non-finite: 0 * NaN is NaN
        values = jnp.where(jnp.any(m, axis=1)[None, :, :, None], values, 0)
        scores = jnp.einsum("cqkgd,kcld->kcgql", qs, keys, preferred_element_type=jnp.float32) * scale
        probs = _masked_softmax(scores, m[None, :, None]).astype(values.dtype)
        out = jnp.einsum("kcgql,kcld->cqkgd", probs, values, preferred_element_type=jnp.float32)
        return out.astype(q.dtype)

    row_bytes = key_len * num_kv_heads * head_dim * k_cache.dtype.itemsize
    chunk = max(1, min(num_rows, NATIVE_GATHER_BYTES // max(row_bytes, 1)))
    padded_rows = -(-num_rows // chunk) * chunk
    pad = lambda x: jnp.pad(x, [(0, padded_rows - num_rows)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    chunked = lambda x: pad(x).reshape(padded_rows // chunk, chunk, *x.shape[1:])  # noqa: E731
    out = jax.lax.map(attend, (chunked(queries), chunked(key_slots[row_seq]), chunked(mask)))
    out = out.reshape(padded_rows * tile, num_heads, head_dim)[token_slot]
    is_real = jnp.arange(num_tokens) < cu_q_lens[-1]
    return jnp.where(is_real[:, None, None], out, 0).astype(q.dtype)


def _masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis where mask holds; fully masked rows (padding) give zeros, not NaN."""
    scores = jnp.where(mask, scores, _MASKED)
    return jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)

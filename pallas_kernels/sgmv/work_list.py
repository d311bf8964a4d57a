"""Segment -> work-item metadata shared by the TPU and GPU SGMV kernels.

Tokens are sorted by slot into G segments (`LoRABatch.seg_start` / `seg_slot`). The kernels tile the sorted
rows in blocks of `block_rows`; a work item is one (row tile, segment) pair where the segment has rows in the
tile. A grid over work items visits only the adapters present in the batch, and each item reads its
adapter's weights once. The item count is static: a tile list of ceil(T / block_rows) tiles cut by at most
G - 1 segment boundaries gives at most num_tiles + G - 1 items; the unused tail items are empty (lo == hi)
and repeat the last tile, so a TPU output block stays resident across them.

The list can be built inside jit (`make_work_list`, a handful of small XLA ops) or on the host
(`make_work_list_host`, numpy, identical values): the engine's Pallas GPU backend builds it once per forward in
its `prepare` (lora/backend/pallas_gpu.py), so the kernels of every layer share it and no per-call index ops run
on the device.

`layer_operand` is the other piece of metadata both kernels share: the layer index into the model's
layer-stacked [L, A, ...] weight buffers, passed to the kernels as a [1] int32 array.

Contract: segments are contiguous, in order, and cover the sorted rows [0, T) (build_lora_batch does this;
padded segments are empty with start == end == T).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class WorkList:
    tile: jax.Array  # [W] i32   row tile of each work item (sorted order)
    slot: jax.Array  # [W] i32   adapter slot of the item's segment (0 for empty tail items)
    row_lo: jax.Array  # [W] i32 first sorted row of the segment (global index)
    row_hi: jax.Array  # [W] i32 one past the last sorted row of the segment; lo == hi for empty items
    rank: jax.Array  # [W] i32   true rank of the slot (0 for base and empty items)
    is_first: jax.Array  # [W] i32 1 where the item is the first one visiting its tile

    @property
    def num_items(self) -> int:
        return self.tile.shape[0]


jax.tree_util.register_dataclass(
    WorkList,
    data_fields=["tile", "slot", "row_lo", "row_hi", "rank", "is_first"],
    meta_fields=[],
)


def num_work_items(num_rows: int, num_segments: int, block_rows: int) -> int:
    """Static upper bound on work items: one per tile plus one per interior segment boundary."""
    num_tiles = -(-num_rows // block_rows)
    return num_tiles + max(num_segments, 1) - 1


def make_work_list(
    seg_start: jax.Array,  # [G+1] i32
    seg_slot: jax.Array,  # [G] i32
    slot_rank: jax.Array,  # [A] i32
    num_rows: int,
    block_rows: int,
) -> WorkList:
    """Builds the (tile, segment) work items inside jit; O(W log G) integer work."""
    num_segments = seg_slot.shape[0]
    num_tiles = -(-num_rows // block_rows)
    num_items = num_work_items(num_rows, num_segments, block_rows)
    seg_lo = seg_start[:-1]
    seg_hi = seg_start[1:]
    is_nonempty = seg_hi > seg_lo
    first_tile = seg_lo // block_rows
    last_tile = (seg_hi - 1) // block_rows
    tiles_per_seg = jnp.where(is_nonempty, last_tile - first_tile + 1, 0)
    seg_end_item = jnp.cumsum(tiles_per_seg)  # [G] exclusive end of each segment's items
    seg_first_item = seg_end_item - tiles_per_seg
    total_items = seg_end_item[-1]

    item = jnp.arange(num_items, dtype=jnp.int32)
    # compare_all: one fused op; the default binary-search method becomes a device while loop (slow on GPU)
    seg = jnp.searchsorted(seg_end_item, item, side="right", method="compare_all")
    seg = jnp.minimum(seg, num_segments - 1)
    is_valid = item < total_items
    tile = jnp.where(is_valid, first_tile[seg] + item - seg_first_item[seg], num_tiles - 1)
    slot = jnp.where(is_valid, seg_slot[seg], 0)
    row_lo = jnp.where(is_valid, seg_lo[seg], 0)
    row_hi = jnp.where(is_valid, seg_hi[seg], 0)
    rank = jnp.where(is_valid, slot_rank[slot], 0)
    prev_tile = jnp.concatenate([jnp.full((1,), -1, tile.dtype), tile[:-1]])
    is_first = is_valid & (tile != prev_tile)
    as_i32 = lambda a: a.astype(jnp.int32)  # noqa: E731
    return WorkList(
        tile=as_i32(tile),
        slot=as_i32(slot),
        row_lo=as_i32(row_lo),
        row_hi=as_i32(row_hi),
        rank=as_i32(rank),
        is_first=as_i32(is_first),
    )


# the largest token bucket whose GPU kernels take 16-row tiles (past it: 32 up to 512 rows, 64 beyond). With 32
# adapters on an H100, 16-row tiles ran the engine's decode forward 0.5-1.6% faster than 32 in the 512 bucket and 64
# in the 1024 bucket (docs/benchmarks.md "Row tiles of 16 up to the 1024 bucket")
ROW_TILE_16_MAX_ROWS = 1024


def gpu_block_rows(num_rows: int) -> int:
    """Row tile of the GPU kernels for a token bucket: small tiles for decode, larger for prefill.

    Up to ROW_TILE_16_MAX_ROWS rows a tile is 16 rows (Triton's least dot): decode rows of many adapters hold a
    few rows per adapter, so a larger tile mostly carries masked rows, and its registers cut the programs in
    flight."""
    return 16 if num_rows <= ROW_TILE_16_MAX_ROWS else (32 if num_rows <= 512 else 64)


def make_work_list_host(
    seg_start: np.ndarray,  # [G+1] i32
    seg_slot: np.ndarray,  # [G] i32
    slot_rank: np.ndarray,  # [A] i32
    num_rows: int,
    block_rows: int,
) -> WorkList:
    """`make_work_list` in numpy, on the host (same values, numpy leaves)."""
    seg_start = np.asarray(seg_start, np.int64)
    num_segments = seg_slot.shape[0]
    num_tiles = -(-num_rows // block_rows)
    num_items = num_work_items(num_rows, num_segments, block_rows)
    seg_lo, seg_hi = seg_start[:-1], seg_start[1:]
    first_tile = seg_lo // block_rows
    tiles_per_seg = np.where(seg_hi > seg_lo, (seg_hi - 1) // block_rows - first_tile + 1, 0)
    seg = np.repeat(np.arange(num_segments), tiles_per_seg)  # segment of each used item
    used = seg.shape[0]
    offset = np.arange(used) - np.repeat(np.cumsum(tiles_per_seg) - tiles_per_seg, tiles_per_seg)
    pad = num_items - used

    def column(values: np.ndarray, fill: int) -> np.ndarray:
        return np.concatenate([values, np.full(pad, fill)]).astype(np.int32)

    tile = column(first_tile[seg] + offset, num_tiles - 1)
    slot = column(np.asarray(seg_slot)[seg], 0)
    rank = column(np.asarray(slot_rank)[slot[:used]], 0)
    is_first = (np.arange(num_items) < used) & (tile != np.concatenate([[-1], tile[:-1]]))
    return WorkList(
        tile=tile,
        slot=slot,
        row_lo=column(seg_lo[seg], 0),
        row_hi=column(seg_hi[seg], 0),
        rank=rank,
        is_first=is_first.astype(np.int32),
    )


def padded_perm(sort_perm, block_rows: int, xnp=np):
    """sort_perm padded to whole row tiles with the out-of-range row T (xnp: numpy on the host, jnp in jit).

    Those rows are always masked; an index no real row shares keeps interpret mode's masked scatter (which
    writes the old value back) from racing with a real row of the same tile."""
    num_tokens = sort_perm.shape[0]
    padded = -(-num_tokens // block_rows) * block_rows
    return xnp.pad(sort_perm, (0, padded - num_tokens), constant_values=num_tokens).astype(xnp.int32)


def layer_operand(weights: jax.Array, layer: jax.Array | int | None) -> tuple[bool, jax.Array]:
    """(is the buffer layer-stacked, [1] i32 layer index) for a LoRA weight buffer of 3 dims ([A, ...]) or 4
    ([L, A, ...], which needs `layer`); an unstacked buffer gets index 0."""
    if weights.ndim == 4:
        if layer is None:
            raise ValueError(f"a layer-stacked buffer {weights.shape} needs `layer`")
        return True, jnp.asarray(layer, jnp.int32).reshape(1)
    if weights.ndim != 3:
        raise ValueError(f"LoRA buffer of shape {weights.shape}: expected 3 dims, or 4 when layer-stacked")
    return False, jnp.zeros((1,), jnp.int32)

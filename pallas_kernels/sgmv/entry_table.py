"""EntryTable: where each row tile's LoRA runs are, for the GEMM with the LoRA inside it (gemm_lora_gpu.py).

Where it sits: built once per prefill batch by the Pallas GPU LoRA backend (lora/backend/pallas_gpu.py) from the
tokens' adapter slots, shared by every layer; `entry_s` lays out each layer's shrink output per entry. An entry is one
maximal run of tokens of one adapter slot inside one `tile_m`-row tile; base tokens (scale 0) get none.

What exists here: `EntryTable`, `build_entry_table` (on the device, in jit), `entry_s` and `entry_s_parts` (the
scaled shrink output per entry, per packed part), `entries_needed` (the host-side count that sizes a bucket's table).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class EntryTable:
    """Where each row tile's LoRA runs are: built once per batch, shared by every layer."""

    entry_start: jax.Array  # [T / tile_m + 1] i32: row tile i owns entries entry_start[i] .. entry_start[i+1]
    entry_slot: jax.Array  # [E] i32: the slot (row of B's first axis) of each entry
    row_token: jax.Array  # [E * tile_m] i32: the token at each row of the flattened s entries; T = none (zero row)
    token_scale: jax.Array  # [T] f32: scale of the token's slot
    tile_m: int  # static
    max_entries: int  # static: E


jax.tree_util.register_dataclass(
    EntryTable,
    data_fields=["entry_start", "entry_slot", "row_token", "token_scale"],
    meta_fields=["tile_m", "max_entries"],
)


def build_entry_table(token_slot: jax.Array, slot_scale: jax.Array, *, tile_m: int, max_entries: int) -> EntryTable:
    """Cut the tokens into entries, one per maximal run of one slot inside one row tile, base runs (scale 0)
    left out. Entries past max_entries are dropped, so max_entries must be at least (row tiles + runs of
    adapter tokens - 1); `entries_needed` counts them on the host."""
    num_tokens = token_slot.shape[0]
    if num_tokens % tile_m:
        raise ValueError(f"{num_tokens} tokens are not a multiple of the {tile_m}-row tile; pad the batch to one")
    position = jnp.arange(num_tokens, dtype=jnp.int32)
    scale = slot_scale[token_slot].astype(jnp.float32)
    is_lora = scale != 0
    starts = _entry_starts(token_slot, is_lora, tile_m, jnp)
    started = jnp.cumsum(starts.astype(jnp.int32))
    entry = started - 1  # entry of each LoRA token
    tile_first = started[::tile_m] - starts[::tile_m].astype(jnp.int32)
    entry_start = jnp.minimum(jnp.concatenate([tile_first, started[-1:]]), max_entries).astype(jnp.int32)
    entry_slot = (
        jnp.zeros((max_entries,), jnp.int32)
        .at[jnp.where(starts, entry, max_entries)]
        .set(token_slot.astype(jnp.int32), mode="drop")
    )
    token_row = jnp.where(is_lora, entry * tile_m + position % tile_m, max_entries * tile_m)
    row_token = jnp.full((max_entries * tile_m,), num_tokens, jnp.int32).at[token_row].set(position, mode="drop")
    return EntryTable(entry_start, entry_slot, row_token, scale, tile_m, max_entries)


def entry_s(s: jax.Array, table: EntryTable) -> jax.Array:
    """[E, tile_m, R] bf16: scale * s of each entry's tokens at their rows in the tile, zeros elsewhere (a
    gather per layer: the scatter that places the tokens runs once per batch, in `build_entry_table`)."""
    scaled = jnp.concatenate([s * table.token_scale[:, None], jnp.zeros((1, s.shape[1]), s.dtype)])
    return scaled[table.row_token].astype(jnp.bfloat16).reshape(table.max_entries, table.tile_m, s.shape[1])


def entry_s_parts(s: jax.Array, table: EntryTable, num_parts: int) -> jax.Array:
    """[P * E, tile_m, R]: `entry_s` of each packed part's R columns of s ([T, P * R]), part p's entries at p * E."""
    laid_out = entry_s(s, table)  # [E, tile_m, P * R]
    if num_parts == 1:
        return laid_out
    rank = s.shape[1] // num_parts
    parts = laid_out.reshape(table.max_entries, table.tile_m, num_parts, rank)
    return parts.transpose(2, 0, 1, 3).reshape(num_parts * table.max_entries, table.tile_m, rank)


def _entry_starts(token_slot, is_lora, tile_m: int, xp):
    """[T] bool: where an entry starts (an adapter token whose slot differs from the previous token's, or the
    first of a row tile); xp is numpy (host) or jax.numpy (in jit)."""
    position = xp.arange(token_slot.shape[0])
    previous = xp.concatenate([xp.full((1,), -1, token_slot.dtype), token_slot[:-1]])
    return is_lora & ((token_slot != previous) | (position % tile_m == 0))


def entries_needed(token_slot, slot_scale, tile_m: int) -> int:
    """Host-side count of the entries of a batch (numpy arrays): the least max_entries for it."""
    token_slot = np.asarray(token_slot)
    return int(np.sum(_entry_starts(token_slot, np.asarray(slot_scale)[token_slot] != 0, tile_m, np)))

"""The tail split of the base GEMM kernel: whole waves of CTA tiles, then the last partial wave's tiles cut in K.

Where it sits: gemm_gpu.py runs the kernel of gemm_lora_gpu.py (`_kernel`, `tail_split=True`) with this schedule in
decode-sized token buckets, where a module's CTA tiles rarely fill whole waves over the SMs: at 751 real rows (6 row
tiles of 128) q|k|v has 144 tiles on 132 SMs (a second wave of 12 tiles, so the GEMM runs at 0.55 of the SMs), o and
down 96 (0.73). The row count is data, not a shape, so the schedule is chosen inside the kernel from it.

The schedule: the first `num_sms * (tiles // num_sms)` tiles run whole, one K loop each, as before; the remaining
tiles (fewer than the SMs) are each cut into `pieces` equal runs of K steps, so that remaining tiles x pieces work
units spread over the SMs. A piece adds its float32 product, rounded to the output's dtype, into the output with a
TMA reduce-add; the output starts at zero (XLA zeroes it before the kernel), so a tile cut in P pieces is the sum of
P rounded parts, whose order varies between runs. Units are ordered piece-major, so the SMs working at the same time
read the same rows of W, as the whole tiles do. With one piece every tile is whole and stores its product.

What exists here: `tail_pieces` (the pieces that minimize the tail's K steps, counting PIECE_OVERHEAD_STEPS for each
piece; traced or on Python ints), `unit_work` (a unit's tile and K range) and `modeled_saving` (the share of a
module's K steps the split saves, averaged over a bucket's row counts: gemm_gpu.py turns the split on from it).
"""

from __future__ import annotations

import jax.numpy as jnp

MAX_PIECES = 8
MIN_PIECE_STEPS = 2  # a piece runs at least this many K steps
# what a piece costs beyond its K steps, in K steps: fitted to per-module times on an H200, where pieces of 8-75
# steps took about 12 steps more than their share of a whole tile's time, most of it the TMA reduce-add of the
# piece's [128, 256] product (docs/benchmarks.md "The tail split: the last partial wave's tiles in pieces of K")
PIECE_OVERHEAD_STEPS = 12


def tail_pieces(remaining_tiles, num_sms: int, k_steps: int):
    """The pieces (1..MAX_PIECES) to cut each of `remaining_tiles` (< num_sms) tiles into: the count that needs the
    fewest K steps for the tail, ceil(remaining x P / num_sms) waves of ceil(k_steps / P) + PIECE_OVERHEAD_STEPS
    steps, the smallest P among equals. Works on traced int32 scalars (inside the kernel) and Python ints."""
    best_pieces = jnp.asarray(1, jnp.int32) if not isinstance(remaining_tiles, int) else 1
    best_cost = (remaining_tiles + num_sms - 1) // num_sms * (k_steps + PIECE_OVERHEAD_STEPS)  # 0: no tail
    for pieces in range(2, MAX_PIECES + 1):
        if k_steps // pieces < MIN_PIECE_STEPS:
            break
        waves = (remaining_tiles * pieces + num_sms - 1) // num_sms
        cost = waves * (-(-k_steps // pieces) + PIECE_OVERHEAD_STEPS)
        if isinstance(remaining_tiles, int):
            best_pieces, best_cost = (pieces, cost) if cost < best_cost else (best_pieces, best_cost)
        else:
            better = cost < best_cost
            best_pieces = jnp.where(better, pieces, best_pieces)
            best_cost = jnp.where(better, cost, best_cost)
    return best_pieces


def unit_work(unit, whole_tiles, remaining_tiles, pieces, k_steps: int):
    """Work unit `unit` -> (tile, first K step, end K step, is a piece). Units below `whole_tiles` are those tiles,
    whole; unit whole_tiles + p * remaining_tiles + r is piece p of tile whole_tiles + r, K steps
    [p * k_steps // pieces, (p + 1) * k_steps // pieces). With one piece the remaining tiles are whole too (they
    store their products: a TMA reduce-add of a tile costs about as much as 8-12 K steps)."""
    is_piece = (unit >= whole_tiles) & (pieces > 1)
    tail = jnp.maximum(unit - whole_tiles, 0)
    per_piece = jnp.maximum(remaining_tiles, 1)
    piece, tile_in_tail = tail // per_piece, tail % per_piece
    tile = jnp.where(is_piece, whole_tiles + tile_in_tail, unit)
    k_first = jnp.where(is_piece, piece * k_steps // pieces, 0)
    k_end = jnp.where(is_piece, (piece + 1) * k_steps // pieces, k_steps)
    return tile, k_first, k_end, is_piece


def modeled_saving(num_tokens: int, in_dim: int, out_dim: int, tile_m: int, cta_n: int, tile_k: int, num_sms: int):
    """The share of the time the tail split saves on one module in `tail_pieces`' terms (each wave of units costs its
    K steps plus PIECE_OVERHEAD_STEPS), averaged over the row tiles a bucket of `num_tokens` holds in a decode step
    (from one more than half its row tiles to all of them: smaller steps take the bucket below)."""
    k_steps, n_tiles = in_dim // tile_k, out_dim // cta_n
    max_m = num_tokens // tile_m
    savings = []
    for m_tiles in range(max_m // 2 + 1, max_m + 1):
        whole_waves, remaining = divmod(m_tiles * n_tiles, num_sms)
        pieces = tail_pieces(remaining, num_sms, k_steps)
        wave = k_steps + PIECE_OVERHEAD_STEPS
        before = (whole_waves + (remaining > 0)) * wave
        after = whole_waves * wave + -(-remaining * pieces // num_sms) * (-(-k_steps // pieces) + PIECE_OVERHEAD_STEPS)
        savings.append(1 - after / before)
    return sum(savings) / len(savings) if savings else 0.0

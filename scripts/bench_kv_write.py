"""The K/V cache write of a step with padding tokens: the engine's write against the same scatter undeclared.

A step's token bucket holds padding tokens, and every padding token writes slot 0 of the reserved page 0
(layers/attention.py `write_kv`). The engine declares the write's slots unique (`_set_rows`): XLA may then write the
colliding padding rows in any order. This script times, per layer, one [L, K, N, D] cache's write of T tokens of
which `real` hold distinct random slots and the rest slot 0:

- `plain`: `cache.at[layer, :, cache_loc].set(rows)` (no declaration: XLA orders the colliding writes);
- `unique`: layers/attention.py `_set_rows`, the engine's write.

Each program writes all L layers (one scatter a layer, as a forward does) into a donated cache, so the times hold no
dispatch; the row is the program's time over L. The padding tokens' rows are one row repeated (the engine's padding
tokens are token 0 at position 0: one K/V row) or, with `identical=False`, all different. Each row checks that the
real tokens' rows landed.

Usage: python scripts/bench_kv_write.py --json out.json [--cache-tokens 330000 --layers 32 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_jax_lora.layers.attention import _set_rows  # noqa: E402

# (tokens T, real tokens, padding rows identical): decode buckets of 512 and 1024 rows and a 4096-token mixed step
ROWS = [(512, 345, True), (512, 345, False), (1024, 750, True), (4096, 4016, True)]


def writer(num_layers: int, unique: bool):
    def write(cache, cache_loc, rows):
        for layer in range(num_layers):
            layer_index = jnp.int32(layer)
            if unique:
                cache = _set_rows(cache, layer_index, cache_loc, rows + layer)
            else:
                cache = cache.at[layer_index, :, cache_loc].set(rows + layer)
        return cache

    return jax.jit(write, donate_argnums=0)


def run_row(cache, fns, shape, row, reps: int, rng) -> tuple[jax.Array, dict]:
    num_layers, num_kv_heads, num_slots, head_dim = shape
    num_tokens, real, identical = row
    cache_loc = np.zeros(num_tokens, np.int32)
    cache_loc[:real] = rng.choice(np.arange(16, num_slots), real, replace=False)  # page 0 (16 slots) reserved
    values = rng.standard_normal((num_tokens, num_kv_heads, head_dim))
    if identical:
        values[real:] = values[real]
    rows, cache_loc = jnp.asarray(values, cache.dtype), jnp.asarray(cache_loc)
    result = dict(tokens=num_tokens, real=real, padding_rows_identical=identical, us={})
    for name, fn in fns.items():
        for _ in range(3):
            cache = fn(cache, cache_loc, rows)
        cache.block_until_ready()
        start = time.perf_counter()
        for _ in range(reps):
            cache = fn(cache, cache_loc, rows)
        cache.block_until_ready()
        result["us"][name] = (time.perf_counter() - start) / reps / num_layers * 1e6
        landed = np.asarray(cache[1][:, np.asarray(cache_loc[:real])].astype(jnp.float32))
        want = np.asarray((rows[:real] + 1).astype(jnp.float32)).transpose(1, 0, 2)
        result[f"{name}_written"] = bool(np.array_equal(landed, want))
    bytes_written = num_tokens * num_kv_heads * head_dim * cache.dtype.itemsize
    result["gb_s"] = {name: bytes_written / us / 1e3 for name, us in result["us"].items()}
    return cache, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--cache-tokens", type=int, default=330000, help="slots N of the cache")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20, help="timed programs per row and variant")
    parser.add_argument("--rows", default="all", help="comma-separated indices into ROWS, or all")
    args = parser.parse_args()
    shape = (args.layers, args.kv_heads, args.cache_tokens, args.head_dim)
    picked = ROWS if args.rows == "all" else [ROWS[int(i)] for i in args.rows.split(",")]
    cache = jnp.zeros(shape, jnp.bfloat16)
    fns = {"plain": writer(args.layers, unique=False), "unique": writer(args.layers, unique=True)}
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "cache": list(shape), "rows": []}
    rng = np.random.default_rng(0)
    print("| tokens | real | padding rows | plain us/layer | unique us/layer |", flush=True)
    for row in picked:
        cache, result = run_row(cache, fns, shape, row, args.reps, rng)
        out["rows"].append(result)
        us = result["us"]
        identical = "identical" if result["padding_rows_identical"] else "different"
        print(f"| {row[0]} | {row[1]} | {identical} | {us['plain']:.1f} | {us['unique']:.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

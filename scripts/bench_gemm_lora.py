"""Prefill LoRA inside the base GEMM (pallas_kernels/sgmv/gemm_lora_gpu.py) against XLA's GEMM and the SGMV path.

For each (shape, rank, T) it jits 16 unrolled layers with distinct weights (the protocol of
bench_lora_kernels.py) and times, side by side in one process:

- `xla`: the base GEMM alone, y = x @ W (what the engine runs without LoRA);
- `sgmv`: y = x @ W, then the Pallas backend's SGMV shrink and expand adding into y (the engine's prefill today);
- `mosaic_base`: the Mosaic GPU GEMM of gemm_lora_gpu with no LoRA entries (the kernel's own base speed);
- `fused`: the SGMV shrink, then gemm_lora_gpu (entry layout of s in XLA, the GEMM with the expand inside),
  the entry table built once for all layers, as a model would build it once per forward;
- and the parts of `fused` alone: `shrink` and `entry_s`.

Tokens are a prefill batch: `segments` sequences of T / segments tokens each, one adapter per sequence, held
together in token order as the engine lays out a prefill batch. Ratios are to `xla`. Needs a Hopper GPU.

Correctness: `pytest -m gpu tests/test_gemm_lora.py` (the kernel against pallas_kernels/sgmv/reference.py).

Usage: python scripts/bench_gemm_lora.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.sgmv.gemm_lora_gpu import (  # noqa: E402
    build_entry_table, choose_gemm_lora_tiles, entries_needed, entry_s, gemm_lora_gpu,
)
from pallas_kernels.sgmv.gpu import choose_tiles, sgmv_shrink_gpu_partials  # noqa: E402
from pallas_kernels.sgmv.work_list import gpu_block_rows  # noqa: E402
from scripts.bench_lora_kernels import time_fn  # noqa: E402
from sgl_jax_lora.lora.backend import make_lora_backend  # noqa: E402
from sgl_jax_lora.lora.lora_batch import build_lora_batch  # noqa: E402

SHAPES = {"qo": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = [("qo", 16, 4096), ("qo", 64, 4096), ("qo", 16, 8192), ("qo", 16, 2048), ("gate_up", 16, 4096), ("down", 16, 4096)]


def run_row(shape: str, rank: int, num_tokens: int, segments: int, layers: int, min_seconds: float) -> dict:
    in_dim, out_dim = SHAPES[shape]
    num_slots = max(8, segments) + 1
    token_slot = np.repeat(1 + np.arange(segments), num_tokens // segments).astype(np.int32)
    ranks = np.full(num_slots, rank, np.int32)
    ranks[0] = 0
    scale = np.where(ranks > 0, 2.0, 0.0).astype(np.float32)
    lora = build_lora_batch(token_slot, 1 << (segments - 1).bit_length(), scale, ranks, gpu_block_rows(num_tokens))
    lora = jax.tree_util.tree_map(jnp.asarray, lora)
    keys = jax.random.split(jax.random.key(rank), 3)
    ws = [jax.random.normal(jax.random.fold_in(keys[0], i), (in_dim, out_dim), jnp.bfloat16) * 0.02 for i in range(layers)]
    as_ = [jax.random.normal(jax.random.fold_in(keys[1], i), (num_slots, rank, in_dim), jnp.bfloat16) * 0.02 for i in range(layers)]
    bs = [jax.random.normal(jax.random.fold_in(keys[2], i), (num_slots, out_dim, rank), jnp.bfloat16) * 0.02 for i in range(layers)]
    x = jax.random.normal(jax.random.key(1), (num_tokens, in_dim), jnp.bfloat16)
    pallas = make_lora_backend("pallas")
    tiles = choose_gemm_lora_tiles(rank)
    max_entries = entries_needed(token_slot, scale, tiles.tile_m)
    shrink_tiles = choose_tiles(num_tokens, lora.num_segments, in_dim, None)
    work = (lora.work, lora.work_perm) if lora.work_block_rows == shrink_tiles.block_rows else (None, None)

    def shrink(x, a, lora):
        meta = (lora.sort_perm, lora.seg_start, lora.seg_slot, lora.slot_rank)
        return sgmv_shrink_gpu_partials(x, a, *meta, *work, tiles=shrink_tiles, rank_block=rank).sum(0)

    def table_of(lora):
        return build_entry_table(lora.token_slot, lora.slot_scale, tile_m=tiles.tile_m, max_entries=max_entries)

    def fused(x, ws, as_, bs, lora):
        table = table_of(lora)
        return [gemm_lora_gpu(x, w, shrink(x, a, lora), table, b, tiles=tiles) for w, a, b in zip(ws, as_, bs)]

    def mosaic_base(x, ws, bs, lora):
        table = build_entry_table(lora.token_slot, jnp.zeros_like(lora.slot_scale), tile_m=tiles.tile_m, max_entries=1)
        s = jnp.zeros((num_tokens, rank), jnp.float32)
        return [gemm_lora_gpu(x, w, s, table, b, tiles=tiles) for w, b in zip(ws, bs)]

    programs = {
        "xla": (lambda x, ws: [x @ w for w in ws], (x, ws)),
        "sgmv": (lambda x, ws, as_, bs, lora: [pallas.apply(x, a, b, lora, base_out=x @ w) for w, a, b in zip(ws, as_, bs)],
                 (x, ws, as_, bs, lora)),
        "mosaic_base": (mosaic_base, (x, ws, bs, lora)),
        "fused": (fused, (x, ws, as_, bs, lora)),
        "shrink": (lambda x, as_, lora: [shrink(x, a, lora) for a in as_], (x, as_, lora)),
        "entry_s": (lambda ss, lora: [entry_s(s, table_of(lora)) for s in ss],
                    ([jnp.ones((num_tokens, rank), jnp.float32) * i for i in range(layers)], lora)),
    }
    row = dict(shape=shape, in_dim=in_dim, out_dim=out_dim, rank=rank, tokens=num_tokens, segments=segments,
               entries=max_entries, tiles=str(tiles), us={})
    for name, (fn, args) in programs.items():
        row["us"][name] = time_fn(jax.jit(fn), args, min_seconds) / layers * 1e6
    row["ratio"] = {name: t / row["us"]["xla"] for name, t in row["us"].items()}
    y_fused = jax.jit(fused)(x, ws[:1], as_[:1], bs[:1], lora)[0].astype(jnp.float32)
    y_sgmv = jax.jit(programs["sgmv"][0])(x, ws[:1], as_[:1], bs[:1], lora)[0].astype(jnp.float32)
    row["fused_vs_sgmv_rel_err"] = float(jnp.max(jnp.abs(y_fused - y_sgmv)) / jnp.max(jnp.abs(y_sgmv)))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time per program (bench_lora_kernels.time_fn)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--segments", type=int, default=32)
    parser.add_argument("--rows", default="all", help="comma-separated indices into ROWS, or all")
    args = parser.parse_args()
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": []}
    picked = ROWS if args.rows == "all" else [ROWS[int(i)] for i in args.rows.split(",")]
    print("| shape | rank | T | xla us | sgmv | mosaic base | fused | shrink us | entry_s us |", flush=True)
    for shape, rank, num_tokens in picked:
        row = run_row(shape, rank, num_tokens, args.segments, args.layers, args.min_seconds)
        out["rows"].append(row)
        r, us = row["ratio"], row["us"]
        print(f"| {shape} | {rank} | {num_tokens} | {us['xla']:.1f} | {r['sgmv']:.3f} | {r['mosaic_base']:.3f} | "
              f"{r['fused']:.3f} | {us['shrink']:.1f} | {us['entry_s']:.1f} |", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Prefill LoRA inside the base GEMM, as the engine runs it, against XLA's GEMM and the SGMV path.

For each row (module, rank, T, sequences) it builds one layer-stacked weight per buffer, as the model holds them
(W [L, in, out], A [L, slots, P*R, in], one B [L, slots, out_p, R] per packed part), jits `layers` layers each
reading its layer from the stacks (LayerStack views with the layer index constant, as in the engine's unrolled
layer loop), and times, side by side in one process:

- `xla`: the base GEMM alone, x @ W[layer] (what the engine runs without LoRA);
- `sgmv`: x @ W[layer], then the Pallas backend's SGMV shrink and expand adding every part's delta into it (the
  engine's prefill with `--lora-fused-gemm-min-tokens 0`);
- `fused`: the Pallas backend's `apply_with_base`: the SGMV shrink, the per-layer entry layout of s, and
  pallas_kernels/sgmv/gemm_lora_gpu.py (the GEMM with every part's expand inside), with the batch's entry table
  built once for all layers, as the backend prepares it once per forward (the engine's prefill on Hopper GPUs);
- `mosaic_base`: that GEMM kernel with no LoRA entries (its own base speed, with the LoRA tiles still allocated;
  the kernel without them, which the engine runs for base GEMMs, is timed by scripts/bench_gemm.py);
- `fused_unsplit`, in rows where `fused` cuts the K loop (`choose_gemm_lora_split`): `fused` in one part;
- `base_kernel`: pallas_kernels/sgmv/gemm_gpu.py, the base GEMM the engine runs without adapters (its own K split).

Tokens are a prefill batch: `sequences` sequences of T / sequences tokens each, one adapter per sequence, held
together in token order as the engine lays out a prefill batch. Ratios are to `xla`. Needs a Hopper GPU.

Correctness, on the GPU: `pytest tests/pallas_kernels/sgmv/test_gemm_lora_gpu.py
tests/sgl_jax_lora/lora/backend/test_pallas_gemm_lora.py`.

Usage: python scripts/bench_gemm_lora.py --json out.json [--rows 0,1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.sgmv.entry_table import build_entry_table  # noqa: E402
from pallas_kernels.sgmv.gemm_gpu import gemm_gpu  # noqa: E402
from pallas_kernels.sgmv.gemm_lora_gpu import (  # noqa: E402
    choose_gemm_lora_split,
    choose_gemm_lora_tiles,
    gemm_lora_gpu,
)
from pallas_kernels.sgmv.work_list import gpu_block_rows  # noqa: E402
from scripts.bench_lora_kernels import time_fn  # noqa: E402
from sgl_jax_lora.layers.layer_stack import LayerStack  # noqa: E402
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend, entry_table, prepare_on_host  # noqa: E402
from sgl_jax_lora.lora.lora_batch import build_lora_batch  # noqa: E402

# Llama-3-8B modules: in, part widths
MODULES = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
# module, rank, T, sequences: the prefill goal rows (T = 4096, 32 adapters), then the engine's other prefill buckets
# (--max-prefill-seqs 8 by default)
ROWS = [
    ("o", 16, 4096, 32),
    ("o", 64, 4096, 32),
    ("qkv", 16, 4096, 32),
    ("gate_up", 16, 4096, 32),
    ("down", 16, 4096, 32),
    ("o", 16, 2048, 8),
    ("qkv", 16, 2048, 8),
    ("gate_up", 16, 2048, 8),
    ("down", 16, 2048, 8),
    ("o", 16, 1024, 8),
    ("qkv", 16, 1024, 8),
    ("o", 16, 512, 8),
    ("qkv", 16, 512, 8),
    # the buckets from 512, where the fused GEMM ran first (its default is now 1024)
    ("gate_up", 16, 1024, 8),
    ("down", 16, 1024, 8),
    ("gate_up", 16, 512, 8),
    ("down", 16, 512, 8),
    ("o", 16, 256, 8),
    ("qkv", 16, 256, 8),
    ("gate_up", 16, 256, 8),
    ("down", 16, 256, 8),
    ("o", 16, 128, 4),
    ("qkv", 16, 128, 4),
    ("gate_up", 16, 128, 4),
    ("down", 16, 128, 4),
    # decode buckets of the serving runs with 32 adapters: the scheduler groups decode rows by adapter, so a row
    # tile holds one run per adapter it meets (8 at 512 rows, 16 with 64 adapters); rows 25-32
    ("qkv", 16, 512, 32),
    ("o", 16, 512, 32),
    ("gate_up", 16, 512, 32),
    ("down", 16, 512, 32),
    ("o", 16, 512, 64),
    ("down", 16, 512, 64),
    ("gate_up", 16, 1024, 32),
    ("down", 16, 1024, 32),
    # the 256-token decode bucket with 32 adapters (runs of 8 rows), below the default --lora-fused-gemm-min-tokens
    ("qkv", 16, 256, 32),
    ("o", 16, 256, 32),
    ("gate_up", 16, 256, 32),
    ("down", 16, 256, 32),
]


def run_row(module: str, rank: int, num_tokens: int, sequences: int, layers: int, min_seconds: float) -> dict:
    in_dim, widths = MODULES[module]
    num_parts = len(widths)
    num_slots = max(8, sequences) + 1
    token_slot = np.repeat(1 + np.arange(sequences), num_tokens // sequences).astype(np.int32)
    ranks = np.full(num_slots, rank, np.int32)
    ranks[0] = 0
    scale = np.where(ranks > 0, 2.0, 0.0).astype(np.float32)
    lora = build_lora_batch(token_slot, 1 << (sequences - 1).bit_length(), scale, ranks)
    # the Pallas GPU backend's metadata, its work list built on the host; and with the fused GEMM's entry table
    lora = jax.tree_util.tree_map(jnp.asarray, prepare_on_host(lora, gpu_block_rows(num_tokens)))
    tiles = choose_gemm_lora_tiles(rank)
    lora_fused = dataclasses.replace(lora, entries=entry_table(lora.batch, tiles.tile_m, sequences))
    keys = jax.random.split(jax.random.key(rank), 3 + num_parts)

    def normal(key, shape):
        return jax.jit(lambda: (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(jnp.bfloat16))()

    w = normal(keys[0], (layers, in_dim, sum(widths)))
    lora_a = normal(keys[1], (layers, num_slots, num_parts * rank, in_dim))
    lora_bs = tuple(normal(keys[3 + p], (layers, num_slots, width, rank)) for p, width in enumerate(widths))
    x = normal(keys[2], (num_tokens, in_dim))
    sgmv_backend = PallasGPUBackend(fused_gemm_min_tokens=0)
    fused_backend = PallasGPUBackend(fused_gemm_min_tokens=1)
    unsplit_backend = PallasGPUBackend(fused_gemm_min_tokens=1, fused_gemm_split_k=False)

    def views(layer, *stacks):
        return [LayerStack(s, jnp.int32(layer)) for s in stacks]

    def xla(x, w):
        return [x @ w[i] for i in range(layers)]

    def sgmv(x, w, lora_a, lora_bs, lora):
        return [
            sgmv_backend.apply_packed(x, *views(i, lora_a), tuple(views(i, *lora_bs)), lora, x @ w[i], tp_size=1)
            for i in range(layers)
        ]

    def fused_with(backend):
        def fused(x, w, lora_a, lora_bs, lora):
            outs = []
            for i in range(layers):
                w_view, a_view, *b_views = views(i, w, lora_a, *lora_bs)
                y = backend.apply_with_base(x, w_view, a_view, tuple(b_views), lora, tp_size=1)
                assert y is not None, "the module does not fit the fused GEMM"
                outs.append(y)
            return outs

        return fused

    fused = fused_with(fused_backend)

    def base_kernel(x, w):
        return [gemm_gpu(x, w, jnp.int32(i)) for i in range(layers)]

    def mosaic_base(x, w, lora_bs, lora):
        table = build_entry_table(
            lora.batch.token_slot, jnp.zeros_like(lora.batch.slot_scale), tile_m=tiles.tile_m, max_entries=1
        )
        s = jnp.zeros((num_tokens, num_parts * rank), jnp.float32)
        return [gemm_lora_gpu(x, w, s, table, lora_bs, jnp.int32(i), tiles=tiles) for i in range(layers)]

    programs = {
        "xla": (xla, (x, w)),
        "sgmv": (sgmv, (x, w, lora_a, lora_bs, lora)),
        "fused": (fused, (x, w, lora_a, lora_bs, lora_fused)),
        "mosaic_base": (mosaic_base, (x, w, lora_bs, lora)),
        "base_kernel": (base_kernel, (x, w)),
    }
    k_splits = choose_gemm_lora_split(num_tokens, in_dim, sum(widths), rank, jax.devices()[0].core_count)[1]
    if k_splits > 1:
        programs["fused_unsplit"] = (fused_with(unsplit_backend), (x, w, lora_a, lora_bs, lora_fused))
    row = dict(
        module=module,
        in_dim=in_dim,
        widths=widths,
        rank=rank,
        tokens=num_tokens,
        sequences=sequences,
        layers=layers,
        max_entries=lora_fused.entries.max_entries,
        tiles=str(tiles),
        fused_k_splits=k_splits,
        us={},
    )
    for name, (fn, args) in programs.items():
        row["us"][name] = time_fn(jax.jit(fn), args, min_seconds) / layers * 1e6
    row["ratio"] = {name: t / row["us"]["xla"] for name, t in row["us"].items()}
    y_fused = jax.jit(fused)(x, w, lora_a, lora_bs, lora_fused)[-1].astype(jnp.float32)
    y_sgmv = jax.jit(sgmv)(x, w, lora_a, lora_bs, lora)[-1].astype(jnp.float32)
    row["fused_vs_sgmv_rel_err"] = float(jnp.max(jnp.abs(y_fused - y_sgmv)) / jnp.max(jnp.abs(y_sgmv)))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time per program (bench_lora_kernels.time_fn)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", default="all", help="comma-separated indices into ROWS, or all")
    args = parser.parse_args()
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": []}
    picked = ROWS if args.rows == "all" else [ROWS[int(i)] for i in args.rows.split(",")]
    print(
        "| module | rank | T | seqs | xla us | sgmv | fused (K parts) | fused in one part | mosaic base | base kernel | "
        "fused vs sgmv err |",
        flush=True,
    )
    for module, rank, num_tokens, sequences in picked:
        row = run_row(module, rank, num_tokens, sequences, args.layers, args.min_seconds)
        out["rows"].append(row)
        r, us = row["ratio"], row["us"]
        unsplit = f"{r['fused_unsplit']:.3f}" if "fused_unsplit" in r else "-"
        print(
            f"| {module} | {rank} | {num_tokens} | {sequences} | {us['xla']:.1f} | {r['sgmv']:.3f} | "
            f"{r['fused']:.3f} ({row['fused_k_splits']}) | {unsplit} | {r['mosaic_base']:.3f} | {r['base_kernel']:.3f} | "
            f"{row['fused_vs_sgmv_rel_err']:.4f} |",
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

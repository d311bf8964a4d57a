"""Tile variants of the GPU SGMV kernels on Llama-3-8B module shapes, as the engine calls them (GPU only).

For each module (q|k|v and gate|up packed, o, down), token count T and distinct adapters n, it times 16
layers of `x @ W` alone and then with the LoRA added by `apply_packed`, the LoRA buffers passed as
layer-stacked [L, A, ...] arrays (LayerStack views, as the model's layer loop passes them), once per
backend (bgmv, the pure-JAX baseline the engine's auto uses at decode) and once per Pallas tile variant
(GpuTiles fields overridden on top of `choose_tiles`). Prints ratio to the base GEMM and the memory-bound
limit per row; the full results go to --json.

    python scripts/tune_gpu_sgmv.py --rows decode --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.sgmv import gpu as gpu_kernels  # noqa: E402
from scripts.bench_lora_kernels import make_lora, time_fn  # noqa: E402
from sgl_jax_lora.layers.layer_stack import LayerStack  # noqa: E402
from sgl_jax_lora.lora.backend import make_lora_backend  # noqa: E402
from sgl_jax_lora.lora.backend import pallas_gpu as pallas_backend  # noqa: E402

# module -> (in, part widths, row-parallel)
MODULES = {
    "qkv": (4096, (4096, 1024, 1024), False),
    "o": (4096, (4096,), True),
    "gate_up": (4096, (14336, 14336), False),
    "down": (14336, (4096,), True),
}
# (module, rank, token bucket T, distinct adapters n[, rows of the bucket that carry an adapter; the rest pad])
ROWS = {
    "decode": [(m, 16, 64, 32) for m in MODULES] + [("qkv", 16, 256, 128), ("gate_up", 16, 256, 128)],
    # the ShareGPT serving tail's mean steps: 147 rows in the 256 bucket, 28 in the 64 bucket, one adapter a row
    "tail": [(m, 16, 256, 32, 147) for m in MODULES] + [(m, 16, 64, 28, 28) for m in MODULES],
    "prefill": [("qkv", 16, 4096, 32), ("o", 16, 4096, 32), ("o", 64, 4096, 32), ("gate_up", 16, 4096, 32)],
    # where `auto` switches between bgmv and pallas at decode: few adapters, small decode buckets
    "small": [("gate_up", 16, t, n) for t in (8, 32, 64) for n in (1, 8)]
    + [(m, 16, 64, 8) for m in ("qkv", "o", "down")],
}
VARIANTS = {
    "default": {},
    "col_mask_1": {"rank_granule": 1},
    "no_col_mask": {"rank_granule": 0},
    "warps_2": {"num_warps": 2},
    "warps_8": {"num_warps": 8},
    "out_128": {"block_out": 128},
    "out_64": {"block_out": 64},
    "splits_x2": {"in_splits": "x2"},
    "splits_half": {"in_splits": "half"},
    "in_128": {"block_in": 128},
    "in_256": {"block_in": 256},
    "steps_1": {"out_steps": 1},
    "steps_2": {"out_steps": 2},
    "out_128_steps_1": {"block_out": 128, "out_steps": 1},
    "rows_16": {"block_rows": 16},
    "rows_32": {"block_rows": 32},
    "rows_16_steps_1": {"block_rows": 16, "out_steps": 1},
    "shrink_stages_2": {"num_stages": 2},
    "shrink_stages_4": {"num_stages": 4},
}


def patched_choose_tiles(overrides: dict):
    """`choose_tiles` with a variant's fields put on top. A `block_rows` override is passed to it (the other
    tiles follow the new row tile); the engine's work list must use it too (`apply_variant`)."""
    original = gpu_kernels.choose_tiles
    block_rows = overrides.get("block_rows")

    def choose(num_tokens, num_segments, in_dim, out_dims, **kwargs):
        tiles = original(num_tokens, num_segments, in_dim, out_dims, block_rows, **kwargs)
        changes = {k: v for k, v in overrides.items() if k != "block_rows"}
        splits = changes.pop("in_splits", None)
        if splits is not None and in_dim is not None:
            k_steps = in_dim // tiles.block_in
            wanted = tiles.in_splits * 2 if splits == "x2" else max(1, tiles.in_splits // 2)
            if k_steps % wanted == 0:
                changes["in_splits"] = wanted
        if out_dims is None:
            changes.pop("block_out", None)
            changes.pop("out_steps", None)
        tiles = dataclasses.replace(tiles, **changes)
        if out_dims is not None:  # keep out_steps valid for the new block_out
            parts = out_dims if isinstance(out_dims, tuple) else (out_dims,)
            while any((p // tiles.block_out) % tiles.out_steps for p in parts):
                tiles = dataclasses.replace(tiles, out_steps=tiles.out_steps // 2)
        return tiles

    return choose


def apply_variant(overrides: dict):
    """From now on every Pallas GPU LoRA call traced runs with the variant's tiles, and the backend's per-step
    work list with its row tile. Returns the function that puts the defaults back."""
    saved = pallas_backend.choose_tiles, pallas_backend.gpu_block_rows
    pallas_backend.choose_tiles = patched_choose_tiles(overrides)
    if "block_rows" in overrides:
        pallas_backend.gpu_block_rows = lambda _: overrides["block_rows"]

    def restore() -> None:
        pallas_backend.choose_tiles, pallas_backend.gpu_block_rows = saved

    return restore


@contextlib.contextmanager
def use_variant(overrides: dict):
    """`apply_variant` for the calls traced inside the block."""
    restore = apply_variant(overrides)
    try:
        yield
    finally:
        restore()


def run_row(module, rank, num_tokens, num_adapters, args, variants, backends, adapter_rows=None) -> dict:
    in_dim, widths, row_parallel = MODULES[module]
    num_slots = max(8, num_adapters) + 1
    layers = args.layers
    num_segments = 33 if adapter_rows is not None else None  # the engine's bucket for up to 32 adapters and base rows
    lora, num_present = make_lora(
        num_tokens,
        num_adapters,
        num_slots,
        rank,
        seed=num_tokens + num_adapters,
        adapter_rows=adapter_rows,
        num_segments=num_segments,
    )
    key = jax.random.key(0)
    k_w, k_a, k_b, k_x = jax.random.split(key, 4)
    ws = [
        jax.random.normal(jax.random.fold_in(k_w, i), (in_dim, sum(widths)), jnp.bfloat16) * 0.02 for i in range(layers)
    ]
    slot_mask = (jnp.arange(num_slots) > 0)[None, :, None, None].astype(jnp.bfloat16)
    a_stack = jax.random.normal(k_a, (layers, num_slots, len(widths) * rank, in_dim), jnp.bfloat16) * 0.02 * slot_mask
    b_stacks = tuple(
        jax.random.normal(jax.random.fold_in(k_b, i), (layers, num_slots, w, rank), jnp.bfloat16) * 0.02 * slot_mask
        for i, w in enumerate(widths)
    )
    x = jax.random.normal(k_x, (num_tokens, in_dim), jnp.bfloat16)
    w_bytes = in_dim * sum(widths) * 2
    lora_bytes = num_present * rank * (len(widths) * in_dim + sum(widths)) * 2
    row = dict(
        module=module,
        rank=rank,
        tokens=num_tokens,
        adapter_rows=num_tokens if adapter_rows is None else adapter_rows,
        distinct=num_present,
        segments=lora.num_segments,
        limit=(w_bytes + lora_bytes) / w_bytes,
        ratio={},
        errors={},
    )

    base_fn = jax.jit(lambda x, ws: [x @ w for w in ws])
    t_base = time_fn(base_fn, (x, ws), args.min_seconds)
    row["t_base_us"] = t_base / layers * 1e6

    def lora_fn_for(backend):
        def lora_fn(x, ws, a_stack, b_stacks, lora):
            meta = backend.prepare(lora, num_seqs=num_tokens)  # once per program, shared by the layers
            out = []
            for i, w in enumerate(ws):
                layer = jnp.int32(i)
                a = LayerStack(a_stack, layer)
                bs = tuple(LayerStack(b, layer) for b in b_stacks)
                out.append(
                    backend.apply_packed(
                        x, a, bs, meta, x @ w, tp_size=1, input_sharded=row_parallel, output_sharded=not row_parallel
                    )
                )
            return out

        return jax.jit(lora_fn)

    reference = None
    for name in backends:
        backend = make_lora_backend(name)
        fn = lora_fn_for(backend)
        row["ratio"][name] = time_fn(fn, (x, ws, a_stack, b_stacks, lora), args.min_seconds) / t_base
        if name == "bgmv":
            reference = np.asarray(fn(x, ws, a_stack, b_stacks, lora)[-1], np.float32)
    for variant in variants:
        try:
            with use_variant(VARIANTS[variant]):
                fn = lora_fn_for(make_lora_backend("pallas"))
                y = np.asarray(fn(x, ws, a_stack, b_stacks, lora)[-1], np.float32)
            if reference is not None:
                err = float(np.abs(y - reference).max() / max(np.abs(reference).max(), 1e-6))
                if err > 2e-2:
                    row["errors"][variant] = f"max rel diff {err:.3g} vs bgmv"
            row["ratio"]["pallas:" + variant] = time_fn(fn, (x, ws, a_stack, b_stacks, lora), args.min_seconds) / t_base
        except Exception as err:  # noqa: BLE001 - a failed variant is reported, the sweep goes on
            row["errors"][variant] = f"{type(err).__name__}: {str(err)[:200]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", choices=tuple(ROWS), nargs="+", default=["decode"])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--backends", default="bgmv")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--min-seconds", type=float, default=0.1)
    parser.add_argument("--time-budget", type=float, default=400.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    deadline = time.perf_counter() + args.time_budget
    variants = [v for v in args.variants.split(",") if v]
    backends = [b for b in args.backends.split(",") if b]
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    results = []
    for group in args.rows:
        for module, rank, num_tokens, num_adapters, *adapter_rows in ROWS[group]:
            if time.perf_counter() > deadline:
                print(f"not run (time budget): {module} r{rank} T={num_tokens} n={num_adapters}", flush=True)
                continue
            row = run_row(module, rank, num_tokens, num_adapters, args, variants, backends, *adapter_rows)
            results.append(row)
            cells = " ".join(f"{k}={v:.2f}" for k, v in row["ratio"].items())
            print(
                f"{module} r{rank} T={num_tokens} n={row['distinct']} base {row['t_base_us']:.1f}us "
                f"limit {row['limit']:.2f}: {cells} {row['errors'] or ''}",
                flush=True,
            )
            if args.json:
                args.json.write_text(
                    json.dumps(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, rows=results), indent=1)
                )


if __name__ == "__main__":
    main()

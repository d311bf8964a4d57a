"""The base GEMM kernel without LoRA (pallas_kernels/sgmv/gemm_gpu.py) against XLA's GEMM, per Llama-3-8B module.

For each module and token count T it builds an [L, in, out] weight stack, as the model holds the layers' weights,
jits `layers` layers each computing x @ W[layer] (the layer index constant, as in the engine's unrolled layer loop),
and times, side by side in one process:

- `xla`: `x @ w[layer]`, what the engine runs with `--gpu-gemm-min-tokens 0` (XLA may copy the layer's W first);
- `kernel`: `gemm_gpu(x, w, layer)`, which reads the layer's rows of the stack in place, its K loop split as
  `default_k_splits` picks for the GPU's SMs (what the engine runs from `--gpu-gemm-min-tokens`);
- `unsplit`: the same kernel with one K loop per tile (`k_splits=1`), where the kernel splits;
- `whole`: the same kernel with every tile whole (`tail_split=False`), where it cuts the last partial wave's tiles
  in pieces of K (`default_tail_split`).

With `--gated`, the gate|up rows also time the activation after the GEMM: `unfused`, the kernel's [T, 2I] product
then XLA's silu(gate) * up (what runs with an adapter on the module), against `gated`, the kernel with the
activation in its epilogue (`gemm_gpu(..., gated=True)`, what a step without adapters runs), and their largest
difference.

A token count may name its real rows, `T:R` (a decode step of R rows in the T bucket: the kernel runs only the row
tiles that hold them, and the tail split's pieces follow from them).

It also reports the largest absolute difference between the two outputs of the last layer. `--tilings` adds, per
row, the kernel with other CTA tiles: `WxK` is W columns per consumer warpgroup (`tile_n`: 128 is the default
256-column CTA tile, 64 a 128-column one; the deepest pipeline that fits shared memory) and K parts of the K loop.
Needs a Hopper GPU; `--reference` times the kernel's pure-JAX reference instead (a smoke run anywhere).

Usage: python scripts/bench_gemm.py --json out.json [--tokens 128,256,512,1024:751,2048] [--modules qkv,o]
    [--tilings 64x1,64x2] [--gated]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.sgmv.gemm_fp8_gpu import gemm_fp8_gpu  # noqa: E402
from pallas_kernels.sgmv.gemm_gpu import default_k_splits, default_tail_split, gemm_gpu  # noqa: E402
from pallas_kernels.sgmv.gemm_lora_gpu import GemmLoraTiles, choose_gemm_lora_tiles, silu_and_mul  # noqa: E402
from scripts.bench_lora_kernels import time_fn  # noqa: E402
from sgl_jax_lora.layers.fp8 import quantize_activation, quantize_weight  # noqa: E402

# Llama-3-8B modules: in, packed out
MODULES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def parse_tilings(text: str) -> list[tuple[int, int]]:
    """ "64x1,64x2" -> [(tile_n, k_splits), ...]; tile_n 64 or 128, k_splits 1, 2, 4 or 8."""
    tilings = []
    for item in filter(None, text.split(",")):
        try:
            tile_n, k_splits = (int(part) for part in item.split("x"))
        except ValueError:
            raise ValueError(f"tiling {item!r}: write WxK, e.g. 64x2 (tile_n 64, the K loop in 2 parts)") from None
        if tile_n not in (64, 128) or k_splits not in (1, 2, 4, 8):
            raise ValueError(f"tiling {item!r}: tile_n must be 64 or 128 and the K parts 1, 2, 4 or 8")
        tilings.append((tile_n, k_splits))
    return tilings


def tiles_for(tile_n: int, k_splits: int) -> GemmLoraTiles:
    """The deepest pipeline (up to 6 stages) of these tiles that fits shared memory; float32 stores with K parts."""
    return choose_gemm_lora_tiles(0, out_itemsize=4 if k_splits > 1 else 2, tile_n=tile_n, max_stages=6)


def measure_row(
    module: str,
    in_dim: int,
    out_dim: int,
    num_tokens: int,
    layers: int,
    min_seconds: float,
    reference: bool = False,
    tilings: tuple[tuple[int, int], ...] = (),
    fp8: bool = False,
    num_rows: int | None = None,
    gated: bool = False,
) -> dict:
    """Times both programs (and the kernel with each of `tilings`, and with `fp8` the 8-bit kernel) over one
    [layers, in, out] stack; microseconds per layer."""
    w = jax.jit(
        lambda: (jax.random.normal(jax.random.key(0), (layers, in_dim, out_dim), jnp.float32) * 0.02).astype(
            jnp.bfloat16
        )
    )()
    x = jax.random.normal(jax.random.key(1), (num_tokens, in_dim), jnp.float32).astype(jnp.bfloat16)
    rows = jnp.full((1,), num_tokens if num_rows is None else num_rows, jnp.int32)
    if num_rows is not None:  # the bucket's padding rows are zero, as the engine pads
        x = jnp.where(jnp.arange(num_tokens)[:, None] < num_rows, x, 0).astype(x.dtype)
    xla = jax.jit(lambda x, w: [x @ w[layer] for layer in range(layers)])

    def kernel_layers(**kwargs):
        return jax.jit(lambda x, w: [gemm_gpu(x, w, jnp.int32(layer), rows, **kwargs) for layer in range(layers)])

    kernel = kernel_layers(reference=reference)
    xla_us = time_fn(xla, (x, w), min_seconds) / layers * 1e6
    kernel_us = time_fn(kernel, (x, w), min_seconds) / layers * 1e6
    k_splits = 1 if reference else default_k_splits(num_tokens, in_dim, out_dim)
    tail_split = not reference and default_tail_split(num_tokens, in_dim, out_dim, k_splits)
    unsplit_us = whole_us = None
    if k_splits > 1:
        unsplit_us = time_fn(kernel_layers(k_splits=1), (x, w), min_seconds) / layers * 1e6
    if tail_split:
        whole_us = time_fn(kernel_layers(tail_split=False), (x, w), min_seconds) / layers * 1e6
    diff = jnp.abs(kernel(x, w)[-1].astype(jnp.float32) - xla(x, w)[-1].astype(jnp.float32))
    tiled_us = {}
    for tile_n, parts in tilings:
        tiles = tiles_for(tile_n, parts)
        tiled = jax.jit(
            lambda x, w, tiles=tiles, parts=parts: [
                gemm_gpu(x, w, jnp.int32(layer), tiles=tiles, k_splits=parts, reference=reference)
                for layer in range(layers)
            ]
        )
        tiled_us[f"{tile_n}x{parts}"] = time_fn(tiled, (x, w), min_seconds) / layers * 1e6
    fp8_row = measure_fp8(x, w, layers, min_seconds, reference, xla(x, w)[-1]) if fp8 else {}
    gated_row = {}
    if gated and module == "gate_up":
        unfused = jax.jit(lambda x, w: [silu_and_mul(y) for y in kernel(x, w)])
        fused = kernel_layers(gated=True, reference=reference)
        gated_diff = jnp.abs(fused(x, w)[-1].astype(jnp.float32) - unfused(x, w)[-1].astype(jnp.float32))
        gated_row = dict(
            unfused_us=time_fn(unfused, (x, w), min_seconds) / layers * 1e6,
            gated_us=time_fn(fused, (x, w), min_seconds) / layers * 1e6,
            gated_max_abs_diff=float(jnp.max(gated_diff[: rows[0]])),
        )
    return dict(
        **fp8_row,
        **gated_row,
        module=module,
        in_dim=in_dim,
        out_dim=out_dim,
        tokens=num_tokens,
        rows=num_tokens if num_rows is None else num_rows,
        layers=layers,
        xla_us=xla_us,
        kernel_us=kernel_us,
        k_splits=k_splits,
        unsplit_us=unsplit_us,
        tail_split=tail_split,
        whole_us=whole_us,
        ratio=kernel_us / xla_us,
        max_abs_diff=float(jnp.max(diff)),
        tilings_us=tiled_us,
    )


def measure_fp8(x: jax.Array, w: jax.Array, layers: int, min_seconds: float, reference: bool, want: jax.Array) -> dict:
    """The 8-bit kernel (pallas_kernels/sgmv/gemm_fp8_gpu.py) on the same stack quantized as `--quantization fp8`
    loads it (layers/fp8.py): `fp8_us` with x quantized once outside, `fp8_quant_us` quantizing x in every layer as
    the engine does; `fp8_rel_err`: the last layer's output against XLA's bf16 product, relative (max-norm)."""
    wq, w_scale = jax.jit(quantize_weight)(w)
    xq, x_scale = jax.jit(quantize_activation)(x)

    def gemm(xq, x_scale, wq, w_scale, layer):
        return gemm_fp8_gpu(xq, wq, x_scale * w_scale[layer], jnp.int32(layer), reference=reference)

    def quantized(x, wq, w_scale):
        return [gemm(*quantize_activation(x), wq, w_scale, layer) for layer in range(layers)]

    kernel = jax.jit(lambda xq, x_scale, wq, w_scale: [gemm(xq, x_scale, wq, w_scale, i) for i in range(layers)])
    fp8_us = time_fn(kernel, (xq, x_scale, wq, w_scale), min_seconds) / layers * 1e6
    fp8_quant_us = time_fn(jax.jit(quantized), (x, wq, w_scale), min_seconds) / layers * 1e6
    last = jax.jit(quantized)(x, wq, w_scale)[-1].astype(jnp.float32)
    want = want.astype(jnp.float32)
    error = float(jnp.max(jnp.abs(last - want)) / jnp.max(jnp.abs(want)))
    return dict(fp8_us=fp8_us, fp8_quant_us=fp8_quant_us, fp8_rel_err=error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--tokens", default="128,256,512,1024,2048", help="comma-separated token counts T, or T:R (R real rows)"
    )
    parser.add_argument("--modules", default=",".join(MODULES), help=f"comma-separated, of {', '.join(MODULES)}")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--min-seconds", type=float, default=0.5, help="time per program (bench_lora_kernels.time_fn)")
    parser.add_argument("--reference", action="store_true", help="time the kernel's pure-JAX reference (no GPU)")
    parser.add_argument("--tilings", default="", help="comma-separated WxK: the kernel with tile_n W and K parts")
    parser.add_argument("--fp8", action="store_true", help="also time the 8-bit kernel of --quantization fp8")
    parser.add_argument("--gated", action="store_true", help="gate|up: also the activation, fused and after")
    args = parser.parse_args()
    tilings = tuple(parse_tilings(args.tilings))
    rows = []
    print(
        "| module | T (rows) | xla us/layer | kernel us/layer | K parts | unsplit us/layer | whole us/layer | "
        "kernel / xla | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for module in args.modules.split(","):
        in_dim, out_dim = MODULES[module]
        for spec in args.tokens.split(","):
            num_tokens, _, real = spec.partition(":")
            num_tokens, num_rows = int(num_tokens), int(real) if real else None
            row = measure_row(
                module,
                in_dim,
                out_dim,
                num_tokens,
                args.layers,
                args.min_seconds,
                args.reference,
                tilings,
                args.fp8,
                num_rows,
                args.gated,
            )
            unsplit_us, whole_us = row["unsplit_us"], row["whole_us"]
            rows.append(row)
            print(
                f"| {module} | {num_tokens} ({row['rows']}) | {row['xla_us']:.1f} | {row['kernel_us']:.1f} | "
                f"{row['k_splits']} | {'-' if unsplit_us is None else f'{unsplit_us:.1f}'} | "
                f"{'-' if whole_us is None else f'{whole_us:.1f}'} | {row['ratio']:.3f} | "
                f"{row['max_abs_diff']:.3g} |"
                + "".join(f" {name}: {us:.1f} |" for name, us in row["tilings_us"].items())
                + (
                    f" fp8: {row['fp8_us']:.1f}, quantizing x: {row['fp8_quant_us']:.1f} (rel err "
                    f"{row['fp8_rel_err']:.3f}) |"
                    if args.fp8
                    else ""
                )
                + (
                    f" unfused: {row['unfused_us']:.1f}, gated: {row['gated_us']:.1f} (max abs diff "
                    f"{row['gated_max_abs_diff']:.3g}) |"
                    if "gated_us" in row
                    else ""
                ),
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}))


if __name__ == "__main__":
    main()

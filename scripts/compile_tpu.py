"""Compile the engine's forward programs for a TPU slice from a host without a TPU, and say what each chip holds.

Where it sits: beside scripts/simulate_schedule.py (the scheduler without a device), for TPU configurations: the
engine flags after `--` (a preset of tpu_configs/ with --config, a model directory's config.json with --model-path;
no weights are read) go through `model_executor/tpu_aot.py`'s `compile_forward_programs`, which builds every program
the engine's warmup would compile (each token bucket, each LoRA segment bucket and the LoRA-free program) and has
libtpu compile it for `--topology` (XLA's TPU passes and Mosaic's passes over the attention and SGMV kernels). A kernel
Mosaic refuses, or a program past a chip's memory, fails here as it would on the slice's host. Needs libtpu (the test
extra installs it on Linux x86_64).

Prints one line per program (compile seconds, Mosaic kernels, per chip: arguments, scratch, code) and per chip: the
weights, the KV bytes a token, and the KV tokens that fit in --mem-fraction-static of the chip's HBM beside the weights,
every program's code (a TPU holds each loaded program in HBM) and the largest program's scratch. Speed on a TPU is not
measured: nothing runs.

Usage: python scripts/compile_tpu.py --topology v5e:2x2 [--kv-tokens 65536] [--json out.json] --
    --config tpu_configs/v5e-4.json --model-path DIR [engine flags]
       python scripts/compile_tpu.py --topology v5e:2x2 --llama3-8b -- --config tpu_configs/v5e-4.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_offline import LLAMA3_8B, make_model_dir  # noqa: E402
from scripts.simulate_schedule import split_engine_flags  # noqa: E402
from sgl_jax_lora.launch import parse_args  # noqa: E402
from sgl_jax_lora.model_executor.tpu_aot import GIB, CompiledForward, compile_forward_programs  # noqa: E402


def main() -> None:
    own, engine_flags = split_engine_flags(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", required=True, help="the slice as libtpu names it: v5e:2x2, v6e:2x4, v4:2x2x1")
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=0,
        help="the KV cache the programs take (default: --max-total-tokens, else 64k)",
    )
    parser.add_argument(
        "--llama3-8b", action="store_true", help="compile for Llama-3-8B's shape (a config.json written here)"
    )
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(own)
    if opts.llama3_8b:
        engine_flags = ["--model-path", make_model_dir(LLAMA3_8B), *engine_flags]
    args = parse_args(engine_flags)
    kv_tokens = opts.kv_tokens or args.max_total_tokens or 65536
    num_kv_pages = -(-kv_tokens // args.page_size)
    print(f"{'S':>6} {'T':>6} {'LoRA segments':>13} {'compile s':>9} {'Mosaic':>6}  per chip GiB: args, temp, code")

    def show(p: CompiledForward) -> None:
        segments = "-" if p.lora_segments is None else str(p.lora_segments)
        sizes = ", ".join(f"{b / GIB:.3f}" for b in (p.argument_bytes, p.temp_bytes, p.code_bytes))
        print(f"{p.num_seqs:6d} {p.num_tokens:6d} {segments:>13} {p.compile_s:9.1f} {p.mosaic_kernels:6d}  {sizes}")

    start = time.perf_counter()
    report = compile_forward_programs(args, args.model_path, opts.topology, num_kv_pages, on_compiled=show)
    fit = report.kv_tokens_that_fit(args.mem_fraction_static)
    summary = {
        "topology": opts.topology,
        "device_kind": report.device_kind,
        "tp_size": args.tp_size,
        "programs": len(report.programs),
        "compile_s_total": time.perf_counter() - start,
        "hbm_gib_per_chip": None if report.hbm_bytes is None else report.hbm_bytes / GIB,
        "weights_gib_per_chip": report.weight_bytes / GIB,
        "kv_bytes_per_token_per_chip": report.kv_bytes_per_token,
        "largest_program_temp_gib": max(p.temp_bytes for p in report.programs) / GIB,
        "code_gib_all_programs": report.code_bytes / GIB,
        "mem_fraction_static": args.mem_fraction_static,
        "kv_tokens_that_fit": fit,
    }
    print(json.dumps(summary, indent=2))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(
                {**summary, "engine_flags": engine_flags, "programs": [dataclasses.asdict(p) for p in report.programs]},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()

"""The engine's forward under several tuning settings, each compiled ahead of time, timed alternately in one process.

    python scripts/ab_step.py --lora --cases decode:751x384@1024 decode:881x384@1024 \\
        --settings default fused=1024:1024 --rounds 4 --out ab.json

Between processes on one GPU a forward's time drifts by 1-5% (docs/benchmarks.md), more than most tuning choices
change it; inside one process every setting meets the same drift. One model as `bench_step.py` builds it (Llama-3-8B
shape, dummy bf16 weights, the engine's flags and XLA options, Pallas attention; with --lora its --num-adapters
adapters of rank 16 on the auto LoRA backend), its KV cache donated from call to call. A setting is `default`, or
KNOB=VALUE pairs joined by commas, each a choice the engine makes while it traces the forward, or `base`:
  base            with --lora, the same model's forward with no adapter batch: the base program of a LoRA-enabled
                  engine (its linears skip the LoRA path, its XLA options a LoRA-free forward's), for the ratio
                  of the adapters' forward to the base's
  fused=G:O       the Pallas GPU LoRA backend's thresholds for the GEMM with the LoRA inside it
                  (`PallasGPUBackend.takes_fused_gemm`): gate|up from G tokens, q|k|v, o and down from O (0: never)
  fused-qkv=Q     q|k|v alone takes that GEMM from Q tokens (0: never), the other modules as `fused` or the default
  decode-warps=W  warps a program of the decode attention kernel (`DecodeTiles.num_warps`)
  decode-keys=K   keys a loop step of that kernel (`DecodeTiles.block_kv`)
  gated-delta=D   1: gate|up's delta into the base GEMM kernel's gated epilogue below the fused GEMM's buckets, 0:
                  the packed product with the delta, then XLA's activation (`PallasGPUBackend.gated_delta`)
  entry-ring=T    the fused GEMM keeps a ring of LoRA entries in flight in buckets up to T tokens
                  (`PallasGPUBackend.ENTRY_RING_MAX_TOKENS`; mixed steps' decode rows hold many entries a row tile)
  shrink-first=S  1 (the default): column-parallel modules with a delta on the SGMV path run their shrink before the
                  base GEMM, the expand beside it (`PallasBackend.shrink_first`); 0: the GEMM and the shrink both on x
  tile16=T        the SGMV kernels take row tiles of 16 in buckets up to T tokens
                  (`pallas_kernels/sgmv/work_list.py` ROW_TILE_16_MAX_ROWS)
  skinny=T        the base GEMM kernel's buckets up to T tokens run its skinny form, the tokens as the WGMMA's N
                  side (`sgl_jax_lora/layers/base_gemm.py` SKINNY_MAX_TOKENS, in the default setting of one
                  Hopper GPU; 0: the tiled kernel in each of its buckets)
  xla-dots=T      forwards keep XLA's dots (cuBLAS GEMMs) in the base GEMM kernel's buckets up to T tokens
                  (`sgl_jax_lora/layers/base_gemm.py` XLA_DOTS_MAX_TOKENS, in the default setting of one Hopper GPU;
                  0: the kernel in each of its buckets, the skinny form up to its own bound)
  triton-gemm=G   0: XLA's own dots (the linears below the base GEMM kernel's buckets, the LM head) compiled as
                  cuBLAS GEMMs (the XLA option xla_gpu_enable_triton_gemm=false), 1: as XLA's Triton GEMM fusions
  decode-only=D   1: the cases' batches marked as steps of decode rows alone (`ForwardBatch.decode_only`, the program
                  the engine runs them in with --decode-step-programs on): the GPU attention leaves out its general
                  kernel; decode cases only. 0: the program of any mix (the default)
  mem-slop=P      the XLA option xla_gpu_memory_limit_slop_factor=P: the percent of the device memory left beside the
                  program's arguments that XLA's scheduler and rematerialization take as the program's limit (XLA's
                  default 95; the engine's forward 100000, `compiler_options.MEMORY_LIMIT_SLOP`)
Each (case, setting) is compiled and run once; then each of --rounds rounds runs --repeats timed calls of every
(case, setting), the cases and the settings in the given order in even rounds and reversed in odd ones. A row gives
each setting's median of its rounds' medians, each round's median, and its output's largest difference from the
first setting of its kind's (`compared_with`: the settings with adapters compute the same forward up to rounding, and
so do `base` settings; a difference past rounding is a setting that computes something else).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pallas_kernels.attention.gpu as attention_gpu  # noqa: E402
import pallas_kernels.sgmv.work_list as work_list  # noqa: E402
import sgl_jax_lora.layers.base_gemm as base_gemm  # noqa: E402
from scripts.bench_offline import LLAMA3_8B, make_model_dir  # noqa: E402
from scripts.bench_step import build, engine_args  # noqa: E402
from scripts.step_cases import cache_pages, case_batch, lora_batches, parse_case  # noqa: E402
from sgl_jax_lora.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax_lora.lora.backend.auto import AutoBackend  # noqa: E402
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend  # noqa: E402
from sgl_jax_lora.model_executor.compiler_options import forward_compiler_options, takes_cublas_gemms  # noqa: E402

KNOBS = (
    "fused",
    "decode-warps",
    "decode-keys",
    "gated-delta",
    "entry-ring",
    "tile16",
    "skinny",
    "xla-dots",
    "shrink-first",
    "triton-gemm",
    "fused-qkv",
    "mem-slop",
    "decode-only",
)
BINARY_KNOBS = ("gated-delta", "shrink-first", "triton-gemm", "decode-only")
BACKEND_KNOBS = ("fused", "gated-delta", "entry-ring", "shrink-first", "fused-qkv")  # set on the Pallas GPU backend


def parse_setting(text: str) -> dict:
    """'default' -> {}; 'base' -> {'base': True}; 'fused=1024:2048,decode-warps=4' -> {'fused': (1024, 2048),
    'decode-warps': 4}."""
    if text in ("default", "base"):
        return {"base": True} if text == "base" else {}
    setting = {}
    for part in text.split(","):
        if part == "base" and "base" not in setting:  # the base program under the knobs that follow
            setting["base"] = True
            continue
        knob, _, value = part.partition("=")
        try:
            numbers = tuple(int(v) for v in value.split(":"))
        except ValueError:
            numbers = ()
        fits = knob in KNOBS and len(numbers) == (2 if knob == "fused" else 1) and min(numbers, default=-1) >= 0
        if not fits or (knob in BINARY_KNOBS and numbers[0] > 1) or knob in setting:
            raise SystemExit(
                f"setting {text!r}: expected 'default', 'base' or KNOB=VALUE pairs joined by commas, each knob once: "
                "fused=G:O, decode-warps=W, decode-keys=K, entry-ring=T, tile16=T, skinny=T, xla-dots=T, fused-qkv=Q, "
                "mem-slop=P (non-negative integers), "
                "gated-delta=0|1, shrink-first=0|1, triton-gemm=0|1, decode-only=0|1"
            )
        setting[knob] = numbers if knob == "fused" else numbers[0]
    return setting


def qkv_threshold(takes_fused_gemm, least: int):
    """`takes_fused_gemm` with q|k|v (the column-parallel module of three parts) taking the fused GEMM from `least`
    tokens (0: never)."""

    def takes(num_tokens: int, num_parts: int, row_parallel: bool) -> bool:
        if num_parts == 3 and not row_parallel:
            return 0 < least <= num_tokens
        return takes_fused_gemm(num_tokens, num_parts, row_parallel)

    return takes


@contextlib.contextmanager
def applied(setting: dict, lora_backend):
    """The setting in force while the forward is traced: the fused-GEMM thresholds (q|k|v's own with fused-qkv), the
    gated-delta and shrink-first choices and the entry ring's bucket on the model's Pallas GPU backend, the SGMV
    kernels' row tiles, the skinny GEMM's buckets, those where forwards without adapters keep XLA's dots, the decode
    tiles as the attention layer's kernel call takes them; all as they were afterwards. Yields the list of the tiles
    each traced call of the GPU attention kernel took (empty without a decode knob). The XLA knobs act on the compile
    options instead (`setting_compiler_options`)."""
    pallas = lora_backend.backends["pallas"] if isinstance(lora_backend, AutoBackend) else lora_backend
    kernel = attention_gpu.ragged_paged_attention_gpu
    attributes = (
        "fused_gemm_min_tokens",
        "fused_gemm_other_min_tokens",
        "gated_delta",
        "ENTRY_RING_MAX_TOKENS",
        "shrink_first",
        "takes_fused_gemm",
    )
    saved = {name: pallas.__dict__[name] for name in attributes if name in pallas.__dict__} if pallas else None
    traced = []
    row_tile_16, skinny_max = work_list.ROW_TILE_16_MAX_ROWS, base_gemm.SKINNY_MAX_TOKENS
    xla_dots_max = base_gemm.XLA_DOTS_MAX_TOKENS
    try:
        knobs = [knob for knob in BACKEND_KNOBS if knob in setting]
        if knobs and not isinstance(pallas, PallasGPUBackend):
            raise SystemExit(f"the {knobs[0]} knob needs --lora (the auto backend's Pallas GPU backend)")
        if "fused" in setting:
            pallas.fused_gemm_min_tokens, pallas.fused_gemm_other_min_tokens = setting["fused"]
        if "gated-delta" in setting:
            pallas.gated_delta = bool(setting["gated-delta"])
        if "entry-ring" in setting:
            pallas.ENTRY_RING_MAX_TOKENS = setting["entry-ring"]
        if "shrink-first" in setting:
            pallas.shrink_first = bool(setting["shrink-first"])
        if "fused-qkv" in setting:
            pallas.takes_fused_gemm = qkv_threshold(pallas.takes_fused_gemm, setting["fused-qkv"])
        if "tile16" in setting:
            work_list.ROW_TILE_16_MAX_ROWS = setting["tile16"]
        if "skinny" in setting:
            base_gemm.SKINNY_MAX_TOKENS = setting["skinny"]
        if "xla-dots" in setting:
            base_gemm.XLA_DOTS_MAX_TOKENS = setting["xla-dots"]
        if "decode-warps" in setting or "decode-keys" in setting:
            tiles = attention_gpu.DecodeTiles(setting.get("decode-keys", 0), 0, setting.get("decode-warps", 0))

            def with_tiles(*args, **kwargs):
                traced.append(tiles)
                return kernel(*args, decode_tiles=tiles, **kwargs)

            attention_gpu.ragged_paged_attention_gpu = with_tiles
        yield traced
    finally:
        attention_gpu.ragged_paged_attention_gpu = kernel
        work_list.ROW_TILE_16_MAX_ROWS, base_gemm.SKINNY_MAX_TOKENS = row_tile_16, skinny_max
        base_gemm.XLA_DOTS_MAX_TOKENS = xla_dots_max
        if saved is not None:  # the backend's own attributes back, a class default where it had none
            for name in attributes:
                pallas.__dict__.pop(name, None)
            pallas.__dict__.update(saved)


def setting_batches(settings: list[dict], batches: list, base_batches: list) -> list[list]:
    """Each setting's batch of each case: the base batches (no adapter batch) for `base`, which needs --lora; marked
    decode-only for `decode-only=1`, which needs decode cases."""
    if any(s.get("base") for s in settings) and batches is base_batches:
        raise SystemExit("the base setting needs --lora (it is the LoRA-enabled model's forward without adapters)")
    chosen = [base_batches if setting.get("base") else batches for setting in settings]
    for index, setting in enumerate(settings):
        if setting.get("decode-only"):
            if any(int(np.max(np.diff(np.asarray(b.cu_q_lens)))) > 1 for b in chosen[index]):
                raise SystemExit("decode-only=1 needs decode cases only (a sequence of one query token each)")
            chosen[index] = [dataclasses.replace(b, decode_only=True) for b in chosen[index]]
    return chosen


def compared_with(settings: list[dict]) -> list[int]:
    """The setting each one's output is checked against: the first setting with the same `base` choice."""
    kinds = [bool(setting.get("base")) for setting in settings]
    return [kinds.index(kind) for kind in kinds]


def setting_compiler_options(setting: dict, platform: str, batch, base_gemm) -> dict | None:
    """The XLA options the engine compiles the setting's forward of `batch` with (`forward_compiler_options`, XLA's
    dots as cuBLAS GEMMs where `takes_cublas_gemms` says so for the model's `base_gemm`: a `base` setting's batches
    have no adapters), with the setting's choice of XLA's GEMMs and memory limit where it makes one."""
    cublas = takes_cublas_gemms(batch, base_gemm)
    options = dict(forward_compiler_options(platform, False, cublas_gemms=cublas) or {})
    if "triton-gemm" in setting:
        options["xla_gpu_enable_triton_gemm"] = bool(setting["triton-gemm"])
    if "mem-slop" in setting:
        options["xla_gpu_memory_limit_slop_factor"] = setting["mem-slop"]
    return options or None


def compile_settings(model, settings: list[dict], batches: list[list]) -> dict:
    """(case, setting) -> the forward of batches[setting][case] compiled ahead of time with the setting in force (a
    fresh jit each, so that no trace is shared between settings)."""
    compiled = {}
    lora_backend = model.lora.backend if model.lora else None
    for index, setting in enumerate(settings):
        with applied(setting, lora_backend) as traced:
            for case, batch in enumerate(batches[index]):
                options = setting_compiler_options(setting, jax.default_backend(), batch, model.base_gemm)
                forward = jax.jit(lambda *a: model.step(*a), donate_argnums=1, compiler_options=options)
                compiled[case, index] = forward.lower(model.state, model.kv, batch).compile()
        decode_knob = "decode-warps" in setting or "decode-keys" in setting
        if decode_knob and not traced and jax.default_backend() in ("gpu", "cuda"):
            raise SystemExit(f"setting {setting}: the forward never called the GPU attention kernel it sets")
    return compiled


def alternate(run, num_cases: int, num_settings: int, repeats: int, rounds: int) -> dict:
    """(case, setting) -> each round's median seconds of `repeats` calls of run(case, setting), after one untimed
    call (the switch from the program before), the cases and the settings in order in even rounds and reversed in odd
    ones."""
    times = {(c, s): [] for c in range(num_cases) for s in range(num_settings)}
    for round_index in range(rounds):
        step = 1 if round_index % 2 == 0 else -1
        for case in list(range(num_cases))[::step]:
            for setting in list(range(num_settings))[::step]:
                run(case, setting)
                calls = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    run(case, setting)
                    calls.append(time.perf_counter() - start)
                times[case, setting].append(statistics.median(calls))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cases", nargs="+", required=True, help="step_cases.py's: decode:SxC[@B], prefill:SxN, mixed:SxC+PxN[@B]"
    )
    parser.add_argument("--settings", nargs="+", default=["default"], help="'default' or KNOB=VALUE[,KNOB=VALUE]")
    parser.add_argument("--lora", action="store_true", help="the model with --num-adapters adapters, one a sequence")
    parser.add_argument("--num-adapters", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls of a (case, setting) in each round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    cases = [parse_case(c) for c in opts.cases]
    settings = [parse_setting(s) for s in opts.settings]  # a bad setting stops the run before any model is built
    cfg = ModelConfig.from_model_path(make_model_dir({**LLAMA3_8B, "num_hidden_layers": opts.num_layers}))
    flags = argparse.Namespace(
        gpu_gemm_min_tokens=None, lora_fused_gemm_min_tokens=None, disable_gpu_concurrent_kernels=False
    )
    max_pages, num_pages = cache_pages(cases)
    model = build(
        cfg, engine_args(cfg, "pallas", "auto" if opts.lora else None, flags), opts.lora, num_pages, opts.num_adapters
    )
    lora = lora_batches(opts.num_adapters + 1) if opts.lora else None
    base_batches = [jax.device_put(case_batch(case, max_pages, None)[0]) for case in cases]
    batches = [jax.device_put(case_batch(case, max_pages, lora)[0]) for case in cases] if lora else base_batches
    batches = setting_batches(settings, batches, base_batches)
    compiled = compile_settings(model, settings, batches)
    kv = model.kv

    def run(case: int, setting: int) -> jax.Array:
        nonlocal kv  # donated: each call takes the cache the call before returned
        out, kv = compiled[case, setting](model.state, kv, batches[setting][case])
        return out.block_until_ready()

    first_outputs = {key: np.asarray(run(*key), np.float32) for key in compiled}
    times = alternate(run, len(cases), len(settings), opts.repeats, opts.rounds)
    rows, references = [], compared_with(settings)
    for case, text in enumerate(opts.cases):
        row = {"case": text}
        for index, name in enumerate(opts.settings):
            rounds_ms = [t * 1e3 for t in times[case, index]]
            difference = np.abs(first_outputs[case, index] - first_outputs[case, references[index]]).max()
            row[name] = {
                "ms": statistics.median(rounds_ms),
                "round_ms": rounds_ms,
                "max_diff": float(difference),
                "compared_with": opts.settings[references[index]],
            }
        rows.append(row)
        print(text, "  ".join(f"{name} {row[name]['ms']:.3f} ms" for name in opts.settings), flush=True)
    if opts.out:
        info = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "argv": sys.argv[1:]}
        with open(opts.out, "w") as f:
            json.dump({**info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

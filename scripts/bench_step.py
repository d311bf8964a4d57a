"""One model step against its physical floor: decode and prefill forwards of a Llama-3-8B-shaped model (dummy bf16
weights) timed per attention backend, and with LoRA adapters (32 by default), side by side in one process.

    python scripts/bench_step.py --variants native pallas pallas+lora --cases decode:64x512 decode:256x512 \\
        prefill:8x256 --num-layers 32 --out step.json

Each variant builds the model once (`native` / `pallas`: --attention-backend; `+lora`: --num-adapters adapters (32)
of rank 16 on all 7 projections, one device slot each beside the base's, the auto LoRA backend, or the one
`+lora=NAME` names (a --lora-backend choice); each sequence one adapter, as the engine batches them: a prompt's
tokens share their adapter, and decode rows are grouped by adapter, as the scheduler orders a decode step), then
runs each case (scripts/step_cases.py: decode:SxC[@B], prefill:SxN, mixed:SxC+PxN[@B]):
  decode:SxC   S sequences of context C, one new token each (the engine's decode step: bucket S tokens)
  decode:SxC@B the same S rows padded to a bucket of B tokens and B sequences, as the engine pads a step of S decode
               rows (padding tokens write slot 0, padding sequences hold no tokens)
  prefill:SxN  S prompts of N new tokens each, no cached prefix (one step of S * N tokens)
  mixed:SxC+PxN[@B]  S decode rows of context C, then P prompts of N new tokens (the engine's mixed step)
Timing: each case's program is compiled and run once, then --rounds rounds run every case's --repeats calls in
turn, in the given order in even rounds and reversed in odd ones, so a drift of the device's speed (clocks, heat)
over the run weighs on every case alike; with one round (the default) the cases run one after the other.
Reported per case: the forward's median time over all its timed calls and each round's median (`round_ms`; the
engine's step adds logits and sampling to the forward), the HBM floor (weights but the embedding table, plus the
K/V read, at --hbm-tb-s) and the ratio to it, and the FLOP rate (2 per weight per token for the linears; 4 *
head_dim per causal query-key pair and head for attention) as a share of --peak-tflops. The forward is the engine's
program: the model ModelRunner builds from the engine's flags (`load_engine_model`: layers unrolled, the base GEMM
kernel from --gpu-gemm-min-tokens tokens on one Hopper GPU and XLA's dot below, every flag not passed here at its
default), KV donated, and the engine's XLA options (`forward_compiler_options`: on a GPU concurrent kernel
scheduling, off with --disable-gpu-concurrent-kernels, and cuBLAS's GEMMs for XLA's dots where the engine takes them:
the variants without adapters, and with adapters the base GEMM kernel's buckets that keep XLA's dots).
--out is rewritten after every round, so a run stopped by a time limit keeps the rounds it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_offline import LLAMA3_8B, make_model_dir  # noqa: E402
from scripts.step_cases import (  # noqa: E402
    MAX_PREFILL_SEQS,
    PAGE_SIZE,
    RANK,
    StepCase,
    cache_pages,
    case_batch,
    lora_batches,
    parse_case,
)
from sgl_jax_lora.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax_lora.layers.base_gemm import BaseGemm  # noqa: E402
from sgl_jax_lora.layers.sharding import make_mesh  # noqa: E402
from sgl_jax_lora.lora.backend.base import make_lora_backend  # noqa: E402
from sgl_jax_lora.lora.lora_linear import LoRAModelSpec  # noqa: E402
from sgl_jax_lora.lora.target_shapes import LORA_TARGETS  # noqa: E402
from sgl_jax_lora.mem_cache.kv_cache import KVCache, allocate_kv_cache, kv_cache_dtype  # noqa: E402
from sgl_jax_lora.model_executor.compiler_options import forward_compiler_options, takes_cublas_gemms  # noqa: E402
from sgl_jax_lora.model_executor.model_runner import load_engine_model  # noqa: E402
from sgl_jax_lora.server_args import LORA_BACKENDS, ServerArgs  # noqa: E402


def parse_variant(text: str) -> tuple[str, str | None]:
    """'pallas', 'pallas+lora' or 'pallas+lora=bgmv' -> (attention backend, LoRA backend or None)."""
    attention, _, lora = text.partition("+")
    kind, _, lora_backend = lora.partition("=")
    if attention not in ("native", "pallas") or kind not in ("", "lora") or (lora_backend and not kind):
        raise SystemExit(f"variant {text!r}: expected native or pallas, then optionally +lora or +lora=BACKEND")
    if lora_backend and lora_backend not in LORA_BACKENDS:
        raise SystemExit(f"variant {text!r}: the LoRA backend must be one of {LORA_BACKENDS}")
    return attention, (lora_backend or "auto") if kind else None


def engine_args(cfg: ModelConfig, backend: str, lora_backend: str | None, opts) -> ServerArgs:
    """The engine's flags a variant's forward is built and compiled with: its attention backend (native or pallas)
    and LoRA backend, and the engine flags this script passes on (--gpu-gemm-min-tokens, --lora-fused-gemm-min-tokens,
    --disable-gpu-concurrent-kernels); every other flag the engine's default."""
    return ServerArgs(
        model_path=cfg.model_path,
        load_format="dummy",
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        max_prefill_seqs=MAX_PREFILL_SEQS,
        attention_backend=backend,
        lora_backend=lora_backend or "auto",
        gpu_gemm_min_tokens=opts.gpu_gemm_min_tokens,
        lora_fused_gemm_min_tokens=opts.lora_fused_gemm_min_tokens,
        disable_gpu_concurrent_kernels=opts.disable_gpu_concurrent_kernels,
    )


class BuiltModel(NamedTuple):
    state: nnx.State
    kv: KVCache
    forward: Callable  # jitted (state, kv, batch) -> (the last tokens' hidden states, kv), kv donated
    step: Callable  # the same function unjitted, for callers that compile variants of it (scripts/ab_step.py)
    lora: LoRAModelSpec | None  # with_lora: the adapters' slots and the backend object the model holds
    base_gemm: BaseGemm | None  # the model's base GEMM setting (`takes_cublas_gemms` picks a batch's XLA options by it)


def build(cfg: ModelConfig, args: ServerArgs, with_lora: bool, num_pages: int, num_adapters: int) -> BuiltModel:
    """The model of one variant as the engine builds it from `args` (`load_engine_model`), with num_adapters + 1
    device slots of args.lora_backend when with_lora, its KV cache in the engine's dtype and its forward compiled with
    the engine's XLA options for the mesh's platform, as ModelRunner compiles its own."""
    mesh = make_mesh(1)
    spec = None
    if with_lora:
        spec = LoRAModelSpec(
            num_slots=num_adapters + 1,
            max_rank=RANK,
            backend=make_lora_backend(args.lora_backend, mesh, args.lora_fused_gemm_min_tokens),
            target_modules=frozenset(LORA_TARGETS),
        )
    graphdef, state = load_engine_model(args, cfg, mesh, spec)
    if spec is not None:  # random adapters in slots 1..N, slot 0 (base) stays zero
        keys = iter(jax.random.split(jax.random.key(1), 64))
        state = jax.tree_util.tree_map_with_path(
            lambda path, x: (
                (jax.random.normal(next(keys), x.shape, x.dtype) * 0.01).at[:, 0].set(0)
                if "lora_" in jax.tree_util.keystr(path)
                else x
            ),
            state,
        )
    kv = allocate_kv_cache(
        cfg, num_pages, PAGE_SIZE, 1, kv_cache_dtype(args.kv_cache_dtype, jnp.dtype(args.dtype)), mesh
    )

    def forward(state, kv, batch):
        hidden, kv = nnx.merge(graphdef, state)(kv, batch)
        return hidden[batch.last_token_index], kv

    platform, base_gemm = mesh.devices.flat[0].platform, nnx.merge(graphdef, state).base_gemm  # the model's setting
    programs = {
        cublas: jax.jit(
            forward,
            donate_argnums=1,
            compiler_options=forward_compiler_options(
                platform, args.disable_gpu_concurrent_kernels, cublas_gemms=cublas
            ),
        )
        for cublas in (False, True)
    }

    def jitted(state, kv, batch):  # the program the engine would run the batch in (ForwardPrograms)
        return programs[takes_cublas_gemms(batch, base_gemm)](state, kv, batch)

    return BuiltModel(state, kv, jitted, forward, spec, base_gemm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["native", "pallas", "pallas+lora"])
    parser.add_argument("--cases", nargs="+", default=["decode:64x512", "decode:256x512", "prefill:8x256"])
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of a case in each round")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds over the cases, the order reversed every other round"
    )
    parser.add_argument("--hbm-tb-s", type=float, default=3.35, help="3.35 for H100 SXM, 4.8 for H200")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 GEMM peak of the GPU")
    parser.add_argument("--num-adapters", type=int, default=32, help="adapters of the +lora variants, one slot each")
    parser.add_argument(
        "--lora-fused-gemm-min-tokens",
        type=int,
        default=None,
        help="the engine's flag: the least token bucket that runs the GEMM with the LoRA inside it (0: none)",
    )
    parser.add_argument(
        "--gpu-gemm-min-tokens",
        type=int,
        default=None,
        help="the engine's flag: the least token bucket whose layer linears run the base GEMM kernel (0: XLA's dot)",
    )
    parser.add_argument(
        "--disable-gpu-concurrent-kernels",
        action="store_true",
        help="the engine's flag: compile the forward with XLA's serialized kernel scheduling",
    )
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    cfg = ModelConfig.from_model_path(make_model_dir({**LLAMA3_8B, "num_hidden_layers": opts.num_layers}))
    cases = [parse_case(c) for c in opts.cases]
    variants = [parse_variant(v) for v in opts.variants]  # a bad name stops the run before any model is built
    rows: list[dict] = []
    for variant, (backend, lora_backend) in zip(opts.variants, variants):
        done = len(rows)
        for variant_rows in measure_variant(cfg, variant, backend, lora_backend, cases, opts):
            rows[done:] = variant_rows
            write_out(opts, rows)
        for row in rows[done:]:
            print(json.dumps(row), flush=True)


def measure_variant(
    cfg: ModelConfig, variant: str, backend: str, lora_backend: str | None, cases: list[StepCase], opts
):
    """Builds the variant's model, compiles and runs each case once, then times the cases over opts.rounds rounds
    (`time_cases`); after each round yields the variant's rows (`report`, with each round's median) so far."""
    max_pages, num_pages = cache_pages(cases)
    state, kv, forward, *_ = build(
        cfg, engine_args(cfg, backend, lora_backend, opts), lora_backend is not None, num_pages, opts.num_adapters
    )
    lora = lora_batches(opts.num_adapters + 1) if lora_backend else None
    prepared = []  # (case, batch, q_lens, kv_lens, compile_s)
    for case in cases:
        batch, q_lens, kv_lens = case_batch(case, max_pages, lora)
        batch = jax.device_put(batch)
        start = time.perf_counter()
        out, kv = forward(state, kv, batch)
        out.block_until_ready()
        prepared.append((case, batch, q_lens, kv_lens, time.perf_counter() - start))

    def run(index: int) -> None:
        nonlocal kv  # donated: each call takes the cache the call before returned
        out, kv = forward(state, kv, prepared[index][1])
        out.block_until_ready()

    for times in time_cases(run, len(prepared), opts.repeats, opts.rounds):
        rows = []
        for (case, _, q_lens, kv_lens, compile_s), rounds in zip(prepared, times):
            seconds = statistics.median(t for calls in rounds for t in calls)
            row = report(cfg, state, variant, case.text, q_lens, kv_lens, seconds, compile_s, opts)
            rows.append({**row, "round_ms": [statistics.median(calls) * 1e3 for calls in rounds]})
        yield rows


def round_order(num_cases: int, round_index: int) -> list[int]:
    """The cases of one round: in the given order in even rounds, reversed in odd ones."""
    order = list(range(num_cases))
    return order if round_index % 2 == 0 else order[::-1]


def time_cases(run: Callable[[int], None], num_cases: int, repeats: int, rounds: int):
    """Times `repeats` calls of run(case) for every case in each round (`round_order`); after each round yields
    times[case][round] -> the seconds of each call, for the rounds so far."""
    times: list[list[list[float]]] = [[] for _ in range(num_cases)]
    for round_index in range(rounds):
        for case in round_order(num_cases, round_index):
            calls = []
            for _ in range(repeats):
                start = time.perf_counter()
                run(case)
                calls.append(time.perf_counter() - start)
            times[case].append(calls)
        yield times


def write_out(opts, rows: list[dict]) -> None:
    if not opts.out:
        return
    with open(opts.out, "w") as f:
        json.dump(
            {
                "rows": rows,
                "jax": jax.__version__,
                "device": str(jax.devices()[0].device_kind),
                "num_layers": opts.num_layers,
                "num_adapters": opts.num_adapters,
                "lora_fused_gemm_min_tokens": opts.lora_fused_gemm_min_tokens,
                "gpu_gemm_min_tokens": opts.gpu_gemm_min_tokens,
                "disable_gpu_concurrent_kernels": opts.disable_gpu_concurrent_kernels,
                "repeats": opts.repeats,
                "rounds": opts.rounds,
            },
            f,
            indent=2,
        )


def report(cfg, state, variant, case_text, q_lens, kv_lens, seconds, compile_s, opts) -> dict:
    """One case's row: the HBM floor and FLOPs of its real sequences."""
    embed = cfg.vocab_size * cfg.hidden_size * 2
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(state) if x.dtype == jnp.bfloat16) - embed
    kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    kv_read = kv_token * sum(kv_lens)
    floor_s = (weights + kv_read) / (opts.hbm_tb_s * 1e12)
    tokens = sum(q_lens)
    pairs = sum(sum(range(k - q + 1, k + 1)) for q, k in zip(q_lens, kv_lens))
    flops = 2 * tokens * weights / 2 + 4 * pairs * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return {
        "variant": variant,
        "case": case_text,
        "tokens": tokens,
        "forward_ms": seconds * 1e3,
        "hbm_floor_ms": floor_s * 1e3,
        "ratio_to_floor": seconds / floor_s,
        "tflops": flops / seconds / 1e12,
        "share_of_peak": flops / seconds / 1e12 / opts.peak_tflops,
        "compile_s": compile_s,
    }


if __name__ == "__main__":
    main()

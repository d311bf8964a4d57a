"""Cost of a LoRA-wrapped linear vs the base GEMM, per LoRA backend (docs/benchmarks.md, "LoRA kernels").

For each (layer shape, rank, tokens T, distinct adapters n) it jits 16 unrolled layers with distinct
weights (so the base weights stream from HBM, as in a real model) twice: base only (y = x @ W) and
LoRA-wrapped (y = x @ W + the LoRA by `backend.apply_packed` with the metadata of `backend.prepare`, built once
per program as the engine does, the add fused where the backend can). The row's
ratio is t_lora / t_base, measured side by side. Tokens are spread over the n adapters round-robin and then
shuffled (so every adapter is present when T >= n); the slot pool holds max(8, n) adapters plus slot 0.

Printed beside each row: the limit (decode: memory-bound, (W bytes + bytes of the adapters present) / W
bytes; prefill T >= 2048: compute-bound, (base FLOPs + LoRA FLOPs) / base FLOPs) and the achieved HBM
bandwidth of the whole LoRA-wrapped layer (W + adapters present + x + y bytes over t_lora).

`--chain` feeds each layer's output to the next (square shapes only: q/o), so the program has a model's
dependencies; `--concurrent` compiles both functions with XLA's concurrent GPU kernel scheduling, as the
engine's forward is compiled on GPU, which then overlaps a LoRA shrink with its layer's base GEMM. Compare
the two only with `--chain`: with unchained layers concurrency would overlap whole layers, base GEMMs included.
`--residual` (with `--chain`) gives each layer the engine's row-parallel form (o, down): out = (res + delta(inp)) +
inp @ W, the LoRA delta added in place into the residual, so its kernels need not wait for the GEMM; the base
chain is res + inp @ W. Input and residual are two streams that alternate (layer i's residual is layer i-1's
input), so they are different arrays as in the model; `--residual same` makes them one array,
where the in-place add makes XLA copy x before each layer.

Timing: the median of back-to-back calls (host launch time included where the device does not hide it);
`--device-span` adds the ratio of device spans from a profiler trace (the program's cost on the device alone),
and `--compiles N` compiles every program N times separately and takes the median, since separate compiles of
one program differ by up to about 0.4 in decode ratios (docs/benchmarks.md, "Limits and what was not run").

Prefill rows here time the backends' `apply` on shuffled tokens; the engine's prefill on Hopper GPUs runs the
LoRA inside the base GEMM on sequences held together, which scripts/bench_gemm_lora.py times.

Usage: python scripts/bench_lora_kernels.py --grid full --json out.json
Uses the kernels and backends directly; builds no model.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sgl_jax_lora.lora.backend import make_lora_backend  # noqa: E402
from sgl_jax_lora.lora.lora_batch import build_lora_batch  # noqa: E402
from sgl_jax_lora.model_executor.compiler_options import CONCURRENT_GPU_KERNELS  # noqa: E402

SHAPES = {"qo": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
DECODE = [(t, n) for t in (1, 64, 256) for n in (1, 8, 32, 128)]
PREFILL = [(t, n) for t in (2048, 4096, 8192) for n in (4, 32)]
GOAL_ROWS = [("qo", 16, 64, 32), ("qo", 16, 256, 128), ("qo", 16, 4096, 32), ("qo", 64, 4096, 32)]
BACKENDS = ("einsum", "bgmv", "sgmv", "pallas")
BYTES = 2  # bf16
MAX_GATHER_BYTES = 4 << 30  # bgmv materializes T copies of the weights; skip rows beyond this


def grid(name: str) -> list[tuple[str, int, int, int]]:
    """(shape, rank, T, n) rows in run order: the decode and prefill goal rows first.

    'full' trims the protocol grid to fit one ~8 minute run: q/o gets every rank-16 scenario; gate_up and
    down get the three rank-16 goal-like scenarios (decode 64/32 and 256/128, prefill 4096/32); q/o rank 64
    gets decode T in {64, 256} x n in {8, 32, 128} and prefill 2048/32, 8192/32. Rows still pending when the
    time budget runs out are printed as not run.
    """
    if name == "goal":
        return list(GOAL_ROWS)
    if name == "decode":  # the 'full' rows with T <= 256
        return [row for row in grid("full") if row[2] <= 256]
    rows = list(GOAL_ROWS)
    rows += [("qo", 16, t, n) for t, n in DECODE + PREFILL]
    for shape in ("gate_up", "down"):
        rows += [(shape, 16, 64, 32), (shape, 16, 256, 128), (shape, 16, 4096, 32)]
    rows += [("qo", 64, t, n) for t in (64, 256) for n in (8, 32, 128)]
    rows += [("qo", 64, 2048, 32), ("qo", 64, 8192, 32)]
    seen, ordered = set(), []
    for row in rows:
        if row not in seen:
            seen.add(row)
            ordered.append(row)
    return ordered


def make_lora(
    num_tokens: int,
    num_adapters: int,
    num_slots: int,
    rank: int,
    seed: int,
    adapter_rows: int | None = None,
    num_segments: int | None = None,
):
    """A LoRABatch of num_tokens rows over num_adapters slots (1..n, round robin, shuffled). adapter_rows: only
    this many rows carry an adapter, the rest are the bucket's padding (slot 0, as the engine pads); num_segments:
    the segment bucket (default: n rounded up to a power of two, plus one for padding)."""
    rng = np.random.default_rng(seed)
    used = num_tokens if adapter_rows is None else adapter_rows
    token_slot = np.zeros(num_tokens, np.int32)
    token_slot[:used] = (1 + np.arange(used) % num_adapters)[rng.permutation(used)]
    ranks = np.full(num_slots, rank, np.int32)
    ranks[0] = 0
    scale = np.where(ranks > 0, 2.0, 0.0).astype(np.float32)
    if num_segments is None:
        num_segments = (1 << max(num_adapters - 1, 0).bit_length()) + (used < num_tokens)
    lora = build_lora_batch(token_slot, num_segments, scale, ranks)
    return jax.tree_util.tree_map(jnp.asarray, lora), len(np.unique(token_slot[token_slot > 0]))


def make_weights(key, num_layers, in_dim, out_dim, num_slots, rank):
    k_w, k_a, k_b = jax.random.split(key, 3)
    w = jax.random.normal(k_w, (num_layers, in_dim, out_dim), jnp.bfloat16) * 0.02
    slot_mask = (jnp.arange(num_slots) > 0)[None, :, None, None].astype(jnp.bfloat16)
    a = jax.random.normal(k_a, (num_layers, num_slots, rank, in_dim), jnp.bfloat16) * 0.02 * slot_mask
    b = jax.random.normal(k_b, (num_layers, num_slots, out_dim, rank), jnp.bfloat16) * 0.02 * slot_mask
    return [w[i] for i in range(num_layers)], [a[i] for i in range(num_layers)], [b[i] for i in range(num_layers)]


def time_fn(fn, args, min_seconds: float) -> float:
    """Median seconds per call over 5 batches of back-to-back (async) calls, after warm-up."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    single = time.perf_counter() - start
    calls = int(min(50, max(3, min_seconds / 5 / max(single, 1e-6))))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return float(np.median(samples))


def limits(in_dim, out_dim, rank, num_tokens, num_present):
    w_bytes = in_dim * out_dim * BYTES
    lora_bytes = num_present * rank * (in_dim + out_dim) * BYTES
    act_bytes = num_tokens * (in_dim + out_dim) * BYTES
    memory = (w_bytes + lora_bytes) / w_bytes
    compute = 1 + rank * (in_dim + out_dim) / (in_dim * out_dim)
    return memory, compute, w_bytes + lora_bytes + act_bytes


def layer_chain(chain: bool, residual: str):
    """The layers of a row's program: returns run_layers(layer, x, r, ws, as_, bs), which applies
    `layer(inp, res, w, a, b)` (-> the layer's output; res None: no residual; a, b None in the base program)
    once per weight in the row's form:

    - unchained (the protocol): every layer reads x; the outputs are returned side by side;
    - chain: each layer's output is the next layer's input;
    - residual "split" (the model's o and down): two streams alternate, layer i adds its output into the
      stream that was layer i-1's input, so input and residual are different arrays, as attention's output
      and the residual stream are in the model, and the next layer's input holds the LoRA delta;
    - residual "same": x is both input and residual (the bench's older form): an in-place add then makes XLA copy x
      first, which the model does not do.
    """

    def run_layers(layer, x, r, ws, as_, bs):
        as_ = as_ if as_ is not None else [None] * len(ws)
        bs = bs if bs is not None else [None] * len(ws)
        if not chain:
            return [layer(x, None, w, a, b) for w, a, b in zip(ws, as_, bs)]
        inp, res = x, r
        for w, a, b in zip(ws, as_, bs):
            if residual == "split":
                inp, res = layer(inp, res, w, a, b), inp
            else:
                inp = layer(inp, inp if residual == "same" else None, w, a, b)
        return inp

    return run_layers


def base_layer(inp, res, w, a, b):
    return inp @ w if res is None else res + inp @ w


def lora_layer(backend, meta):
    """A LoRA-wrapped layer; meta: `backend.prepare`'s metadata, shared by the layers (as in the engine)."""

    def layer(inp, res, w, a, b):
        if res is None:
            return backend.apply_packed(inp, a, (b,), meta, inp @ w, tp_size=1)
        return backend.apply_packed(inp, a, (b,), meta, res, tp_size=1) + inp @ w  # the delta into the residual

    return layer


def device_span_s(fn, args, calls: int = 3) -> float:
    """Median device span of one call (first kernel start to last kernel end, from a jax.profiler trace): the
    program's cost on the device, without the host's time to launch it. Programs compiled with --concurrent
    with LoRA traced at 1.27-1.50x their timed calls on an H100, so spans are compared only without it."""
    # the trace reading of profile_step.py, imported here: it pulls in the engine, which the scripts that import
    # this module for time_fn (bench_gemm_lora.py, tune_gpu_sgmv.py) do not need
    from scripts.profile_step import device_ops, span_us, split_forwards

    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="bench_lora_trace_")
    jax.profiler.start_trace(trace_dir)
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
        time.sleep(0.01)  # > the split gap below: each call is one group of device ops
    jax.profiler.stop_trace()
    calls_ops = split_forwards(device_ops(trace_dir), gap_us=5000.0)
    shutil.rmtree(trace_dir, ignore_errors=True)
    if not calls_ops:
        raise RuntimeError("the profiler trace holds no device ops (--device-span needs a GPU)")
    return float(np.median([span_us(ops) for ops in calls_ops])) * 1e-6


def measure(make_fn, args, opts) -> dict:
    """Seconds per call of `opts.compiles` separate compiles of make_fn(): median of the timed calls, their
    spread, and (with --device-span) the median device span."""
    timed, spans = [], []
    for _ in range(opts.compiles):
        fn = make_fn()  # a new function object: traced and compiled anew
        timed.append(time_fn(fn, args, opts.min_seconds))
        if opts.device_span:
            spans.append(device_span_s(fn, args))
    out = dict(timed=float(np.median(timed)), timed_all=timed)
    if spans:
        out.update(span=float(np.median(spans)), span_all=spans)
    return out


def run(args) -> list[dict]:
    results = []
    deadline = time.perf_counter() + args.time_budget
    backends = {name: make_lora_backend(name) for name in args.backends.split(",")}
    for shape, rank, num_tokens, num_adapters in grid(args.grid)[: args.max_rows]:
        in_dim, out_dim = (d // args.dim_divisor for d in SHAPES[shape])
        num_slots = max(8, num_adapters) + 1
        lora, num_present = make_lora(num_tokens, num_adapters, num_slots, rank, seed=num_tokens + num_adapters)
        memory_limit, compute_limit, bytes_moved = limits(in_dim, out_dim, rank, num_tokens, num_present)
        is_prefill = num_tokens >= 2048
        row = dict(
            shape=shape,
            in_dim=in_dim,
            out_dim=out_dim,
            rank=rank,
            tokens=num_tokens,
            slots=num_slots - 1,
            distinct=num_present,
            segments=lora.num_segments,
            limit=compute_limit if is_prefill else memory_limit,
            limit_kind="compute" if is_prefill else "memory",
            ratio={},
            gbps={},
            skipped={},
            span_ratio={},
            times={},
        )
        if time.perf_counter() > deadline:
            row["skipped"] = {name: "time budget" for name in backends}
            results.append(row)
            print_row(row, backends)
            continue
        ws, as_, bs = make_weights(jax.random.key(rank), args.layers, in_dim, out_dim, num_slots, rank)
        x = jax.random.normal(jax.random.key(1), (num_tokens, in_dim), jnp.bfloat16)
        r = jax.random.normal(jax.random.key(2), (num_tokens, out_dim), jnp.bfloat16)  # the residual stream

        chain = args.chain and in_dim == out_dim
        residual = args.residual if chain else "none"
        jit = functools.partial(jax.jit, compiler_options=CONCURRENT_GPU_KERNELS if args.concurrent else None)
        run_layers = layer_chain(chain, residual)
        row["chained"], row["residual"] = chain, residual

        def make_base():
            return jit(lambda x, r, ws: run_layers(base_layer, x, r, ws, None, None))

        base = measure(make_base, (x, r, ws), args)
        row["times"]["base"] = base
        row["t_base_us"] = base["timed"] / args.layers * 1e6
        for name, backend in backends.items():
            gather = num_tokens * rank * (in_dim + out_dim) * BYTES
            if name == "bgmv" and gather > MAX_GATHER_BYTES:
                row["skipped"][name] = f"gathers {gather / 2**30:.0f} GiB per layer"
                continue
            if time.perf_counter() > deadline:
                row["skipped"][name] = "time budget"
                continue

            def make_lora_fn(backend=backend):
                def fn(x, r, ws, as_, bs, lora):
                    meta = backend.prepare(lora, num_seqs=x.shape[0])
                    return run_layers(lora_layer(backend, meta), x, r, ws, as_, bs)

                return jit(fn)

            try:
                timing = measure(make_lora_fn, (x, r, ws, as_, bs, lora), args)
            except Exception as err:  # noqa: BLE001 - a failed backend is reported, the sweep goes on
                row["skipped"][name] = f"error: {type(err).__name__}: {str(err)[:120]}"
                continue
            row["times"][name] = timing
            row["ratio"][name] = timing["timed"] / base["timed"]
            row["gbps"][name] = bytes_moved / (timing["timed"] / args.layers) / 1e9
            if "span" in timing:
                row["span_ratio"][name] = timing["span"] / base["span"]
        del ws, as_, bs
        results.append(row)
        print_row(row, backends)
    return results


def print_header(backends) -> None:
    cols = " | ".join(f"{b} ratio [device span ratio] (GB/s)" for b in backends)
    print(f"| shape | rank | T | slots / distinct / G | base us/layer | limit | {cols} |", flush=True)
    print("|" + "---|" * (6 + len(backends)), flush=True)


def print_row(row: dict, backends) -> None:
    cells = []
    for name in backends:
        if name in row["ratio"]:
            span = f" [{row['span_ratio'][name]:.2f}]" if name in row.get("span_ratio", {}) else ""
            cells.append(f"{row['ratio'][name]:.2f}{span} ({row['gbps'][name]:.0f})")
        else:
            cells.append(f"not run: {row['skipped'].get(name, '?')}")
    limit = f"{row['limit']:.2f}" + (" (compute)" if row["limit_kind"] == "compute" else "")
    base = f"{row['t_base_us']:.1f}" if "t_base_us" in row else "-"
    print(
        f"| {row['shape']} {row['in_dim']}->{row['out_dim']} | {row['rank']} | {row['tokens']} | "
        f"{row['slots']} / {row['distinct']} / {row['segments']} | {base} | {limit} | " + " | ".join(cells) + " |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=("goal", "decode", "full"), default="full")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--min-seconds", type=float, default=0.15, help="timed work per function")
    parser.add_argument("--time-budget", type=float, default=450.0, help="rows past this are 'not run'")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--dim-divisor", type=int, default=1, help="shrink layer dims (CPU smoke runs only)")
    parser.add_argument("--max-rows", type=int, default=None)
    parser.add_argument(
        "--chain",
        action="store_true",
        help="square shapes (q/o): each layer's output is the next layer's input, as in a model",
    )
    parser.add_argument(
        "--residual",
        nargs="?",
        const="split",
        default="none",
        choices=("none", "split", "same"),
        help="with --chain: each layer adds its output (and its LoRA delta, in place) into a residual "
        "stream, the engine's form for o and down; 'split' (the default of the flag): input and "
        "residual are different arrays, as in the model; 'same': x is both (the older form)",
    )
    parser.add_argument(
        "--compiles",
        type=int,
        default=1,
        help="compile each program this many times, separately, and report the median time: separate "
        "compiles of one program differ (GEMM configurations, placement) by up to ~0.4 in "
        "decode ratios",
    )
    parser.add_argument(
        "--device-span",
        action="store_true",
        help="also trace 3 calls per compile (jax.profiler) and report the ratio of device spans, "
        "which leaves out the host's time to launch the program (GPU; not with --concurrent, "
        "whose traced spans exceed the timed calls)",
    )
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="compile with XLA's concurrent GPU kernel scheduling, as the engine does on GPU",
    )
    args = parser.parse_args()
    if args.device_span and jax.default_backend() != "gpu":
        parser.error(f"--device-span reads GPU kernels from a profiler trace; this platform is {jax.default_backend()}")
    if args.device_span and args.concurrent:
        parser.error(
            "--device-span with --concurrent: traced spans of concurrently scheduled kernels exceed the timed "
            "calls; time those programs without --device-span"
        )
    print(
        f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, layers {args.layers}, "
        f"chain {args.chain}, residual {args.residual}, concurrent {args.concurrent}",
        flush=True,
    )
    backends = args.backends.split(",")
    print_header(backends)
    results = run(args)
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(
                    jax=jax.__version__,
                    device=jax.devices()[0].device_kind,
                    layers=args.layers,
                    chain=args.chain,
                    residual=args.residual,
                    concurrent=args.concurrent,
                    compiles=args.compiles,
                    device_span=args.device_span,
                    rows=results,
                ),
                indent=1,
            )
        )
    print("\nsummary (same rows):", flush=True)
    print_header(backends)
    for row in results:
        print_row(row, backends)


if __name__ == "__main__":
    main()

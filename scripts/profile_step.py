"""Profile one engine step (decode, prefill/extend or mixed, base or with LoRA): time breakdown + a trace summary.

    python scripts/profile_step.py --mode decode --batch 64
    python scripts/profile_step.py --mode decode --batch 369 --prompt-len 384 --token-bucket 512
    python scripts/profile_step.py --mode extend --batch 8 --prompt-len 256 --lora-adapters 8 --lora-backend pallas
    python scripts/profile_step.py --mode mixed --batch 240 --prompt-len 512 --chunks 2 --chunk-len 256
Builds the Llama-3-8B-sized dummy engine of bench_offline.py (with `--lora-adapters` random rank-16 adapters on
all 7 projections, one per request round-robin), brings `--batch` requests to the step being profiled, then
(1) times the forward alone (and how long its call takes to return, before the device finishes), logits +
sampling alone and building the batch on the host, and (2) records `--steps` forwards with jax.profiler
(perfetto trace) and prints the ops with the most device time, the device span of a forward (first op start to
last op end: under concurrent kernel scheduling ops overlap, and the span, not the summed op time, is what a
forward costs) and its layer period (the median time from one layer's start to the next); `--json` also gets
the last forward's timeline. Mixed mode brings --batch requests to decode, then admits --chunks prompts of
--chunk-len tokens: the profiled step holds both, as most steps of a busy server do. Extend and mixed modes repeat
the same forward (it rewrites the same KV pages), so they are timed without the step's scheduling; decode mode
also times whole engine steps, with the overlap schedule and without it (each step finished before the next is
scheduled). `--pallas-variant` runs the
engine's Pallas kernels with one of tune_gpu_sgmv.py's tile variants, so that tiles are compared in the model.
`--decode-step-programs off` runs a decode step in the program of any mix instead of its own.
`--gpu-gemm-min-tokens N` (0: off) sets the engine flag, so that XLA's dot and the base GEMM kernel are compared on
the same prefill step; `--quantization fp8` builds the engine with 8-bit weights. `--tp-size N` shards the model
over N devices as `launch --tp-size N` does (the trace then holds every device's ops).
`--xla-option KEY=VALUE` adds an XLA option to the forward's compile options, so that XLA settings are compared on
the same step; `bring_up_s` (the engine built, its programs compiled, the requests brought to the step) shows what
they cost in compile time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import statistics
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_offline import LLAMA3_8B, make_model_dir, submit  # noqa: E402
from scripts.tune_gpu_sgmv import VARIANTS as TILE_VARIANTS  # noqa: E402
from scripts.tune_gpu_sgmv import apply_variant  # noqa: E402
from sgl_jax_lora.managers.engine_core import EngineCore  # noqa: E402
from sgl_jax_lora.model_executor import compiler_options  # noqa: E402
from sgl_jax_lora.server_args import QUANTIZATIONS, ServerArgs  # noqa: E402


def timed(fn, repeats: int, wait: bool = True) -> float:
    """Median ms of `repeats` calls of fn, after one warm-up call. wait=True times each call to its result;
    wait=False times only until fn returns (the host's share of a call: argument handling and launching the
    program), and awaits each result outside the timing."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        if wait:
            jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
        jax.block_until_ready(out)
    return 1e3 * statistics.median(times)


def device_ops(trace_dir: str) -> list[dict]:
    """The device ops of the latest trace under trace_dir, by start time: {name, ts, dur (us), stream}."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return []
    with gzip.open(max(files, key=os.path.getmtime)) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    ops = []
    for e in events:
        process = processes.get(e.get("pid"), "")
        if e.get("ph") == "X" and "dur" in e and ("gpu" in process.lower() or "/device:" in process):
            stream = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
            ops.append({"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"]), "stream": stream})
    return sorted(ops, key=lambda op: op["ts"])


def summarize_trace(ops: list[dict], top: int = 25) -> tuple[list[tuple[str, float, int]], float, int]:
    """(op name, device ms, count) rows of the ops with the most device time, and the device ms and op count
    of all of them. Under concurrent kernel scheduling ops overlap, so device ms exceeds the device's span."""
    total: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for op in ops:
        total[op["name"]] += op["dur"]
        count[op["name"]] += 1
    rows = [(n, total[n] / 1e3, count[n]) for n, _ in total.most_common(top)]
    return rows, sum(total.values()) / 1e3, sum(count.values())


def split_forwards(ops: list[dict], gap_us: float = 300.0) -> list[list[dict]]:
    """Device ops (by start time) grouped into forwards: a forward ends where no op runs for gap_us (the host's
    turn between two forwards; inside one compiled forward the device does not idle that long)."""
    forwards: list[list[dict]] = []
    busy_until = float("-inf")
    for op in ops:
        if op["ts"] - busy_until > gap_us:
            forwards.append([])
        forwards[-1].append(op)
        busy_until = max(busy_until, op["ts"] + op["dur"])
    return forwards


def span_us(forward: list[dict]) -> float:
    """Device time from a forward's first op start to its last op end: its critical path on the device."""
    return max(op["ts"] + op["dur"] for op in forward) - forward[0]["ts"]


def layer_period_us(forward: list[dict], num_layers: int) -> float | None:
    """Median time between successive layers' starts in a forward: the starts of the op that runs once per layer
    (its name occurs num_layers times) with the most device time. Steadier than span / layers: it leaves out the
    work before the first layer and after the last, and a host gap inside the forward moves only one interval."""
    count: dict[str, int] = collections.Counter(op["name"] for op in forward)
    busy: dict[str, float] = collections.Counter()
    for op in forward:
        busy[op["name"]] += op["dur"]
    per_layer = [name for name, n in count.items() if n == num_layers]
    if num_layers < 2 or not per_layer:
        return None
    marker = max(per_layer, key=busy.__getitem__)
    starts = [op["ts"] for op in forward if op["name"] == marker]
    return statistics.median(b - a for a, b in zip(starts, starts[1:]))


def timeline(forward: list[dict]) -> list[dict]:
    """A forward's ops with start times relative to its first op (us), for reading what overlaps what."""
    start = forward[0]["ts"]
    return [
        {"start_us": op["ts"] - start, "dur_us": op["dur"], "stream": op["stream"], "name": op["name"]}
        for op in forward
    ]


def parse_xla_option(option: str) -> tuple[str, bool | int | str]:
    """'KEY=VALUE' -> (KEY, VALUE as XLA's option type: true/false a bool, digits an int, else the string)."""
    key, _, value = option.partition("=")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, int(value) if value.lstrip("-").isdigit() else value


def add_forward_xla_options(extra: dict) -> None:
    """Merge `extra` into the compile options ModelRunner gives its forward (XLA's flag names and values)."""
    base = compiler_options.forward_compiler_options

    def with_extra(platform: str, disable_gpu_concurrent_kernels: bool, *, cublas_gemms: bool) -> dict:
        return {**(base(platform, disable_gpu_concurrent_kernels, cublas_gemms=cublas_gemms) or {}), **extra}

    compiler_options.forward_compiler_options = with_extra


def step_bucket(opts) -> tuple[int, int]:
    """(the engine's one token bucket, its chunked-prefill size) for the profiled step: decode, the batch's rows, or
    --token-bucket (the rows padded to it, as a serving engine pads a decode step to its bucket); extend, the batch's
    tokens; mixed, the decode rows plus the chunks' tokens; rounded up to a power of two (at least 128 for prefill),
    as the engine pads them."""
    if opts.mode == "decode":
        rows = max(opts.batch, 8)
        if opts.token_bucket and opts.token_bucket < rows:
            raise SystemExit(f"--token-bucket {opts.token_bucket} holds fewer tokens than the step's {rows} rows")
        return opts.token_bucket or rows, 2048
    tokens = opts.batch * opts.prompt_len if opts.mode == "extend" else opts.batch + opts.chunks * opts.chunk_len
    bucket = max(128, 1 << (tokens - 1).bit_length())
    return bucket, bucket


def build_engine(opts) -> tuple[EngineCore, list[str]]:
    model_dir = make_model_dir({**LLAMA3_8B, "num_hidden_layers": opts.num_layers})
    lora_paths = None
    if opts.lora_adapters:
        from scripts.make_adapters import named_adapters_beside

        lora_paths = named_adapters_beside(model_dir, opts.lora_adapters, "--dtype", "float16")
    step_tokens, prefill_tokens = step_bucket(opts)
    num_chunks = opts.chunks if opts.mode == "mixed" else 0
    args = ServerArgs(
        model_path=model_dir,
        load_format="dummy",
        dtype="bfloat16",
        tp_size=opts.tp_size,
        context_length=max(2048, prefill_tokens, opts.prompt_len + 256),
        max_total_tokens=max(160_000, opts.batch * (opts.prompt_len + 256) + num_chunks * (opts.chunk_len + 256)),
        max_running_requests=max(opts.batch + num_chunks, 8),
        chunked_prefill_size=prefill_tokens,
        max_prefill_seqs={"extend": max(opts.batch, 4), "decode": 8, "mixed": max(opts.chunks, 8)}[opts.mode],
        token_buckets=[step_tokens],
        attention_backend=opts.attention_backend,
        decode_step_programs=opts.decode_step_programs,
        kv_cache_dtype=opts.kv_cache_dtype,
        quantization=opts.quantization,
        skip_precompile=True,
        layers_per_scan_step=opts.layers_per_scan_step,
        lora_paths=lora_paths,
        max_loras_per_batch=max(1, opts.max_loras_per_batch or opts.lora_adapters),
        lora_backend=opts.lora_backend,
        lora_fused_gemm_min_tokens=opts.lora_fused_gemm_min_tokens,
        gpu_gemm_min_tokens=opts.gpu_gemm_min_tokens,
    )
    core = EngineCore(args, model_dir)
    return core, list(core.lora.refs) if core.lora else []


def roofline(runner, batch, opts) -> dict:
    """The step's HBM floor: every weight read once (the embedding table but the step's rows is not read) plus the K/V
    of every token the step attends to, at --hbm-tb-s; and its FLOPs (2 per weight per token for the linears,
    4 * head_dim per query-key pair and head for attention)."""
    cfg = runner.cfg
    embed = cfg.vocab_size * cfg.hidden_size * runner.dtype.itemsize
    weight_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(runner.state)) - embed
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * runner.kv_dtype.itemsize
    kv_lens = [r.num_computed + n for r, n in zip(batch.reqs, batch.num_new_tokens)]
    pairs = sum(sum(range(k - n + 1, k + 1)) for k, n in zip(kv_lens, batch.num_new_tokens))
    tokens = sum(batch.num_new_tokens)
    linear_flops = 2 * tokens * weight_bytes / runner.dtype.itemsize
    attention_flops = 4 * pairs * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes_read": kv_bytes_per_token * sum(kv_lens),
        "hbm_roofline_ms": (weight_bytes + kv_bytes_per_token * sum(kv_lens)) / (opts.hbm_tb_s * 1e9),
        "linear_flops": linear_flops,
        "attention_flops": attention_flops,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("decode", "extend", "mixed"), default="decode")
    parser.add_argument("--batch", type=int, default=64, help="requests (mixed: decode rows beside the chunks)")
    parser.add_argument("--chunks", type=int, default=2, help="mixed: prompts admitted into the profiled step")
    parser.add_argument("--chunk-len", type=int, default=256, help="mixed: tokens of each admitted prompt")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument(
        "--token-bucket",
        type=int,
        default=0,
        help="decode: pad the step's rows to this token bucket, as the engine pads a decode step (default: no padding)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--repeats", type=int, default=10, help="calls per timing, which reports their median (after one warm-up call)"
    )
    parser.add_argument("--tp-size", type=int, default=1, help="tensor parallelism over this many devices")
    parser.add_argument("--lora-adapters", type=int, default=0)
    parser.add_argument("--max-loras-per-batch", type=int, default=0, help="device slots (default: --lora-adapters)")
    parser.add_argument("--lora-backend", default="auto")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "native", "pallas"))
    parser.add_argument(
        "--decode-step-programs",
        default="auto",
        choices=("auto", "on", "off"),
        help="the engine flag: decode steps in programs of their own (auto: with the Pallas attention on GPU)",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine flag (auto, fp8_e4m3, fp8_e5m2)")
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="the engine flag (fp8: 8-bit weights; default: none)",
    )
    parser.add_argument(
        "--hbm-tb-s",
        type=float,
        default=3.35,
        help="HBM bandwidth for the decode roofline, TB/s (3.35 on H100 SXM, 4.8 on H200)",
    )
    parser.add_argument(
        "--lora-fused-gemm-min-tokens",
        type=int,
        default=None,
        help="the engine flag: prefill buckets from this many tokens run the GEMM with the LoRA "
        "inside it (0: off; default: the engine's)",
    )
    parser.add_argument(
        "--gpu-gemm-min-tokens",
        type=int,
        default=None,
        help="the engine flag: prefill buckets from this many tokens run every layer linear's base GEMM with the "
        "Mosaic GPU kernel instead of XLA's dot (0: off; default: the engine's)",
    )
    parser.add_argument("--layers-per-scan-step", type=int, default=0)
    parser.add_argument(
        "--pallas-variant",
        default="default",
        choices=tuple(TILE_VARIANTS),
        help="GPU kernel tile variant (scripts/tune_gpu_sgmv.py) for every Pallas LoRA call of the "
        "engine: tunes the kernels inside the model, beside the GEMMs they share the GPU with",
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=LLAMA3_8B["num_hidden_layers"],
        help="decoder layers of the Llama-3-8B-shaped model (fewer compile faster)",
    )
    parser.add_argument(
        "--xla-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an XLA option added to the forward's compile options (repeatable), e.g. "
        "xla_gpu_enable_dynamic_slice_fusion=true: compares XLA settings on the same step",
    )
    parser.add_argument("--out-dir", default="/tmp/profile")
    parser.add_argument("--json", default=None, help="write the breakdown and top ops here")
    parser.add_argument("--top", type=int, default=25, help="ops (by device time) printed and written to --json")
    opts = parser.parse_args()
    if opts.pallas_variant != "default":  # before the engine traces its forward
        apply_variant(TILE_VARIANTS[opts.pallas_variant])
    if opts.xla_option:  # before the runner builds its jitted forward
        add_forward_xla_options(dict(parse_xla_option(option) for option in opts.xla_option))
    started = time.perf_counter()
    core, lora_ids = build_engine(opts)
    args = core.args
    submit(core, opts.batch, opts.prompt_len, 200, lora_ids, seed=0)
    if core.lora is not None:  # every request's adapter in hand, so that the profiled step admits them all
        core.lora.wait_for_prefetches()
    if opts.mode in ("decode", "mixed"):
        while core.scheduler.waiting or any(r.is_prefilling for r in core.scheduler.running):
            core.step()
        for _ in range(3):
            core.step()
    if opts.mode == "mixed":  # the chunks join the running decode rows in the next step
        submit(core, opts.chunks, opts.chunk_len, 200, lora_ids, seed=1)
        if core.lora is not None:
            core.lora.wait_for_prefetches()
    batch = core.scheduler.schedule()
    bring_up_s = time.perf_counter() - started  # the engine built, its programs compiled, the step's requests run up
    assert batch is not None and batch.kind == opts.mode, "could not build the profiled step"
    if core.lora is not None:
        core.lora.apply(batch.slot_writes)
    forward_batch = batch.to_forward_batch(core.buckets, args.page_size, core.lora_builder, core.tokens_in_flight)
    device_batch = jax.device_put(forward_batch)
    runner = core.runner

    def forward_only():
        _, last = runner.forward(device_batch)
        last.block_until_ready()

    _, last = runner.forward(device_batch)
    sampling = batch.to_sampling_batch(forward_batch.num_seqs)
    breakdown = {
        "mode": opts.mode,
        "tp_size": opts.tp_size,
        "tokens": int(sum(batch.num_new_tokens)),
        "token_bucket": forward_batch.num_tokens,
        "lora_backend": opts.lora_backend if lora_ids else None,
        "pallas_variant": opts.pallas_variant,
        "lora_fused_gemm_min_tokens": opts.lora_fused_gemm_min_tokens,
        "gpu_gemm_min_tokens": opts.gpu_gemm_min_tokens,
        "quantization": opts.quantization,
        "attention_backend": runner.attention_backend,
        "xla_options": opts.xla_option,
        "bring_up_s": bring_up_s,
        **roofline(runner, batch, opts),
        "distinct_adapters": len({s for s in batch.token_slots if s}),
        "segment_bucket": forward_batch.lora.num_segments if forward_batch.lora is not None else None,
        "forward_ms": timed(forward_only, opts.repeats),
        "forward_dispatch_ms": timed(lambda: runner.forward(device_batch)[1], opts.repeats, wait=False),
        "logits_and_sample_ms": timed(lambda: runner.sample(last, sampling), opts.repeats),
        "host_build_batch_ms": timed(
            lambda: batch.to_forward_batch(core.buckets, args.page_size, core.lora_builder, core.tokens_in_flight),
            opts.repeats,
        ),
    }
    if opts.mode == "decode":  # a mixed step admits its chunks once: only its forward repeats
        breakdown["engine_step_ms"] = timed(core.step, opts.repeats)  # overlap schedule (the default)
        args.disable_overlap_schedule = True  # read by every step: the same engine, each step finished before the next
        breakdown["engine_step_no_overlap_ms"] = timed(core.step, opts.repeats)
    print(json.dumps(breakdown), flush=True)
    jax.profiler.start_trace(opts.out_dir, create_perfetto_trace=True)
    for _ in range(opts.steps):
        forward_only()
    jax.profiler.stop_trace()
    ops = device_ops(opts.out_dir)
    top, total_ms, total_ops = summarize_trace(ops, opts.top)
    breakdown["device_ms_per_forward"] = total_ms / opts.steps
    breakdown["device_ops_per_forward"] = total_ops // opts.steps
    forwards = split_forwards(ops)
    if forwards:
        breakdown["device_span_ms_per_forward"] = statistics.median(span_us(f) for f in forwards) / 1e3
        breakdown["layer_period_us"] = layer_period_us(forwards[-1], opts.num_layers)
    print(
        f"device time {total_ms / opts.steps:.3f} ms/forward in {total_ops // opts.steps} ops; device span "
        f"{breakdown.get('device_span_ms_per_forward', 0):.3f} ms/forward over {len(forwards)} forwards; layer period "
        f"{breakdown.get('layer_period_us') or 0:.1f} us",
        flush=True,
    )
    for name, ms, n in top[:25]:
        print(f"{ms / opts.steps:9.3f} ms/forward  {n // opts.steps:5d}x  {name[:140]}")
    if opts.json:
        breakdown["top_ops"] = [
            {"name": n, "ms_per_forward": ms / opts.steps, "count": c // opts.steps} for n, ms, c in top
        ]
        breakdown["timeline"] = timeline(forwards[-1]) if forwards else []  # the last traced forward, op by op
        with open(opts.json, "w") as f:
            json.dump(breakdown, f, indent=2)


if __name__ == "__main__":
    main()

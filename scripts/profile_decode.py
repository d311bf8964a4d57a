"""Profile decode steps of the offline engine: a jax.profiler trace summarized by op, and a time breakdown.

    python scripts/profile_decode.py --batch 64 [--layers-per-scan-step 0] [--out-dir DIR]
Builds the same Llama-3-8B-sized dummy engine as bench_offline.py, brings `--batch` requests to decode, then
(1) times the forward alone, the sampler alone and whole engine steps, and (2) records `--steps` decode steps
with jax.profiler (perfetto trace) and prints the 25 ops with the most device time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_offline import LLAMA3_8B, make_model_dir, submit  # noqa: E402
from sgl_jax_lora.managers.engine_core import EngineCore  # noqa: E402
from sgl_jax_lora.server_args import ServerArgs  # noqa: E402


def timed(fn, repeats: int = 10) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - start) / repeats


def summarize_trace(trace_dir: str, top: int = 25) -> list[tuple[str, float, int]]:
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return []
    with gzip.open(files[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    total: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and "gpu" in names.get(e.get("pid"), "").lower() or (
            e.get("ph") == "X" and "/device:" in names.get(e.get("pid"), "")):
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    return [(n, total[n] / 1e3, count[n]) for n, _ in total.most_common(top)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers-per-scan-step", type=int, default=0)
    parser.add_argument("--out-dir", default="/tmp/profile")
    opts = parser.parse_args()
    model_dir = make_model_dir(LLAMA3_8B)
    args = ServerArgs(model_path=model_dir, load_format="dummy", dtype="bfloat16", context_length=2048,
                      max_total_tokens=160_000, max_running_requests=opts.batch, chunked_prefill_size=2048,
                      max_prefill_seqs=4, decode_batch_buckets=[opts.batch], prefill_token_buckets=[2048],
                      decode_page_buckets=[64], skip_precompile=True, layers_per_scan_step=opts.layers_per_scan_step)
    core = EngineCore(args, model_dir)
    submit(core, opts.batch, opts.prompt_len, 200, [], seed=0)
    while core.scheduler.waiting or any(r.is_prefilling for r in core.scheduler.running):
        core.step()
    for _ in range(3):
        core.step()
    batch = core.scheduler.schedule()
    forward_batch = batch.to_forward_batch(core.buckets, args.page_size, core.lora_builder)
    device_batch = jax.device_put(forward_batch)
    runner = core.runner

    def forward_only():
        hidden, last = runner.forward(device_batch)
        last.block_until_ready()

    _, last = runner.forward(device_batch)
    sampling = batch.to_sampling_batch(forward_batch.num_seqs)
    breakdown = {
        "forward_ms": timed(forward_only),
        "logits_and_sample_ms": timed(lambda: runner.sample(last, sampling)),
        "host_build_batch_ms": timed(lambda: batch.to_forward_batch(core.buckets, args.page_size, core.lora_builder)),
        "engine_step_ms": timed(core.step),
    }
    print(json.dumps(breakdown), flush=True)
    jax.profiler.start_trace(opts.out_dir, create_perfetto_trace=True)
    for _ in range(opts.steps):
        core.step()
    jax.profiler.stop_trace()
    for name, ms, n in summarize_trace(opts.out_dir):
        print(f"{ms / opts.steps:9.3f} ms/step  {n // opts.steps:5d}x  {name[:140]}")


if __name__ == "__main__":
    main()

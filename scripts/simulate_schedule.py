"""The engine's scheduler over bench_serving.py's workload, without a device: its steps, their kinds and tokens.

Where it sits: beside scripts/bench_serving.py (the same request lengths, `sample_lengths`, all requests at once), to
choose `--chunked-prefill-size`, `--max-running-requests`, `--max-prefill-seqs`, `--max-total-tokens` and
`--token-buckets` before spending GPU time. It builds what EngineCore builds from the flags (the step's token budget,
`ServerArgs.step_token_budget`; the buckets, `Buckets.build`; the page allocator) and runs managers/scheduler.py's
`Scheduler`; each planned step's tokens land at once and every request generates its whole output (the benchmark's
requests ignore EOS). No model runs: the counts are the scheduler's, the time of a step is not modelled.

Prints, per step kind ("decode": decode rows only; "mixed": prefill chunks, with decode rows beside them), the steps,
their tokens and decode rows, the mean of each and of the padded bucket, how many steps ran each token bucket and
their mean tokens there; and the preemptions (a decode row short of a KV page takes the newest running request's
pages, which later recomputes its prefill).

Usage: python scripts/simulate_schedule.py [--num-requests 1000] [--json out.json] -- --max-running-requests 1024
    --chunked-prefill-size 4096 --context-length 1536 --max-total-tokens 330000 [--token-buckets ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_serving import sample_lengths  # noqa: E402
from sgl_jax_lora.configs.buckets import Buckets, pick  # noqa: E402
from sgl_jax_lora.launch import parse_args  # noqa: E402
from sgl_jax_lora.managers.req import Req  # noqa: E402
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sgl_jax_lora.managers.scheduler import Scheduler  # noqa: E402
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator  # noqa: E402
from sgl_jax_lora.sampling.sampling_params import SamplingParams  # noqa: E402


def build_scheduler(engine_flags: list[str]) -> tuple[Scheduler, Buckets]:
    """The scheduler EngineCore would build from these flags (--context-length and --max-total-tokens required:
    without a model or a device neither has a default here)."""
    args = parse_args(engine_flags)
    if not args.context_length or not args.max_total_tokens:
        raise SystemExit("simulate_schedule: give --context-length and --max-total-tokens among the engine flags")
    budget = args.step_token_budget(args.context_length)
    buckets = Buckets.build(args.max_running_requests, budget, args.context_length, args.page_size, args.token_buckets)
    allocator = PageAllocator(args.max_total_tokens // args.page_size, args.page_size)
    return Scheduler(buckets, allocator, args.max_running_requests, budget, args.max_prefill_seqs), buckets


def step_kind(plan: ScheduleBatch) -> str:
    """ "mixed" when the step holds a prefill chunk (a request that is not a decode row), else "decode"."""
    return "mixed" if plan.num_decode_rows < len(plan.reqs) else "decode"


def simulate(
    scheduler: Scheduler,
    buckets: Buckets,
    inputs: np.ndarray,
    outputs: np.ndarray,
    on_step: Callable[[ScheduleBatch], None] | None = None,
) -> dict:
    """Runs every request to its full output; -> per step kind: steps, tokens, decode rows, padded bucket tokens, and
    the steps that ran each token bucket (`steps_by_bucket`) and their mean tokens (`mean_tokens_by_bucket`).
    `on_step` sees each planned step before its tokens land (its requests' `num_computed` is then the context before
    the step)."""
    for i, (num_in, num_out) in enumerate(zip(inputs, outputs)):
        params = SamplingParams(max_new_tokens=int(num_out), ignore_eos=True)
        scheduler.add(Req(f"r{i}", [0] * int(num_in), params, seed=0, arrival_time=float(i)))
    kinds = {
        kind: dict(
            steps=0,
            tokens=0,
            decode_rows=0,
            bucket_tokens=0,
            steps_by_bucket=dict.fromkeys(buckets.tokens, 0),
            tokens_by_bucket=dict.fromkeys(buckets.tokens, 0),
        )
        for kind in ("decode", "mixed")
    }
    while scheduler.num_active:
        plan = scheduler.schedule()
        if plan is None:
            raise RuntimeError("the scheduler planned no step with requests left: a request can never fit the cache")
        if on_step is not None:
            on_step(plan)
        num_tokens = sum(plan.num_new_tokens)
        kind = kinds[step_kind(plan)]
        kind["steps"] += 1
        kind["tokens"] += num_tokens
        kind["decode_rows"] += plan.num_decode_rows
        bucket = pick(buckets.tokens, num_tokens)  # the engine's choice (ScheduleBatch.padded_sizes)
        kind["bucket_tokens"] += bucket
        kind["steps_by_bucket"][bucket] += 1
        kind["tokens_by_bucket"][bucket] += num_tokens
        for req, num_new in zip(plan.reqs, plan.num_new_tokens):
            req.num_computed += num_new
            if req.num_computed == req.seq_len:  # a decode row, or the chunk that ends a prefill: one token
                req.output_ids.append(0)
                if req.out_of_new_tokens:
                    scheduler.finish(req)
    for kind in kinds.values():
        steps = max(kind["steps"], 1)
        kind.update(mean_tokens=kind["tokens"] / steps, mean_bucket=kind["bucket_tokens"] / steps)
        tokens_by_bucket = kind.pop("tokens_by_bucket")
        kind["steps_by_bucket"] = {bucket: n for bucket, n in kind["steps_by_bucket"].items() if n}
        kind["mean_tokens_by_bucket"] = {b: tokens_by_bucket[b] / n for b, n in kind["steps_by_bucket"].items()}
    return dict(kinds, preemptions=scheduler.num_preemptions, token_buckets=list(buckets.tokens))


def workload_parser(description: str) -> argparse.ArgumentParser:
    """The workload options of the scripts that replay bench_serving.py's requests (this one, profile_host.py)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=0, help="fixed prompt length (0: ShareGPT-like)")
    parser.add_argument("--output-len", type=int, default=0, help="fixed output length (0: ShareGPT-like)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the result here")
    return parser


def split_engine_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv -> (the script's own options, the engine flags after `--`)."""
    split = argv.index("--") if "--" in argv else len(argv)
    return argv[:split], argv[split + 1 :]


def main() -> None:
    own, engine_flags = split_engine_flags(sys.argv[1:])
    opts = workload_parser(__doc__).parse_args(own)
    inputs, outputs = sample_lengths(np.random.default_rng(opts.seed), opts.num_requests, opts)
    scheduler, buckets = build_scheduler(engine_flags)
    result = simulate(scheduler, buckets, inputs, outputs)
    result.update(input_tokens=int(inputs.sum()), output_tokens=int(outputs.sum()), engine_flags=engine_flags)
    for kind in ("mixed", "decode"):
        row = result[kind]
        print(
            f"{kind}: {row['steps']} steps, {row['mean_tokens']:.0f} tokens each (bucket {row['mean_bucket']:.0f}), "
            f"{row['decode_rows'] / max(row['steps'], 1):.0f} decode rows each; steps per bucket "
            f"{row['steps_by_bucket']}, mean tokens per bucket "
            + str({bucket: round(mean) for bucket, mean in row["mean_tokens_by_bucket"].items()})
        )
    print(f"preemptions: {result['preemptions']}; token buckets: {result['token_buckets']}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

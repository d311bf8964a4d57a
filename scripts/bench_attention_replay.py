"""The decode attention kernel on the serving workload's own steps (GPU): device time and K/V rate, step by step.

Where it sits: beside scripts/bench_attention.py, whose decode rows give every sequence one context. A served step's
decode rows do not share one: in bench_serving.py's ShareGPT-like workload a step's longest context is 2-3.5x its
mean, and the order the decode kernel's programs launch in then decides how long the kernel's last programs run
alone. This script replays the workload through the engine's scheduler (scripts/simulate_schedule.py's `simulate`,
no device), takes `--steps-per-bucket` steps of each token bucket and step kind, evenly spaced over the run, and
builds each as the engine pads it: its decode rows (their contexts in the scheduler's row order) and prefill chunks,
padding sequences to S = min(T, --max-running-requests), a page table of the context's pages, random bf16 q and K/V
on pages shuffled over a cache of at least 4.5 GiB per K or V (as bench_attention.py's). Each step runs the engine's
attention call (`ragged_paged_attention_gpu`, the general kernel's grid bounded by --max-prefill-seqs) in a program
of 8 calls on their own q and cache layer; "kernel ms" is the decode kernel's median device time a launch from a
profiler trace (bench_attention.py's `kernel_ms`), its rate the step's decode rows' K/V bytes over it.

To compare kernels, run this script from each tree (copy it into an older one: it imports that tree's kernels).
Usage: python scripts/bench_attention_replay.py [--steps-per-bucket 3] [--json out.json] -- <engine flags:
    those of the serving run, e.g. --max-running-requests 1024 --max-prefill-seqs 16 --context-length 1536
    --max-total-tokens 330000 --chunked-prefill-size 4096 --token-buckets 64 256 512 1024 2048 4096>
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.attention.gpu import ragged_paged_attention_gpu  # noqa: E402
from scripts.bench_attention import (  # noqa: E402
    CALLS,
    DECODE_KERNEL,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    MIN_BUFFER_BYTES,
    kernel_ms,
    time_ms,
)
from scripts.bench_serving import sample_lengths  # noqa: E402
from scripts.simulate_schedule import build_scheduler, simulate, split_engine_flags, workload_parser  # noqa: E402
from sgl_jax_lora.configs.buckets import pick  # noqa: E402
from sgl_jax_lora.launch import parse_args  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ReplayStep:
    index: int  # the step's place in the run
    bucket: int  # its token bucket T
    decode_kv_lens: tuple[int, ...]  # each decode row's context, this step's token included, in the engine's order
    chunks: tuple[tuple[int, int], ...]  # (tokens already in the cache, new tokens) of each prefill chunk

    @property
    def kind(self) -> str:
        return "mixed" if self.chunks else "decode"


def replay_steps(engine_flags: list[str], opts: argparse.Namespace) -> list[ReplayStep]:
    """Every step of bench_serving.py's workload (opts: simulate_schedule.py's workload options) as the engine's
    scheduler plans it under engine_flags."""
    rng = np.random.default_rng(opts.seed)
    inputs, outputs = sample_lengths(rng, opts.num_requests, opts)
    scheduler, buckets = build_scheduler(engine_flags)
    steps: list[ReplayStep] = []

    def record(plan) -> None:
        rows = plan.num_decode_rows
        steps.append(
            ReplayStep(
                index=len(steps),
                bucket=pick(buckets.tokens, sum(plan.num_new_tokens)),
                decode_kv_lens=tuple(req.num_computed + 1 for req in plan.reqs[:rows]),
                chunks=tuple((req.num_computed, n) for req, n in zip(plan.reqs[rows:], plan.num_new_tokens[rows:])),
            )
        )

    simulate(scheduler, buckets, inputs, outputs, on_step=record)
    return steps


def pick_steps(steps: list[ReplayStep], per_bucket: int) -> list[ReplayStep]:
    """Up to per_bucket steps of each (bucket, kind) holding decode rows, evenly spaced over the run."""
    groups: dict[tuple[int, str], list[ReplayStep]] = {}
    for step in steps:
        if step.decode_kv_lens:
            groups.setdefault((step.bucket, step.kind), []).append(step)
    chosen = []
    for _, group in sorted(groups.items()):
        count = min(per_bucket, len(group))
        places = sorted({round(i * (len(group) - 1) / max(count - 1, 1)) for i in range(count)})
        chosen += [group[i] for i in places]
    return chosen


def step_layout(step: ReplayStep, max_seqs: int, pages_per_seq: int, page_size: int, seed: int) -> dict:
    """The step as the engine pads it: kv_lens [S], page_table [S, P] (each sequence's pages, drawn at random from
    the used ones; zeros past them), cu_q_lens [S + 1] (padding sequences hold no token) and its token count T."""
    num_seqs = min(step.bucket, max_seqs)
    q_lens = [1] * len(step.decode_kv_lens) + [new for _, new in step.chunks]
    kv_lens = list(step.decode_kv_lens) + [cached + new for cached, new in step.chunks]
    if len(q_lens) > num_seqs or sum(q_lens) > step.bucket:
        raise ValueError(f"step {step.index} holds more than its bucket's {num_seqs} sequences or {step.bucket} tokens")
    pages = [-(-n // page_size) for n in kv_lens]
    shuffled = np.random.default_rng(seed).permutation(np.arange(1, sum(pages) + 1))  # page 0: the padding's
    page_table = np.zeros((num_seqs, pages_per_seq), np.int32)
    starts = np.cumsum([0] + pages)
    for row, count in enumerate(pages):
        page_table[row, :count] = shuffled[starts[row] : starts[row] + count]
    padding = num_seqs - len(q_lens)
    return dict(
        kv_lens=np.asarray(kv_lens + [0] * padding, np.int32),
        page_table=page_table,
        cu_q_lens=np.concatenate([[0], np.cumsum(q_lens + [0] * padding)]).astype(np.int32),
        num_tokens=step.bucket,
        num_pages=sum(pages) + 1,
    )


def decode_kv_bytes(step: ReplayStep) -> int:
    """K and V bytes (bf16) the step's decode rows read."""
    return sum(step.decode_kv_lens) * KV_HEADS * HEAD_DIM * 2 * 2


def measure(step: ReplayStep, layout: dict, page_size: int, max_chunks: int, seed: int) -> dict:
    """The engine's attention call on the step's layout (bf16): the decode kernel's device time a launch and rate,
    and the whole call's time (`call_ms`: bench_attention.py's `time_ms`, both kernels and the XLA ops around them)."""
    slots = layout["num_pages"] * page_size
    num_layers = max(2, -(-MIN_BUFFER_BYTES // (KV_HEADS * slots * HEAD_DIM * 2)))
    key_q, key_k, key_v = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape = (num_layers, KV_HEADS, slots, HEAD_DIM)
    caches = (jax.random.normal(key_k, shape, jnp.bfloat16), jax.random.normal(key_v, shape, jnp.bfloat16))
    rest = tuple(jnp.asarray(layout[k]) for k in ("kv_lens", "page_table", "cu_q_lens"))
    qs = jax.random.normal(key_q, (CALLS, layout["num_tokens"], HEADS, HEAD_DIM), jnp.bfloat16)
    arg_sets = [(qs[i], *caches, jnp.int32(i % num_layers), *rest) for i in range(CALLS)]
    options = dict(page_size=page_size, scale=HEAD_DIM**-0.5, max_chunks=max_chunks)
    run = jax.jit(functools.partial(ragged_paged_attention_gpu, **options))
    kernel, kv_bytes = kernel_ms(run, arg_sets, DECODE_KERNEL), decode_kv_bytes(step)
    return dict(
        step=step.index,
        bucket=step.bucket,
        kind=step.kind,
        decode_rows=len(step.decode_kv_lens),
        chunks=len(step.chunks),
        mean_context=float(np.mean(step.decode_kv_lens)),
        longest_context=max(step.decode_kv_lens),
        kv_bytes=kv_bytes,
        kernel_ms=kernel,
        kernel_tbps=kv_bytes / kernel / 1e9,
        call_ms=time_ms(run, arg_sets),
    )


def main() -> None:
    own, engine_flags = split_engine_flags(sys.argv[1:])
    parser = workload_parser(__doc__)
    parser.add_argument("--steps-per-bucket", type=int, default=3, help="steps timed of each bucket and step kind")
    opts = parser.parse_args(own)
    args = parse_args(engine_flags)
    steps = replay_steps(engine_flags, opts)
    pages_per_seq = -(-args.context_length // args.page_size)
    rows = []
    for step in pick_steps(steps, opts.steps_per_bucket):
        layout = step_layout(step, args.max_running_requests, pages_per_seq, args.page_size, opts.seed + step.index)
        rows.append(measure(step, layout, args.page_size, args.max_prefill_seqs, opts.seed + step.index))
        print(json.dumps(rows[-1]), flush=True)
        if opts.json:
            Path(opts.json).write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))
    print(f"\n{'step (bucket, kind)':<24}{'rows':>6}{'chunks':>7}{'context':>14}{'kernel ms':>11}{'rate':>12}")
    for r in rows:
        context = f"{r['mean_context']:.0f} / {r['longest_context']}"
        name = f"{r['step']} ({r['bucket']}, {r['kind']})"
        print(
            f"{name:<24}{r['decode_rows']:>6}{r['chunks']:>7}{context:>14}{r['kernel_ms']:>11.3f}"
            f"{r['kernel_tbps']:>8.2f} TB/s"
        )


if __name__ == "__main__":
    main()

"""The engine's scheduler over bench_serving.py's workload, without a device: its steps, their kinds and tokens.

Where it sits: beside scripts/bench_serving.py (the same request lengths, `sample_lengths`, all requests at once), to
choose `--chunked-prefill-size`, `--max-running-requests`, `--max-prefill-seqs`, `--max-total-tokens` and
`--token-buckets` before spending GPU time. It builds what EngineCore builds from the flags (the step's token budget,
`ServerArgs.step_token_budget`; the buckets, `Buckets.build`; the page allocator) and runs managers/scheduler.py's
`Scheduler`; each planned step's tokens land at once and every request generates its whole output (the benchmark's
requests ignore EOS). No model runs: the counts are the scheduler's, the time of a step is not modelled.

Adapters: `--num-adapters N --popularity P` gives the requests bench_serving.py's adapters (the same draw, after the
lengths), and the scheduler then plans with `SlotTable`, the device slot table LoRAManager keeps without any weights
(`--max-loras-per-batch` slots, `--lora-eviction-policy`), so the steps show what the slot count costs a workload of
many adapters. An adapter's load lands at once here; the engine's comes from disk, read ahead of admission.

Prints, per step kind ("decode": decode rows only; "mixed": prefill chunks, with decode rows beside them), the steps,
their tokens and decode rows, the mean of each and of the padded bucket, how many steps ran each token bucket and
their mean tokens there; and the preemptions (a decode row short of a KV page takes the newest running request's
pages, which later recomputes its prefill).

Usage: python scripts/simulate_schedule.py [--num-requests 1000] [--num-adapters 1000 --popularity skewed]
    [--json out.json] -- --max-running-requests 1024 --chunked-prefill-size 4096 --context-length 1536
    --max-total-tokens 330000 [--token-buckets ...] [--max-loras-per-batch 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_serving import POPULARITIES, add_length_options, sample_adapters, sample_lengths  # noqa: E402
from sgl_jax_lora.configs.buckets import Buckets, pick  # noqa: E402
from sgl_jax_lora.launch import parse_args  # noqa: E402
from sgl_jax_lora.lora.adapter_plan import AdapterPlan  # noqa: E402
from sgl_jax_lora.lora.eviction import make_eviction_policy  # noqa: E402
from sgl_jax_lora.managers.req import Req  # noqa: E402
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sgl_jax_lora.managers.scheduler import Scheduler  # noqa: E402
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator  # noqa: E402
from sgl_jax_lora.mem_cache.prefix_cache import PrefixCache  # noqa: E402
from sgl_jax_lora.sampling.sampling_params import SamplingParams  # noqa: E402


class SlotTable:
    """The scheduler's AdapterSlots as LoRAManager answers them, with no weights: `num_slots` device slots; an
    adapter not on the device takes a free slot, else evicts (by the eviction policy) one that neither the step being
    planned, a running request nor `keep` uses; a step holds at most `num_slots` adapters. Counts loads and evictions."""

    def __init__(self, num_slots: int, eviction_policy: str = "lru"):
        self.num_slots = num_slots
        self.policy = make_eviction_policy(eviction_policy)
        self.slot_of: dict[str, int] = {}
        self.loads = self.evictions = self.max_per_step = 0

    def plan_step(self, running: set[str | None]) -> AdapterPlan:
        return AdapterPlan(running=frozenset(key for key in running if key is not None))

    def reserve(self, plan: AdapterPlan, key: str | None, keep: frozenset = frozenset()) -> int | None:
        if key is None:
            return 0
        if key not in plan.adapters:
            if len(plan.adapters) >= self.num_slots:
                return None
            if key not in self.slot_of and not self._load(key, plan.adapters | plan.running | keep):
                return None
            plan.adapters.add(key)
            self.max_per_step = max(self.max_per_step, len(plan.adapters))
        self.policy.mark_used(key)
        return self.slot_of[key]

    def _load(self, key: str, busy: set) -> bool:
        """Puts `key` in a free slot, or in the slot of the policy's victim among adapters not in `busy`."""
        free = sorted(set(range(1, self.num_slots + 1)) - set(self.slot_of.values()))
        if free:
            slot = free[0]
        else:
            candidates = [k for k in self.slot_of if k not in busy]
            if not candidates:
                return False
            victim = self.policy.select_victim(candidates)
            slot = self.slot_of.pop(victim)
            self.policy.remove(victim)
            self.evictions += 1
        self.slot_of[key] = slot
        self.loads += 1
        return True

    def can_evict(self, key: str) -> bool:
        return True

    @property
    def max_per_batch(self) -> int:
        return self.num_slots

    def is_resident(self, key: str) -> bool:
        return key in self.slot_of


def build_scheduler(
    engine_flags: list[str], with_adapters: bool = False, with_prefix_cache: bool = False
) -> tuple[Scheduler, Buckets]:
    """The scheduler EngineCore would build from these flags (--context-length and --max-total-tokens required:
    without a model or a device neither has a default here); with_adapters: planning with a `SlotTable` of
    --max-loras-per-batch slots (the scheduler's `adapter_slots`); with_prefix_cache: with the engine's prefix cache
    unless the flags disable it (this script's requests are all zeros, so it leaves the cache out)."""
    args = parse_args(engine_flags)
    if not args.context_length or not args.max_total_tokens:
        raise SystemExit("simulate_schedule: give --context-length and --max-total-tokens among the engine flags")
    budget = args.step_token_budget(args.context_length)
    buckets = Buckets.build(args.max_running_requests, budget, args.context_length, args.page_size, args.token_buckets)
    allocator = PageAllocator(args.max_total_tokens // args.page_size, args.page_size)
    slots = SlotTable(args.max_loras_per_batch, args.lora_eviction_policy) if with_adapters else None
    cache = PrefixCache(allocator) if with_prefix_cache and not args.disable_prefix_cache else None
    scheduler = Scheduler(
        buckets,
        allocator,
        args.max_running_requests,
        budget,
        args.max_prefill_seqs,
        slots,
        cache,
        kv_headroom=args.kv_headroom,
    )
    return scheduler, buckets


def step_kind(plan: ScheduleBatch) -> str:
    """ "mixed" when the step holds a prefill chunk (a request that is not a decode row), else "decode"."""
    return "mixed" if plan.num_decode_rows < len(plan.reqs) else "decode"


def simulate(
    scheduler: Scheduler,
    buckets: Buckets,
    inputs: np.ndarray,
    outputs: np.ndarray,
    on_step: Callable[[ScheduleBatch], None] | None = None,
    adapters: list[int | None] | None = None,
    max_new_tokens: np.ndarray | None = None,
) -> dict:
    """Runs every request to its full output (max_new_tokens: each request's, at least its output, which then ends
    as at an EOS; None: its output length, as bench_serving.py's requests); -> per step kind: steps, tokens, decode
    rows, padded bucket tokens, and the steps that ran each token bucket (`steps_by_bucket`) and their mean tokens
    (`mean_tokens_by_bucket`).
    `on_step` sees each planned step before its tokens land (its requests' `num_computed` is then the context before
    the step). adapters: each request's adapter index (None: base), for a scheduler built with adapters; the result
    then has `adapters` (distinct adapters, slots, loads, evictions, the most in one step)."""
    output_len: dict[Req, int] = {}
    for i, (num_in, num_out) in enumerate(zip(inputs, outputs)):
        limit = int(num_out if max_new_tokens is None else max_new_tokens[i])
        params = SamplingParams(max_new_tokens=limit, ignore_eos=True)
        key = None if adapters is None or adapters[i] is None else f"adapter_{adapters[i]:03d}"
        req = Req(f"r{i}", [0] * int(num_in), params, seed=0, lora_slot_key=key, arrival_time=float(i))
        output_len[req] = int(num_out)
        scheduler.add(req)
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
                if len(req.output_ids) == output_len[req]:
                    scheduler.finish(req)
    for kind in kinds.values():
        steps = max(kind["steps"], 1)
        kind.update(mean_tokens=kind["tokens"] / steps, mean_bucket=kind["bucket_tokens"] / steps)
        tokens_by_bucket = kind.pop("tokens_by_bucket")
        kind["steps_by_bucket"] = {bucket: n for bucket, n in kind["steps_by_bucket"].items() if n}
        kind["mean_tokens_by_bucket"] = {b: tokens_by_bucket[b] / n for b, n in kind["steps_by_bucket"].items()}
    result = dict(kinds, preemptions=scheduler.num_preemptions, token_buckets=list(buckets.tokens))
    slots = scheduler.adapter_slots
    if adapters is not None and slots is not None:
        distinct = len({a for a in adapters if a is not None})
        result["adapters"] = dict(
            distinct=distinct,
            slots=slots.num_slots,
            loads=slots.loads,
            evictions=slots.evictions,
            max_per_step=slots.max_per_step,
        )
    return result


def workload_parser(description: str) -> argparse.ArgumentParser:
    """The workload options of the scripts that replay bench_serving.py's requests (this one, profile_host.py)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=1000)
    add_length_options(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the result here")
    return parser


def add_adapter_options(parser: argparse.ArgumentParser) -> None:
    """bench_serving.py's adapter draw: --num-adapters (0: base only) and --popularity."""
    parser.add_argument("--num-adapters", type=int, default=0, help="adapters the requests draw from (0: base only)")
    parser.add_argument("--popularity", default="distinct", choices=POPULARITIES, help="as bench_serving.py's")


def add_max_new_tokens_option(parser: argparse.ArgumentParser) -> None:
    """--max-new-tokens, for the scripts that replay the requests through `simulate`."""
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=0,
        help="each request's max_new_tokens (at least its output, which then ends early as at an EOS; at most the "
        "context length less its prompt, as the engine allows): what the scheduler keeps KV headroom for; "
        "0: its output length; the context length: every request as an OpenAI call without max_tokens",
    )


def max_new_tokens_of(
    max_new_tokens: int, inputs: np.ndarray, outputs: np.ndarray, engine_flags: list[str]
) -> np.ndarray | None:
    """Each request's max_new_tokens under --max-new-tokens (None for 0: its output length)."""
    if not max_new_tokens:
        return None
    context_length = parse_args(engine_flags).context_length
    return np.maximum(outputs, np.minimum(max_new_tokens, context_length - inputs))


def split_engine_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """argv -> (the script's own options, the engine flags after `--`)."""
    split = argv.index("--") if "--" in argv else len(argv)
    return argv[:split], argv[split + 1 :]


def main() -> None:
    own, engine_flags = split_engine_flags(sys.argv[1:])
    parser = workload_parser(__doc__)
    add_adapter_options(parser)
    add_max_new_tokens_option(parser)
    opts = parser.parse_args(own)
    rng = np.random.default_rng(opts.seed)  # lengths, then adapters: bench_serving.py's order of draws
    inputs, outputs = sample_lengths(rng, opts.num_requests, opts)
    adapters = (
        sample_adapters(rng, opts.num_requests, opts.num_adapters, opts.popularity) if opts.num_adapters else None
    )
    scheduler, buckets = build_scheduler(engine_flags, with_adapters=adapters is not None)
    max_new_tokens = max_new_tokens_of(opts.max_new_tokens, inputs, outputs, engine_flags)
    result = simulate(scheduler, buckets, inputs, outputs, adapters=adapters, max_new_tokens=max_new_tokens)
    result.update(input_tokens=int(inputs.sum()), output_tokens=int(outputs.sum()), engine_flags=engine_flags)
    result.update(max_new_tokens=opts.max_new_tokens)
    for kind in ("mixed", "decode"):
        row = result[kind]
        print(
            f"{kind}: {row['steps']} steps, {row['mean_tokens']:.0f} tokens each (bucket {row['mean_bucket']:.0f}), "
            f"{row['decode_rows'] / max(row['steps'], 1):.0f} decode rows each; steps per bucket "
            f"{row['steps_by_bucket']}, mean tokens per bucket "
            + str({bucket: round(mean) for bucket, mean in row["mean_tokens_by_bucket"].items()})
        )
    print(f"preemptions: {result['preemptions']}; token buckets: {result['token_buckets']}")
    if "adapters" in result:
        row = result["adapters"]
        print(
            f"adapters: {row['distinct']} distinct over {opts.num_requests} requests ({opts.popularity}), "
            f"{row['slots']} slots: {row['loads']} loads, {row['evictions']} evictions, at most "
            f"{row['max_per_step']} in a step"
        )
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""The work floor of bench_serving.py's workload: the least time any engine needs for its steps on one GPU.

Where it sits: beside scripts/simulate_schedule.py, whose scheduler run it replays (the engine's own steps for these
flags, no device), to say how far a measured throughput is from what the work itself allows, and whether a goal is
reachable on this workload at all. Each step's work, for a Llama-3-8B-shaped model (`bench_offline.LLAMA3_8B`):

- FLOPs: 2 per decoder-layer weight per token, 2 per LM-head weight per sampled row, and 4 x head dim per causal
  (query, key) pair per query head and layer (QK^T and PV);
- bytes: every weight but the embedding table read once, plus each sequence's keys and values read once (its
  context before the step and the step's new tokens) and the new tokens' K/V written, at --kv-bytes per element.

Adapters (`--num-adapters N --popularity P`, bench_serving.py's draw; `--lora-rank`): each step also reads the A and B
of every distinct adapter its requests use, on all seven projections of every layer (what 32 distinct adapters read
in a step: 32 x 84 MB at rank 16), and does 2 FLOPs per A and B element per token of an adapter; both go to the
linears' side of the step. The adapters' part of the serial floor, against the same run's floor without adapters,
bounds the ratio to base that an engine running the LoRA beside its linears could reach.

A step's floor is its roofline, max(FLOPs / GEMM peak, bytes / HBM bandwidth): compute and memory perfectly
overlapped inside the step, no padding, no launch gaps, no host time. The run's floor is the sum over steps (also
per step kind: mixed steps hold prefill chunks, decode steps decode rows only), and output tokens over it the
ceiling on output tok/s. The serial floor is what an engine that runs its linears and its attention one after the
other (as ours does: separate kernels) can reach: per step, the linears at max(FLOPs / peak, weight bytes / bandwidth)
plus attention at max(FLOPs / peak, K/V bytes / bandwidth); it is also given in its two parts per step kind and token
bucket (`serial_floor_by_bucket`), to set beside a trace's GEMM and attention time or a profile of one bucket's step.
The peaks are options (defaults: an H100 SXM's 3.35 TB/s and the 790 TFLOP/s bf16 GEMM rate measured on one,
docs/benchmarks.md; under sustained GEMM load the same card holds 675-681 TFLOP/s at its 700 W power cap, so
`--gemm-tflops 675` gives the floor at that rate). Also printed: the four parts of the work, each at its own peak, so
that it shows which bound the steps meet.

Usage: python scripts/serving_floor.py [--kv-bytes 1] [--num-adapters 32 --popularity distinct] [--json out.json]
    -- <engine flags, as simulate_schedule.py>
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_offline import LLAMA3_8B  # noqa: E402
from scripts.bench_serving import sample_adapters, sample_lengths  # noqa: E402
from scripts.simulate_schedule import (  # noqa: E402
    add_adapter_options,
    add_max_new_tokens_option,
    build_scheduler,
    max_new_tokens_of,
    simulate,
    split_engine_flags,
    step_kind,
    workload_parser,
)
from sgl_jax_lora.configs.buckets import pick  # noqa: E402
from sgl_jax_lora.managers.schedule_batch import ScheduleBatch  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ModelWork:
    """Per-token and per-step constants of a model's work (weights in elements, bytes per weight element 2)."""

    layer_weights: int  # decoder-layer linear weights (q|k|v, o, gate|up, down), all layers
    head_weights: int  # LM head
    attention_flops_per_pair: int  # per (query, key) pair, all query heads and layers
    kv_elements_per_token: int  # K and V elements of one token, all layers
    lora_elements_per_rank: int  # an adapter's A and B elements per rank: the 7 projections' in + out, all layers

    @classmethod
    def from_config(cls, config: dict) -> ModelWork:
        hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
        heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
        per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
        return cls(
            layer_weights=layers * per_layer,
            head_weights=hidden * config["vocab_size"],
            attention_flops_per_pair=4 * head_dim * heads * layers,
            kv_elements_per_token=2 * kv_heads * head_dim * layers,
            lora_elements_per_rank=layers * (7 * hidden + 2 * heads * head_dim + 2 * kv_heads * head_dim + 3 * inter),
        )


@dataclasses.dataclass
class FloorTally:
    """The work of the steps seen so far, and the sum of their rooflines."""

    model: ModelWork
    gemm_flops_per_s: float
    hbm_bytes_per_s: float
    kv_bytes: float
    token_buckets: tuple[int, ...] = ()  # the engine's token buckets: the serial floor is also kept per bucket
    lora_rank: int = 16  # of every adapter (their A and B read once a step, their FLOPs per token)
    floor_s: float = 0.0
    serial_floor_s: float = 0.0
    floor_s_by_kind: dict[str, float] = dataclasses.field(default_factory=lambda: {"mixed": 0.0, "decode": 0.0})
    linear_flops: float = 0.0
    attention_flops: float = 0.0
    weight_bytes: float = 0.0
    kv_read_write_bytes: float = 0.0
    lora_bytes: float = 0.0
    lora_flops: float = 0.0
    serial_floor_by_bucket: dict[str, dict] = dataclasses.field(default_factory=dict)

    def add_step(self, plan: ScheduleBatch) -> None:
        """One planned step, before its tokens land (each request's num_computed is its context before the step)."""
        tokens = sampled = pairs = kv_tokens = adapter_tokens = 0
        adapters = {req.lora_slot_key for req in plan.reqs} - {None}
        for req, num_new in zip(plan.reqs, plan.num_new_tokens):
            adapter_tokens += num_new if req.lora_slot_key is not None else 0
            context = req.num_computed
            tokens += num_new
            sampled += context + num_new == req.seq_len  # the step ends its prompt or decodes: one token out
            pairs += num_new * context + num_new * (num_new + 1) // 2
            kv_tokens += context + 2 * num_new  # context and new keys read, new keys written
        lora_elements = self.lora_rank * self.model.lora_elements_per_rank
        lora_flops = 2.0 * lora_elements * adapter_tokens
        lora_bytes = 2.0 * lora_elements * len(adapters)
        linear = 2.0 * (self.model.layer_weights * tokens + self.model.head_weights * sampled) + lora_flops
        attention = float(self.model.attention_flops_per_pair * pairs)
        weights = 2.0 * (self.model.layer_weights + self.model.head_weights) + lora_bytes
        kv = self.kv_bytes * self.model.kv_elements_per_token * kv_tokens
        floor = max((linear + attention) / self.gemm_flops_per_s, (weights + kv) / self.hbm_bytes_per_s)
        self.floor_s += floor
        linear_floor = max(linear / self.gemm_flops_per_s, weights / self.hbm_bytes_per_s)
        attention_floor = max(attention / self.gemm_flops_per_s, kv / self.hbm_bytes_per_s)
        self.serial_floor_s += linear_floor + attention_floor
        self.floor_s_by_kind[step_kind(plan)] += floor
        if self.token_buckets:
            self._add_to_bucket(plan, tokens, linear_floor, attention_floor)
        self.linear_flops += linear
        self.attention_flops += attention
        self.weight_bytes += weights
        self.kv_read_write_bytes += kv
        self.lora_bytes += lora_bytes
        self.lora_flops += lora_flops

    def _add_to_bucket(self, plan: ScheduleBatch, tokens: int, linear_floor: float, attention_floor: float) -> None:
        """One step's serial floor in its two parts, under "<kind> <bucket>" (the bucket the engine pads it to)."""
        key = f"{step_kind(plan)} {pick(self.token_buckets, tokens)}"
        entry = self.serial_floor_by_bucket.setdefault(
            key, {"steps": 0, "tokens": 0, "context_tokens": 0, "linear_floor_s": 0.0, "attention_floor_s": 0.0}
        )
        entry["steps"] += 1
        entry["tokens"] += tokens
        entry["context_tokens"] += sum(req.num_computed for req in plan.reqs)
        entry["linear_floor_s"] += linear_floor
        entry["attention_floor_s"] += attention_floor

    def lora_parts_s(self) -> dict[str, float]:
        """The adapters' share of the linears' parts (counted in `parts_s` too), seconds at the peaks."""
        return {
            "lora_bytes_s": self.lora_bytes / self.hbm_bytes_per_s,
            "lora_flops_s": self.lora_flops / self.gemm_flops_per_s,
        }

    def parts_s(self) -> dict[str, float]:
        """Each part of the work alone at its peak, seconds."""
        return {
            "linear_flops_s": self.linear_flops / self.gemm_flops_per_s,
            "attention_flops_s": self.attention_flops / self.gemm_flops_per_s,
            "weight_bytes_s": self.weight_bytes / self.hbm_bytes_per_s,
            "kv_bytes_s": self.kv_read_write_bytes / self.hbm_bytes_per_s,
        }


def parse_options(own: list[str]) -> argparse.Namespace:
    parser = workload_parser(__doc__)
    add_adapter_options(parser)
    add_max_new_tokens_option(parser)
    parser.add_argument(
        "--gemm-tflops",
        type=float,
        default=790.0,
        help="bf16 GEMM rate, TFLOP/s (790: H100, measured; 675 under sustained load at its power cap)",
    )
    parser.add_argument("--hbm-tb-s", type=float, default=3.35, help="HBM bandwidth, TB/s (3.35: H100 SXM; 4.8: H200)")
    parser.add_argument("--kv-bytes", type=int, default=2, choices=(1, 2), help="bytes per K/V element (1: fp8 cache)")
    parser.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank (with --num-adapters)")
    return parser.parse_args(own)


def main() -> None:
    own, engine_flags = split_engine_flags(sys.argv[1:])
    opts = parse_options(own)
    rng = np.random.default_rng(opts.seed)  # lengths, then adapters: bench_serving.py's order of draws
    inputs, outputs = sample_lengths(rng, opts.num_requests, opts)
    adapters = (
        sample_adapters(rng, opts.num_requests, opts.num_adapters, opts.popularity) if opts.num_adapters else None
    )
    scheduler, buckets = build_scheduler(engine_flags, with_adapters=adapters is not None)
    work = ModelWork.from_config(LLAMA3_8B)
    tally = FloorTally(
        work, opts.gemm_tflops * 1e12, opts.hbm_tb_s * 1e12, opts.kv_bytes, buckets.tokens, lora_rank=opts.lora_rank
    )
    max_new_tokens = max_new_tokens_of(opts.max_new_tokens, inputs, outputs, engine_flags)
    steps = simulate(
        scheduler, buckets, inputs, outputs, on_step=tally.add_step, adapters=adapters, max_new_tokens=max_new_tokens
    )
    output_tokens = int(outputs.sum())
    result = {
        "input_tokens": int(inputs.sum()),
        "output_tokens": output_tokens,
        "steps": steps["mixed"]["steps"] + steps["decode"]["steps"],
        "floor_s": tally.floor_s,
        "floor_s_by_kind": tally.floor_s_by_kind,
        "steps_by_kind": {kind: steps[kind]["steps"] for kind in ("mixed", "decode")},
        "ceiling_output_tok_per_s": output_tokens / tally.floor_s,
        "serial_floor_s": tally.serial_floor_s,
        "serial_ceiling_output_tok_per_s": output_tokens / tally.serial_floor_s,
        "serial_floor_by_bucket": tally.serial_floor_by_bucket,
        **tally.parts_s(),
        **tally.lora_parts_s(),
        **{key: getattr(opts, key) for key in ("gemm_tflops", "hbm_tb_s", "kv_bytes", "max_new_tokens")},
        **{key: getattr(opts, key) for key in ("num_adapters", "popularity", "lora_rank")},
        "engine_flags": engine_flags,
    }
    print_result(result, steps, tally)
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=1))


def print_result(result: dict, steps: dict, tally: FloorTally) -> None:
    print(
        f"{result['steps']} steps, {result['output_tokens']} output tokens: floor {tally.floor_s:.2f} s, ceiling "
        f"{result['ceiling_output_tok_per_s']:.0f} output tok/s"
    )
    print(
        f"serial floor (the linears, then attention, each at its own bound): {tally.serial_floor_s:.2f} s, ceiling "
        f"{result['serial_ceiling_output_tok_per_s']:.0f} output tok/s"
    )
    print(
        "by step kind (as simulate_schedule.py counts them): "
        + ", ".join(
            f"{kind} {steps[kind]['steps']} steps, floor {s:.2f} s" for kind, s in tally.floor_s_by_kind.items()
        )
    )
    print_buckets(tally.serial_floor_by_bucket)
    print("parts, each at its peak: " + ", ".join(f"{k[:-2]} {v:.2f} s" for k, v in tally.parts_s().items()))
    if tally.lora_bytes:
        lora = tally.lora_parts_s()
        print(
            f"the adapters' part of those (rank {tally.lora_rank}, {result['num_adapters']} {result['popularity']}): "
            f"their A and B read {lora['lora_bytes_s']:.2f} s, their FLOPs {lora['lora_flops_s']:.3f} s"
        )


def print_buckets(by_bucket: dict[str, dict]) -> None:
    """The serial floor per step kind and token bucket: steps, mean tokens and context, and its two parts."""
    print("serial floor by step kind and token bucket:")
    for key, entry in sorted(by_bucket.items(), key=lambda item: (item[0].split()[0], int(item[0].split()[1]))):
        steps, linears, attention = entry["steps"], entry["linear_floor_s"], entry["attention_floor_s"]
        print(
            f"  {key:>12}: {steps} steps, {entry['tokens'] / steps:.0f} tokens and "
            f"{entry['context_tokens'] / steps:.0f} context tokens a step; linears {linears:.2f} s, attention "
            f"{attention:.2f} s ({(linears + attention) / steps * 1e3:.2f} ms a step)"
        )


if __name__ == "__main__":
    main()

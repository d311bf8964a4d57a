"""The engine's scheduler and prefix cache over bench_multiturn.py's conversations, without a device: how much of the
later turns' history a KV cache of a given size serves.

Where it sits: beside scripts/bench_multiturn.py (the same conversations, `plan_conversations`) and
scripts/simulate_schedule.py (the scheduler EngineCore builds from the engine flags, `build_scheduler`, here with its
prefix cache): to size --max-total-tokens for chat traffic before spending GPU time. Each planned step's tokens land
at once; a prefill chunk's full pages join the cache when its step is planned, as EngineCore's launch puts them; a
finished turn's next turn reaches the queue --return-steps steps later (the round trip through the frontend and the
client: on one H200 the measured hit rates matched a return of one step). No model runs: the counts are the
scheduler's, the time of a step is not modelled.

Prints, per --max-total-tokens (a comma list runs each): steps, prompt tokens sent, those the prefix cache served
at admission and those the steps computed (a preempted request's recompute included), and preemptions.

Usage: python scripts/simulate_multiturn.py --num-conversations 512 --turns 4 --max-total-tokens 200000,450000
    [--num-adapters 32 --popularity distinct] [--json out.json] -- --max-running-requests 512 --context-length 2048
    --chunked-prefill-size 4096 [--token-buckets ...] [--max-loras-per-batch 32]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_multiturn import Conversation, plan_conversations  # noqa: E402
from scripts.bench_serving import POPULARITIES, rng_prompt  # noqa: E402
from scripts.simulate_schedule import build_scheduler, split_engine_flags  # noqa: E402
from sgl_jax_lora.launch import parse_args  # noqa: E402
from sgl_jax_lora.managers.req import Req  # noqa: E402
from sgl_jax_lora.managers.scheduler import Scheduler  # noqa: E402
from sgl_jax_lora.sampling.sampling_params import SamplingParams  # noqa: E402


class Conversations:
    """The conversations' turns as requests: each turn's prompt is the history so far and a new message (tokens
    drawn from the seed, as bench_multiturn.py draws them), its output tokens drawn the same way."""

    def __init__(self, plans: list[Conversation], seed: int):
        self.plans, self.seed = plans, seed
        self.history: dict[int, list[int]] = {}
        self.turn_of: dict[str, tuple[int, int]] = {}
        self.outputs: dict[str, list[int]] = {}  # each turn's output tokens, drawn as it is sent
        self.prompt_tokens = 0
        self.clock = 0

    def request(self, i: int, turn: int) -> Req:
        plan = self.plans[i]
        prompt = self.history.get(i, []) + rng_prompt([self.seed, 1, i, turn], plan.message_lens[turn])
        key = None if plan.adapter is None else f"adapter_{plan.adapter:03d}"
        params = SamplingParams(max_new_tokens=plan.output_lens[turn], ignore_eos=True)
        self.clock += 1
        req = Req(f"c{i}t{turn}", prompt, params, seed=0, lora_slot_key=key, arrival_time=float(self.clock))
        self.turn_of[req.rid] = (i, turn)
        self.outputs[req.rid] = rng_prompt([self.seed, 2, i, turn], plan.output_lens[turn])
        self.prompt_tokens += len(prompt)
        return req

    def output_token(self, req: Req) -> int:
        return self.outputs[req.rid][len(req.output_ids)]

    def next_turn(self, req: Req) -> tuple[int, int] | None:
        """req ended: its conversation's history grows by it; -> the next turn, if any."""
        i, turn = self.turn_of[req.rid]
        self.history[i] = req.all_ids
        return (i, turn + 1) if turn + 1 < len(self.plans[i].message_lens) else None


def replay(scheduler: Scheduler, conversations: Conversations, return_steps: int) -> dict:
    """Every conversation to its last turn: -> steps (idle ones apart), prompt tokens sent, served by the cache and
    computed, preemptions."""
    returning: list[tuple[int, int, int]] = []  # (step it arrives, conversation, turn)
    for i, plan in enumerate(conversations.plans):
        if plan.message_lens:
            scheduler.add(conversations.request(i, 0))
    steps = idle = computed = 0
    while scheduler.num_active or returning:
        steps += 1
        plan = scheduler.schedule()
        if plan is None:
            idle += 1
        else:
            computed += land(scheduler, plan, conversations, steps + return_steps, returning)
        while returning and returning[0][0] <= steps:
            _, i, turn = returning.pop(0)
            scheduler.add(conversations.request(i, turn))
    return dict(
        steps=steps - idle,
        idle_steps=idle,
        prompt_tokens=conversations.prompt_tokens,
        cached_tokens=scheduler.num_cached_tokens,
        cached_share=scheduler.num_cached_tokens / max(conversations.prompt_tokens, 1),
        computed_prompt_tokens=computed,
        preemptions=scheduler.num_preemptions,
    )


def land(scheduler: Scheduler, plan, conversations: Conversations, arrival_step: int, returning: list) -> int:
    """The step's tokens land: prefill chunks' full pages join the cache (EngineCore._advance), each request that
    reached its last token ends and queues its next turn for arrival_step; -> prefill tokens computed."""
    cache, computed, ended = scheduler.prefix_cache, 0, []
    for row, (req, num_new) in enumerate(zip(plan.reqs, plan.num_new_tokens)):
        req.num_computed += num_new
        if row >= plan.num_decode_rows:
            computed += num_new
            if cache is not None:
                cache.insert(req.lora_slot_key, req.all_ids, req.num_computed, req.pages)
        if req.num_computed == req.seq_len:  # a decode row, or the chunk that ends a prefill: one token
            req.output_ids.append(conversations.output_token(req))
            if req.out_of_new_tokens:
                ended.append(req)
    for req in ended:
        scheduler.finish(req)
        nxt = conversations.next_turn(req)
        if nxt is not None:
            returning.append((arrival_step, *nxt))
    return computed


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, engine_flags = split_engine_flags(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-len", type=int, default=0, help="fixed first message length (0: ShareGPT-like)")
    parser.add_argument("--turn-len", type=int, default=0, help="fixed later message length (0: ShareGPT-like)")
    parser.add_argument("--output-len", type=int, default=0, help="fixed output length (0: ShareGPT-like)")
    parser.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of one system prompt for all")
    parser.add_argument("--num-adapters", type=int, default=0, help="adapters the conversations draw (0: base)")
    parser.add_argument("--popularity", default="distinct", choices=POPULARITIES)
    parser.add_argument("--return-steps", type=int, default=1, help="steps from a turn's end to its next turn")
    parser.add_argument("--max-total-tokens", required=True, help="KV cache sizes in tokens, comma separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(own), engine_flags


def main() -> None:
    opts, engine_flags = parse(sys.argv[1:])
    results = []
    for tokens in (int(t) for t in opts.max_total_tokens.split(",")):
        flags = [*engine_flags, "--max-total-tokens", str(tokens)]
        scheduler, _ = build_scheduler(flags, with_adapters=opts.num_adapters > 0, with_prefix_cache=True)
        plans = plan_conversations(opts, parse_args(flags).context_length)
        result = dict(max_total_tokens=tokens, **replay(scheduler, Conversations(plans, opts.seed), opts.return_steps))
        results.append(result)
        print(
            f"{tokens} KV tokens: {result['steps']} steps, {result['prompt_tokens']} prompt tokens sent, "
            f"{result['cached_tokens']} served by the cache ({result['cached_share']:.3f}), "
            f"{result['computed_prompt_tokens']} computed, {result['preemptions']} preemptions",
            flush=True,
        )
    if opts.json:
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "engine_flags": engine_flags, "runs": results}))


if __name__ == "__main__":
    main()

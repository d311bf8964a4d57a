"""Multi-turn chat benchmark: conversations that resend their whole history every turn, which the prefix cache can
serve from the pages of the turn before.

C conversations run at once, each a closed loop of up to T turns: turn 1's prompt is a first user message, turn k's
is turn k-1's prompt, its output and a new user message, and turn k is sent as soon as turn k-1 has ended (no think
time). Each conversation keeps one adapter (by --popularity over --num-adapters; 0 = base) and may start with one
--shared-prefix-len system prompt. Lengths (token counts) are drawn up front, ShareGPT-like: a first message ~
lognormal(ln 220, 0.8) clipped to [8, 1024], later messages ~ lognormal(ln 60, 0.8) clipped to [4, 512], outputs ~
lognormal(ln 180, 0.7) clipped to [8, 512] (or fixed with --first-len / --turn-len / --output-len); a conversation
ends before a turn whose prompt and output would pass --max-context (default: the server's context length). Outputs
run to their length (ignore_eos), so every run of one seed sends the same number of tokens.

Reports per scenario: output tok/s, the prompt tokens sent and the part the server took from its prefix cache (by
turn: first turns against later ones), TTFT of first and later turns, TPOT, and what the engine did meanwhile
(`bench_serving.engine_delta`). What the cache buys shows against a server started with --disable-prefix-cache.
Every run (warm-up, scenario) draws message tokens of its own, so no run reuses another's pages.

    python scripts/bench_multiturn.py --num-conversations 256 --turns 4 --num-adapters 0,32:distinct \\
        --adapter-dir /ad --out r.json -- --model-path DIR --load-format dummy --lora-allowed-dirs /ad ...
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import sys
import time

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_serving import (  # noqa: E402
    POPULARITIES,
    EngineTarget,
    HttpTarget,
    adapter_dirs_under,
    engine_delta,
    parse_scenarios,
    rng_prompt,
    sample_adapters,
    summarize,
)


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One conversation's plan: its adapter index (None = base) and, per turn it runs, the new user message's
    length and the output's."""

    adapter: int | None
    message_lens: tuple[int, ...]
    output_lens: tuple[int, ...]


def lognormal_lens(
    rng: np.random.Generator, count: int, fixed: int, shape: tuple[float, float, int, int]
) -> np.ndarray:
    """`count` lengths: all `fixed`, or lognormal of (median, sigma) clipped to [low, high]."""
    median, sigma, low, high = shape
    if fixed:
        return np.full(count, fixed)
    return np.clip(rng.lognormal(math.log(median), sigma, count), low, high).astype(int)


# (median, sigma, low, high) of the drawn lengths: a first message, a later one, an output
FIRST_MESSAGE, LATER_MESSAGE, OUTPUT = (220, 0.8, 8, 1024), (60, 0.8, 4, 512), (180, 0.7, 8, 512)


def plan_conversations(opts: argparse.Namespace, max_context: int) -> list[Conversation]:
    """Every conversation's adapter and turn lengths, drawn from --seed; turns that would pass max_context dropped
    (with every turn after them: the history only grows)."""
    rng = np.random.default_rng(opts.seed)
    n, turns = opts.num_conversations, opts.turns
    first = lognormal_lens(rng, n, opts.first_len, FIRST_MESSAGE)
    later = lognormal_lens(rng, n * turns, opts.turn_len, LATER_MESSAGE).reshape(n, turns)
    outputs = lognormal_lens(rng, n * turns, opts.output_len, OUTPUT).reshape(n, turns)
    adapters = sample_adapters(rng, n, opts.num_adapters, opts.popularity)
    plans = []
    for i in range(n):
        messages = [int(first[i]), *map(int, later[i, 1:])]
        history, kept = opts.shared_prefix_len, 0
        for message, output in zip(messages, outputs[i]):
            if history + message + int(output) > max_context:
                break
            history += message + int(output)
            kept += 1
        plans.append(Conversation(adapters[i], tuple(messages[:kept]), tuple(map(int, outputs[i, :kept]))))
    return plans


async def drive(target, plans: list[Conversation], opts: argparse.Namespace) -> dict:
    """Run every conversation at once, each turn after the one before it; one record a turn."""
    prefix = rng_prompt([opts.prefix_seed, 0], opts.shared_prefix_len) if opts.shared_prefix_len else []
    records: list[list[dict]] = [[] for _ in plans]
    bar = tqdm(total=sum(len(p.message_lens) for p in plans), desc="turns")

    async def converse(i: int, plan: Conversation) -> None:
        adapter = target.adapter_names[plan.adapter] if plan.adapter is not None else None
        history = list(prefix)
        for turn, (message_len, output_len) in enumerate(zip(plan.message_lens, plan.output_lens)):
            prompt = history + rng_prompt([opts.seed, opts.prompt_round, i, turn], message_len)
            record = {"turn": turn, "prompt_tokens": len(prompt), "start": time.perf_counter()}
            sampling = {"max_new_tokens": output_len, "temperature": opts.temperature, "ignore_eos": True}
            await target.send(prompt, sampling, adapter, record)
            record["end"] = time.perf_counter()
            records[i].append(record)
            history = prompt + list(record.pop("output_ids"))
            bar.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(converse(i, p) for i, p in enumerate(plans)))
    duration = time.perf_counter() - start
    bar.close()
    return summarize_turns([r for conv in records for r in conv], duration, opts, len(plans))


def summarize_turns(turns: list[dict], duration: float, opts: argparse.Namespace, num_conversations: int) -> dict:
    def part(selected: list[dict]) -> dict:
        sent = sum(r["prompt_tokens"] for r in selected)
        cached = sum(r["cached_tokens"] for r in selected)
        return {
            "turns": len(selected),
            "prompt_tokens": sent,
            "cached_tokens": cached,
            "cached_share": cached / sent if sent else None,
            "ttft_s": summarize([r["first"] - r["start"] for r in selected]),
        }

    output_tokens = sum(r["tokens"] for r in turns)
    return {
        "num_conversations": num_conversations,
        "max_turns": opts.turns,
        "num_adapters": opts.num_adapters,
        "popularity": opts.popularity,
        "shared_prefix_len": opts.shared_prefix_len,
        "temperature": opts.temperature,
        "duration_s": duration,
        "output_tok_per_s": output_tokens / duration,
        "turns_per_s": len(turns) / duration,
        "total_output_tokens": output_tokens,
        "all_turns": part(turns),
        "first_turns": part([r for r in turns if r["turn"] == 0]),
        "later_turns": part([r for r in turns if r["turn"] > 0]),
        "tpot_s": summarize([(r["end"] - r["first"]) / max(r["tokens"] - 1, 1) for r in turns]),
    }


def print_table(results: list[dict]) -> None:
    print(
        "| adapters | popularity | turns | output tok/s | prompt tokens cached (later turns) | "
        "TTFT first turns mean / p99 (s) | TTFT later turns mean / p99 (s) | TPOT mean (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        first, later = r["first_turns"], r["later_turns"]
        share = later["cached_share"]
        print(
            f"| {r['num_adapters']} | {r['popularity']} | {r['all_turns']['turns']} | {r['output_tok_per_s']:.0f} | "
            f"{r['all_turns']['cached_share']:.3f} ({'-' if share is None else f'{share:.3f}'}) | "
            f"{first['ttft_s']['mean']:.2f} / {first['ttft_s']['p99']:.2f} | "
            + (f"{later['ttft_s']['mean']:.2f} / {later['ttft_s']['p99']:.2f}" if later["turns"] else "-")
            + f" | {1e3 * r['tpot_s']['mean']:.1f} |"
        )


def parse_args(own_argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--url", default=None, help="a running server; default: an offline Engine from the flags after --"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4, help="turns a conversation runs at most")
    parser.add_argument(
        "--num-adapters",
        type=parse_scenarios,
        default=[(0, None)],
        help="adapters to spread conversations over (0 = base only); a comma list runs one scenario each, "
        "e.g. 0,32:distinct",
    )
    parser.add_argument("--adapter-dir", default=None, help="use the adapter directories under DIR by path")
    parser.add_argument("--popularity", default="distinct", choices=POPULARITIES)
    parser.add_argument("--first-len", type=int, default=0, help="fixed first message length (0 = ShareGPT-like)")
    parser.add_argument("--turn-len", type=int, default=0, help="fixed later message length (0 = ShareGPT-like)")
    parser.add_argument("--output-len", type=int, default=0, help="fixed output length (0 = ShareGPT-like)")
    parser.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of one system prompt for all")
    parser.add_argument("--max-context", type=int, default=0, help="0: the server's context length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--warmup-conversations", type=int, default=0, help="conversations run before each scenario")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args(own_argv)
    for name in ("num_conversations", "turns"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(opts, name)}: must be at least 1")
    opts.prefix_seed = opts.seed
    return opts


def run_scenarios(target, opts: argparse.Namespace, max_context: int) -> list[dict]:
    """Each scenario after its own warm-up conversations (another seed), with the engine's account of its window."""
    results, prompt_rounds = [], itertools.count(1)
    for count, popularity in opts.num_adapters:
        if count > len(target.adapter_names):
            raise SystemExit(f"--num-adapters {count}: the server has only {len(target.adapter_names)} adapters")
        scenario = argparse.Namespace(
            **{**vars(opts), "num_adapters": count, "popularity": popularity or opts.popularity}
        )
        if opts.warmup_conversations:
            warm = argparse.Namespace(
                **{**vars(scenario), "num_conversations": opts.warmup_conversations, "seed": opts.seed + 1}
            )
            warm.prompt_round = next(prompt_rounds)
            target.run(drive(target, plan_conversations(warm, max_context), warm))
        scenario.prompt_round = next(prompt_rounds)
        before = target.server_info()
        result = target.run(drive(target, plan_conversations(scenario, max_context), scenario))
        result["engine"] = engine_delta(before, target.server_info())
        results.append(result)
        print(json.dumps(result), flush=True)
        if opts.out:  # after every scenario, so a run cut short keeps what it measured
            with open(opts.out, "w") as f:
                json.dump({"argv": sys.argv[1:], "max_context": max_context, "scenarios": results}, f, indent=2)
    return results


def main() -> None:
    argv = sys.argv[1:]
    engine_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    opts = parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    target = HttpTarget(opts.url, opts.api_key) if opts.url else EngineTarget(engine_argv)
    if opts.adapter_dir:
        target.adapter_names = adapter_dirs_under(opts.adapter_dir)
    try:
        info = target.server_info()
        max_context = opts.max_context or info["context_length"]
        print(f"engine: context {info['context_length']}, budget {info.get('step_token_budget')}", flush=True)
        results = run_scenarios(target, opts, max_context)
    finally:
        target.close()
    print_table(results)


if __name__ == "__main__":
    main()

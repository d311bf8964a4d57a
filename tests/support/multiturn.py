"""Test helpers for the multi-turn benchmarks (scripts/bench_multiturn.py, scripts/simulate_multiturn.py): fixed
turn lengths on pages of 4 tokens, so what the prefix cache serves is known to the token.

    opts = conversation_options(num_conversations=12, first_len=FIRST, turn_len=LATER, output_len=OUTPUT)
    expected = 12 * cached_per_conversation()
"""

from __future__ import annotations

import argparse

PAGE, TURNS, FIRST, LATER, OUTPUT = 4, 3, 9, 5, 6
PROMPTS = [FIRST + t * (OUTPUT + LATER) for t in range(TURNS)]  # each turn resends the history


def full_pages(tokens: int) -> int:
    return tokens // PAGE * PAGE


def cached_per_conversation() -> int:
    """Prompt tokens the cache serves one conversation: a turn computed its prompt and all its output tokens but the
    last (never fed back), and the next turn finds their full pages."""
    return sum(full_pages(PROMPTS[t - 1] + OUTPUT - 1) for t in range(1, TURNS))


def length_flags(num_conversations: int) -> list[str]:
    """The scripts' flags for these conversations."""
    flags = {"--num-conversations": num_conversations, "--turns": TURNS, "--first-len": FIRST}
    flags.update({"--turn-len": LATER, "--output-len": OUTPUT})
    return [item for flag, value in flags.items() for item in (flag, str(value))]


def conversation_options(**overrides) -> argparse.Namespace:
    """The options `plan_conversations` reads (ShareGPT-like lengths unless overridden), as the scripts build them."""
    values = dict(
        num_conversations=4,
        turns=TURNS,
        first_len=0,
        turn_len=0,
        output_len=0,
        shared_prefix_len=0,
        num_adapters=0,
        popularity="distinct",
        seed=0,
    )
    return argparse.Namespace(**{**values, **overrides})

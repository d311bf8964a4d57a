"""scripts/simulate_multiturn.py: the engine's scheduler and prefix cache over bench_multiturn.py's conversations,
without a device. Fixed lengths, pages of 4 tokens: what the cache serves is known to the token."""

from __future__ import annotations

import json
import subprocess
import sys

from scripts.bench_multiturn import plan_conversations
from scripts.simulate_multiturn import Conversations, replay
from scripts.simulate_schedule import build_scheduler
from tests.support import REPO_ROOT
from tests.support.multiturn import (
    FIRST,
    LATER,
    OUTPUT,
    PAGE,
    PROMPTS,
    cached_per_conversation,
    conversation_options,
    length_flags,
)

CONVERSATIONS = 12
FLAGS = ["--max-running-requests", "16", "--max-prefill-seqs", "4", "--context-length", "256"]
FLAGS += ["--chunked-prefill-size", "128", "--page-size", str(PAGE)]


def run(max_total_tokens: int, *extra: str, num_adapters: int = 0, return_steps: int = 1) -> dict:
    flags = [*FLAGS, "--max-total-tokens", str(max_total_tokens), *extra]
    scheduler, _ = build_scheduler(flags, with_adapters=num_adapters > 0, with_prefix_cache=True)
    opts = conversation_options(
        num_conversations=CONVERSATIONS,
        first_len=FIRST,
        turn_len=LATER,
        output_len=OUTPUT,
        num_adapters=num_adapters,
    )
    return replay(scheduler, Conversations(plan_conversations(opts, 256), seed=0), return_steps)


def test_a_roomy_cache_serves_every_full_page_of_the_turn_before():
    result = run(100_000)
    assert result["prompt_tokens"] == CONVERSATIONS * sum(PROMPTS)
    assert result["cached_tokens"] == CONVERSATIONS * cached_per_conversation()
    assert result["computed_prompt_tokens"] == result["prompt_tokens"] - result["cached_tokens"]
    assert result["preemptions"] == 0
    # however late the next turn comes back, nothing pushes the history out
    assert run(100_000, return_steps=8)["cached_tokens"] == result["cached_tokens"]
    # each conversation keeps its adapter, whose pages are its own: the same hits
    assert run(100_000, "--max-loras-per-batch", "2", num_adapters=3)["cached_tokens"] == result["cached_tokens"]


def test_without_the_prefix_cache_every_prompt_is_computed():
    result = run(100_000, "--disable-prefix-cache")
    assert result["cached_tokens"] == 0 and result["computed_prompt_tokens"] == result["prompt_tokens"]


def test_a_cache_smaller_than_the_histories_serves_less_and_recomputes():
    """160 tokens of KV for 12 conversations of up to 53 tokens: the running turns fill it, and admissions evict the
    histories of the turns that ended before their next turns come back."""
    roomy, tight = run(100_000), run(160, return_steps=3)
    assert tight["prompt_tokens"] == roomy["prompt_tokens"]  # every turn still runs
    assert tight["cached_tokens"] < roomy["cached_tokens"]
    assert tight["computed_prompt_tokens"] >= tight["prompt_tokens"] - tight["cached_tokens"]


def test_the_command_line_runs_each_cache_size(tmp_path):
    out = tmp_path / "sim.json"
    done = subprocess.run(
        [
            sys.executable,
            f"{REPO_ROOT}/scripts/simulate_multiturn.py",
            *length_flags(CONVERSATIONS),
            "--max-total-tokens",
            "100000,160",
            "--json",
            str(out),
            "--",
            *FLAGS,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["max_total_tokens"] for r in runs] == [100_000, 160]
    assert runs[0]["cached_tokens"] == CONVERSATIONS * cached_per_conversation()
    assert "100000 KV tokens:" in done.stdout and "160 KV tokens:" in done.stdout

"""scripts/bench_multiturn.py end to end against a real server: `python -m sgl_jax_lora.launch` (demo model, fp32,
pages of 4 tokens) on 127.0.0.1, conversations on the base model and on adapters written by scripts/make_adapters.py.

Checks the conversations' plan (turns cut at the context), that every turn resends its history, and that the prefix
cache serves exactly the full pages the turn before computed, per adapter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from scripts.bench_multiturn import plan_conversations
from tests.support import REPO_ROOT
from tests.support.http_helpers import SMALL_ENGINE_FLAGS, server_env, start_server, write_demo_adapters
from tests.support.multiturn import (
    FIRST,
    LATER,
    OUTPUT,
    PAGE,
    PROMPTS,
    TURNS,
    cached_per_conversation,
    conversation_options,
    full_pages,
    length_flags,
)

pytestmark = pytest.mark.slow  # a server start and a dozen conversations on a 2-core CPU

CONVERSATIONS = 4


def test_the_plan_stops_a_conversation_before_the_turn_that_passes_the_context():
    opts = conversation_options(num_conversations=200, turns=6, shared_prefix_len=16, num_adapters=3)
    plans = plan_conversations(opts, max_context=1536)
    assert plans == plan_conversations(opts, max_context=1536)  # drawn from the seed alone
    assert [p.adapter for p in plans[:4]] == [0, 1, 2, 0]
    cut = 0
    for plan in plans:
        history = 16 + sum(plan.message_lens) + sum(plan.output_lens)
        assert history <= 1536 and len(plan.message_lens) == len(plan.output_lens) <= 6
        assert all(4 <= m <= 1024 for m in plan.message_lens) and all(8 <= o <= 512 for o in plan.output_lens)
        cut += len(plan.message_lens) < 6
    assert 0 < cut < 200  # lognormal lengths: some conversations reach the context before their sixth turn
    fixed = plan_conversations(conversation_options(first_len=FIRST, turn_len=LATER, output_len=OUTPUT), max_context=30)
    assert {(p.message_lens, p.output_lens) for p in fixed} == {((9, 5), (6, 6))}  # 9+6+5+6 = 26; a third turn: 37


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn_adapters")
    write_demo_adapters(str(root), "--num-adapters", "2", "--rank", "8", "--targets", "q_proj,v_proj")
    return root


@pytest.fixture(scope="module")
def server(adapter_root):
    flags = [*SMALL_ENGINE_FLAGS, "--lora-allowed-dirs", str(adapter_root), "--max-loras-per-batch", "2"]
    srv = start_server([*flags, "--page-size", str(PAGE)])
    yield srv
    srv.stop(signal.SIGKILL)


def run_bench(server, adapter_root, out, *flags: str) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "scripts", "bench_multiturn.py"),
            "--url",
            server.url,
            *length_flags(CONVERSATIONS),
            "--adapter-dir",
            str(adapter_root),
            "--out",
            str(out),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=server_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| adapters | popularity | turns |" in done.stdout
    with open(out) as f:
        return json.load(f)


def test_later_turns_take_the_pages_of_the_turn_before(server, adapter_root, tmp_path):
    result = run_bench(
        server, adapter_root, tmp_path / "r.json", "--num-adapters", "0,2", "--warmup-conversations", "1"
    )
    for scenario in result["scenarios"]:
        assert scenario["all_turns"]["turns"] == CONVERSATIONS * TURNS
        assert scenario["total_output_tokens"] == CONVERSATIONS * TURNS * OUTPUT
        first, later = scenario["first_turns"], scenario["later_turns"]
        assert first["prompt_tokens"] == CONVERSATIONS * FIRST and first["cached_tokens"] == 0
        assert later["prompt_tokens"] == CONVERSATIONS * sum(PROMPTS[1:])
        assert later["cached_tokens"] == CONVERSATIONS * cached_per_conversation()
        assert scenario["engine"]["prefix_cache_hit_tokens"] == CONVERSATIONS * cached_per_conversation()
        assert scenario["engine"]["compilations"] == 0
    base, lora = result["scenarios"]
    assert base["engine"]["lora"]["device_misses"] == 0
    assert lora["num_adapters"] == 2 and lora["engine"]["lora"]["device_hits"] > 0


def test_a_shared_system_prompt_and_the_context_cut(server, adapter_root, tmp_path):
    """An 8-token system prompt before every conversation (cached by the warm-up), and a context of 40 tokens: 8 + 9
    + 6 + 5 + 6 = 34, so a third turn (45) is never sent."""
    result = run_bench(
        server,
        adapter_root,
        tmp_path / "p.json",
        "--shared-prefix-len",
        "8",
        "--max-context",
        "40",
        "--warmup-conversations",
        "1",
    )
    (scenario,) = result["scenarios"]
    assert result["max_context"] == 40 and scenario["all_turns"]["turns"] == CONVERSATIONS * 2
    first, later = scenario["first_turns"], scenario["later_turns"]
    assert first["prompt_tokens"] == CONVERSATIONS * (8 + FIRST) and first["cached_tokens"] == CONVERSATIONS * 8
    assert later["cached_tokens"] == CONVERSATIONS * full_pages(8 + FIRST + OUTPUT - 1)

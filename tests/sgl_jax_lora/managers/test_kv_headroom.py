"""KV headroom: after a decode row found no free page, admission keeps room for the running requests' next tokens.

The scheduler on the host alone (as in test_scheduler.py): a cache of a few pages of 4 tokens, requests driven step
by step as the engine loop drives them.
"""

from __future__ import annotations

import pytest

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.managers.kv_headroom import HEADROOM_AFTER_PREEMPTION, KVHeadroom
from sgl_jax_lora.managers.scheduler import Scheduler
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator
from sgl_jax_lora.server_args import ServerArgs
from tests.support.scheduler_steps import chunks, finish_prefill, req


def make_scheduler(num_pages: int, kv_headroom: float, max_running: int = 16) -> Scheduler:
    buckets = Buckets.build(max_running, 64, 256, 4)
    allocator = PageAllocator(num_pages, 4)
    return Scheduler(buckets, allocator, max_running, 64, 8, kv_headroom=kv_headroom)


def test_the_flag_default_is_the_schedulers():
    assert (
        ServerArgs().kv_headroom
        == HEADROOM_AFTER_PREEMPTION
        == make_scheduler(8, HEADROOM_AFTER_PREEMPTION).headroom.after_preemption
    )


def test_a_preempting_step_sets_the_ratio_and_steps_without_one_lower_it():
    headroom = KVHeadroom(after_preemption=0.3, decay=0.1)
    headroom.after_step(preempted=False)
    assert headroom.ratio == 0.0  # never below 0
    headroom.after_step(preempted=True)
    headroom.after_step(preempted=True)
    assert headroom.ratio == pytest.approx(0.3)  # set, not added: a run of preempting steps keeps it there
    headroom.after_step(preempted=False)
    assert headroom.ratio == pytest.approx(0.2)
    headroom.after_step(preempted=True)
    assert headroom.ratio == pytest.approx(0.3)
    for _ in range(5):
        headroom.after_step(preempted=False)
    assert headroom.ratio == 0.0
    headroom.after_step(preempted=True)
    headroom.clear()  # the engine is left with no request
    assert headroom.ratio == 0.0
    off = KVHeadroom(after_preemption=0.0)
    off.after_step(preempted=True)
    assert off.ratio == 0.0 and off.tokens_for([req("r", max_new_tokens=100)]) == 0.0


def test_headroom_counts_the_tokens_each_request_may_still_sample():
    headroom = KVHeadroom(ratio=0.5)
    fresh, halfway, done = req("fresh", max_new_tokens=40), req("halfway", max_new_tokens=40), req("done")
    halfway.output_ids = [7] * 20
    done.output_ids = [7] * 5  # past its max_new_tokens of 4: nothing left, not a negative share
    assert headroom.tokens_for([fresh, halfway, done]) == 0.5 * (40 + 20)
    fresh.priority, halfway.priority = 0, 2
    assert headroom.tokens_for([fresh, halfway, done], as_urgent_as=1) == 0.5 * 40  # a less urgent one is left out
    windowed = KVHeadroom(ratio=0.5, window=24)  # a request gives back its pages below the window as it goes
    assert halfway.seq_len > 24 and windowed.tokens_for([fresh, halfway]) == 0.5 * (24 - fresh.seq_len)


@pytest.mark.parametrize("ratio, admitted", [(0.0, True), (0.25, True), (0.5, False)])
def test_a_prompt_is_admitted_only_where_it_leaves_the_headroom_free(ratio, admitted):
    sched = make_scheduler(num_pages=11, kv_headroom=0.3)  # 10 usable pages of 4 tokens
    running = req("running", length=4, t=0, max_new_tokens=33)
    sched.add(running)
    finish_prefill(sched.schedule())  # 1 page; its first token sampled, 32 more to come
    waiting = req("waiting", length=20, t=1)  # 5 pages
    sched.add(waiting)
    sched.headroom.ratio = ratio
    batch = sched.schedule()  # the decode row takes a second page: 8 free
    # (the step lowers the ratio by 0.002 before admission) 32 tokens x 0.248 = 2 pages kept free beside the prompt's 5
    # of 8; x 0.498 = 4 pages, which do not fit
    assert batch.reqs[0] is running and batch.num_decode_rows == 1
    assert (chunks(batch) == [waiting]) is admitted
    assert sched.allocator.num_free == (3 if admitted else 8)


def run_backlog(kv_headroom: float) -> tuple[Scheduler, dict[str, list[int]], int, float]:
    """24 prompts of 8 tokens, 24 output tokens each, 16 may run, a cache of 40 pages of 4 tokens (the 160 tokens of
    5 whole requests) -> (the scheduler, each request's output, the prefill tokens computed, the highest ratio)."""
    sched = make_scheduler(num_pages=41, kv_headroom=kv_headroom)
    reqs = [req(f"r{i}", length=8, t=i, max_new_tokens=24) for i in range(24)]
    for r in reqs:
        sched.add(r)
    prefill_tokens, highest_ratio = 0, 0.0
    while sched.waiting or sched.running:
        batch = sched.schedule()
        highest_ratio = max(highest_ratio, sched.headroom.ratio)
        assert batch is not None, "nothing runnable while requests remain"
        prefill_tokens += sum(batch.num_new_tokens) - batch.num_decode_rows
        finish_prefill(batch)
        for r in batch.reqs:
            if len(r.output_ids) == r.sampling.max_new_tokens:
                sched.finish(r)
    return sched, {r.rid: r.output_ids for r in reqs}, prefill_tokens, highest_ratio


def test_a_cache_that_ran_short_preempts_and_recomputes_less_with_headroom():
    # Admitted as their prompts fit, 16 requests outgrow the 40 pages as they decode, and decode rows preempt. Without
    # headroom the preempted prompts are admitted again as soon as pages free up, and outgrow the cache again (34
    # preemptions, 615 prefill tokens for prompts of 192); with it, admission waits for room (15, 411).
    without, outputs_without, prefill_without, ratio_without = run_backlog(kv_headroom=0.0)
    with_headroom, outputs_with, prefill_with, ratio_with = run_backlog(kv_headroom=0.3)
    assert without.num_preemptions > 0 and ratio_without == 0.0
    assert ratio_with == 0.3 and with_headroom.headroom.ratio == 0.0  # the shortage set it; the idle engine clears it
    assert with_headroom.num_preemptions < without.num_preemptions / 2, (
        with_headroom.num_preemptions,
        without.num_preemptions,
    )
    assert prefill_with < prefill_without, (prefill_with, prefill_without)
    assert outputs_with == outputs_without  # every request ran its whole output either way
    assert all(len(output) == 24 for output in outputs_with.values())
    assert with_headroom.num_pages_held == 0 and without.num_pages_held == 0


def test_a_cache_that_never_runs_short_keeps_no_headroom():
    sched = make_scheduler(num_pages=4096, kv_headroom=0.3)
    for i in range(24):
        sched.add(req(f"r{i}", length=8, t=i, max_new_tokens=24))
    first = sched.schedule()
    assert len(chunks(first)) == 8  # --max-prefill-seqs: as many as the step allows, nothing held back
    assert sched.num_preemptions == 0 and sched.headroom.ratio == 0.0


def test_a_more_urgent_prompt_is_not_held_back_for_less_urgent_running_requests():
    # A decode row short of a page preempts the least urgent request first, so room kept for less urgent requests
    # protects no more urgent one: an urgent prompt is admitted beside it, a prompt of the running requests' own
    # class is not.
    sched = make_scheduler(num_pages=11, kv_headroom=0.3)  # 10 usable pages of 4 tokens
    running = req("running", length=4, t=0, max_new_tokens=33)
    running.priority = 1
    sched.add(running)
    finish_prefill(sched.schedule())
    urgent, peer = req("urgent", length=20, t=1), req("peer", length=20, t=2)  # 5 pages each
    urgent.priority, peer.priority = 0, 1
    sched.add(peer)
    sched.add(urgent)
    sched.headroom.ratio = 0.5  # 32 tokens to come x 0.5: 4 pages kept for "running"
    batch = sched.schedule()
    assert chunks(batch) == [urgent] and list(sched.waiting) == [peer]


def test_with_a_sliding_window_the_headroom_counts_what_is_left_of_each_window():
    sched = Scheduler(
        Buckets.build(16, 64, 256, 4), PageAllocator(11, 4), 16, 64, 8, sliding_window=12, kv_headroom=0.3
    )
    running = req("running", length=12, t=0, max_new_tokens=100)  # past its window: it holds about 3 pages for ever
    sched.add(running)
    finish_prefill(sched.schedule())
    waiting = req("waiting", length=20, t=1)  # 5 pages
    sched.add(waiting)
    sched.headroom.ratio = 0.5  # without the window: 99 tokens to come x 0.5 = 13 pages kept, nothing would fit
    batch = sched.schedule()
    assert chunks(batch) == [waiting]

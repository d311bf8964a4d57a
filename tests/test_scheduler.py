"""Scheduler rules on the host alone: chunked prefill, preemption, LoRA admission order and the starvation bound.

`OneSlotPerStep` is a minimal AdapterSlots: a step may hold one adapter (plus base), and only adapter "hot" is
resident on the device. It stands in for LoRAManager only to make the admission decisions easy to read.
"""

from __future__ import annotations

import pytest

from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.managers.scheduler import MAX_TIMES_SKIPPED, Scheduler
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator
from sgl_jax_lora.model_executor.buckets import Buckets
from sgl_jax_lora.sampling.sampling_params import SamplingParams


class OneSlotPerStep:
    def __init__(self):
        self.step_adapter = None

    def begin_step(self, running: set[str | None]) -> None:
        self.step_adapter = None

    def is_resident(self, key: str | None) -> bool:
        return key in (None, "hot")

    def try_admit(self, key: str | None) -> int | None:
        if key is None:
            return 0
        if self.step_adapter in (None, key):
            self.step_adapter = key
            return 1
        return None


def make_scheduler(num_pages: int = 64, slots=None, max_prefill_seqs: int = 4) -> Scheduler:
    buckets = Buckets.build(8, 32, max_prefill_seqs, 256, 4)
    return Scheduler(buckets, PageAllocator(num_pages, 4), 8, 32, max_prefill_seqs, adapter_slots=slots)


def req(rid: str, length: int = 5, adapter: str | None = None, t: float = 0.0) -> Req:
    return Req(rid=rid, input_ids=list(range(2, 2 + length)), sampling=SamplingParams(max_new_tokens=4), seed=0,
               lora_slot_key=adapter, arrival_time=t)


def finish_prefill(batch) -> None:
    for r, n in zip(batch.reqs, batch.num_new_tokens):
        r.num_computed += n
        if r.num_computed == r.seq_len:
            r.output_ids.append(7)


def test_long_prompt_is_chunked_under_the_token_budget():
    sched = make_scheduler()
    long = req("long", length=70)
    sched.add(long)
    sizes = []
    while long.is_prefilling:
        batch = sched.schedule()
        assert not batch.is_decode
        sizes.append(sum(batch.num_new_tokens))
        finish_prefill(batch)
    assert sizes == [32, 32, 6]
    assert sched.schedule().is_decode


def test_adapter_that_cannot_join_does_not_block_the_queue():
    sched = make_scheduler(slots=OneSlotPerStep())
    for i, adapter in enumerate(["a", "b", None, "a"]):
        sched.add(req(f"r{i}", adapter=adapter, t=i))
    batch = sched.schedule()
    assert [r.rid for r in batch.reqs] == ["r2", "r0", "r3"]  # base first (resident), then "a"; "b" skipped
    assert [r.rid for r in sched.waiting] == ["r1"]
    finish_prefill(batch)


def test_resident_adapters_are_tried_first():
    sched = make_scheduler(slots=OneSlotPerStep(), max_prefill_seqs=1)
    sched.add(req("cold", adapter="cold", t=0))
    sched.add(req("hot", adapter="hot", t=1))
    assert [r.rid for r in sched.schedule().reqs] == ["hot"]


def test_a_request_passed_over_too_often_goes_first():
    sched = make_scheduler(slots=OneSlotPerStep(), max_prefill_seqs=1)
    starving = req("cold", adapter="cold", t=0)
    sched.add(starving)
    for i in range(MAX_TIMES_SKIPPED + 3):
        sched.add(req(f"hot{i}", adapter="hot", t=1 + i))
        batch = sched.schedule()
        if starving in batch.reqs:
            break
        finish_prefill(batch)
        for r in list(sched.running):
            sched.finish(r)
    assert starving in batch.reqs
    assert starving.times_skipped == MAX_TIMES_SKIPPED + 1


def test_decode_out_of_pages_preempts_the_newest_request():
    sched = make_scheduler(num_pages=5)  # 4 usable pages of 4 tokens
    old, new = req("old", length=8, t=0), req("new", length=7, t=1)
    sched.add(old)
    sched.add(new)
    finish_prefill(sched.schedule())  # both prefilled: 2 pages each, every page used
    batch = sched.schedule()  # "old" needs a third page for its 9th token
    assert batch.is_decode and batch.reqs == [old]
    assert list(sched.waiting) == [new] and new.num_computed == 0 and new.pages == []
    assert sched.num_preemptions == 1


def test_bucket_flags_add_the_limit_and_refuse_nonpositive_sizes():
    buckets = Buckets.build(64, 2048, 8, 1024, 16, decode_batch_buckets=[64], prefill_token_buckets=[2048],
                            decode_page_buckets=[32], prefill_seq_buckets=[2])
    assert buckets.decode_seqs == (64,)
    assert buckets.prefill_tokens == (1024,)  # 2048 is capped at the context length, not dropped
    assert buckets.prefill_seqs == (2, 8)  # the largest (--max-prefill-seqs) is always compiled
    assert buckets.decode_pages == (32, 64)
    assert Buckets.build(64, 2048, 8, 1024, 16).prefill_seqs == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="--prefill-seq-buckets must be positive"):
        Buckets.build(64, 2048, 8, 1024, 16, prefill_seq_buckets=[0, 8])

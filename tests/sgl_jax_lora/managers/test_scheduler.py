"""Scheduler rules on the host alone: chunked prefill, preemption, LoRA admission order and the starvation bound.

`OneSlotPerStep` and `DeviceSlots` are minimal AdapterSlots standing in for LoRAManager, to make the admission
decisions easy to read: the first lets a step hold one adapter (plus base); the second has a fixed number of
device slots with LoRAManager's rules (adapters of running requests and those in `keep` are never evicted,
otherwise the least recently used goes).
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from pallas_kernels.sgmv.entry_table import entries_needed
from sgl_jax_lora.configs.buckets import MIN_PREFILL_TOKENS, Buckets
from sgl_jax_lora.lora.adapter_plan import AdapterPlan
from sgl_jax_lora.managers.in_flight import InFlightTokens
from sgl_jax_lora.managers.scheduler import Scheduler
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator
from tests.support.scheduler_steps import chunks, finish_prefill, req


class OneSlotPerStep:
    def __init__(self):
        self.step_adapter = None

    def plan_step(self, running: set[str | None]) -> AdapterPlan:
        self.step_adapter = None
        return AdapterPlan(running=frozenset(k for k in running if k is not None))

    def reserve(self, plan: AdapterPlan, key: str | None, keep: frozenset = frozenset()) -> int | None:
        if key is None:
            return 0
        if self.step_adapter in (None, key):
            self.step_adapter = key
            plan.adapters.add(key)
            return 1
        return None

    def can_evict(self, key: str) -> bool:
        return True

    max_per_batch = 1

    def is_resident(self, key: str) -> bool:
        return key == self.step_adapter


class DeviceSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.resident: collections.OrderedDict[str, None] = collections.OrderedDict()  # least recently used first
        self.loads = 0

    def plan_step(self, running: set[str | None]) -> AdapterPlan:
        return AdapterPlan(running=frozenset(k for k in running if k is not None))

    def reserve(self, plan: AdapterPlan, key: str | None, keep: frozenset = frozenset()) -> int | None:
        if key is None:
            return 0
        if key not in self.resident:
            if len(self.resident) == self.num_slots:
                busy = plan.adapters | plan.running
                victims = [k for k in self.resident if k not in busy and k not in keep]
                if not victims:
                    return None
                del self.resident[victims[0]]
            self.loads += 1
        self.resident[key] = None
        self.resident.move_to_end(key)
        plan.adapters.add(key)
        return 1 + list(self.resident).index(key)

    def can_evict(self, key: str) -> bool:
        return True

    @property
    def max_per_batch(self) -> int:
        return self.num_slots

    def is_resident(self, key: str) -> bool:
        return key in self.resident


class FixedSlots(DeviceSlots):
    """Every adapter resident in a slot of its own for good."""

    def __init__(self, slot_of: dict[str, int]):
        super().__init__(num_slots=len(slot_of))
        self.slot_of = slot_of

    def reserve(self, plan: AdapterPlan, key: str | None, keep: frozenset = frozenset()) -> int | None:
        if key is not None:
            plan.adapters.add(key)
        return self.slot_of.get(key, 0)


def make_scheduler(num_pages: int = 64, slots=None, max_prefill_seqs: int = 4) -> Scheduler:
    buckets = Buckets.build(8, 32, 256, 4)
    return Scheduler(buckets, PageAllocator(num_pages, 4), 8, 32, max_prefill_seqs, adapter_slots=slots)


def test_long_prompt_is_chunked_under_the_token_budget():
    sched = make_scheduler()
    long = req("long", length=70)
    sched.add(long)
    sizes = []
    while long.is_prefilling:
        batch = sched.schedule()
        assert batch.kind == "extend"
        sizes.append(sum(batch.num_new_tokens))
        finish_prefill(batch)
    assert sizes == [32, 32, 6]
    assert sched.schedule().kind == "decode"


def test_an_admission_joins_the_running_decodes_in_one_step():
    # a prompt that arrives while others decode is prefilled in the same step as their decode rows, under the
    # step's token budget (64) less those rows
    sched = Scheduler(Buckets.build(8, 64, 256, 4), PageAllocator(64, 4), 8, 64, 4)
    running = [req(f"r{i}", length=3, t=i, max_new_tokens=8) for i in range(3)]
    for r in running:
        sched.add(r)
    finish_prefill(sched.schedule())
    late = req("late", length=100, t=9)
    sched.add(late)
    batch = sched.schedule()
    assert batch.kind == "mixed" and batch.reqs[:3] == running and chunks(batch) == [late]
    assert batch.num_new_tokens == [1, 1, 1, 61]  # 64 tokens: 3 decode rows, then the chunk
    finish_prefill(batch)
    assert [len(r.output_ids) for r in running] == [2, 2, 2]


def test_decode_rows_come_grouped_by_adapter_slot_in_running_order():
    # requests of three adapters and base, interleaved in arrival order: each step's decode rows are one run per
    # slot (base first), in running order within a slot, so the GEMM with the LoRA inside it meets each adapter
    # once per row tile instead of once per row
    sched = make_scheduler(slots=FixedSlots({"a": 1, "b": 2, "c": 3}))
    adapters = ["a", "b", None, "c"] * 2
    running = [req(f"r{i}", length=3, adapter=a, t=i, max_new_tokens=8) for i, a in enumerate(adapters)]
    for r in running:
        sched.add(r)
    while any(r.is_prefilling or not r.output_ids for r in running):
        finish_prefill(sched.schedule())
    batch = sched.schedule()
    assert batch.kind == "decode" and batch.token_slots == sorted(batch.token_slots)
    for slot in set(batch.token_slots):
        rows = [r for r, s in zip(batch.reqs, batch.token_slots) if s == slot]
        assert rows == [r for r in running if r in rows]  # running order within the slot
    slot_scale = np.array([0.0, 1.0, 1.0, 1.0])  # slot 0 is base: no LoRA run
    slot_of = dict(zip(batch.reqs, batch.token_slots))
    assert entries_needed(batch.token_slots, slot_scale, tile_m=128) == 3
    assert entries_needed([slot_of[r] for r in running], slot_scale, tile_m=128) == 6  # rows in running order


def test_decode_rows_leave_the_floor_of_prefill_tokens():
    # with the step's budget taken by decode rows, a chunk still gets MIN_PREFILL_TOKENS
    sched = make_scheduler()  # budget 32, 8 running
    running = [req(f"r{i}", length=3, t=i, max_new_tokens=8) for i in range(7)]
    for r in running:
        sched.add(r)
    while any(r.is_prefilling or not r.output_ids for r in running):
        finish_prefill(sched.schedule())
    sched.add(req("late", length=100, t=9))
    batch = sched.schedule()
    assert batch.num_new_tokens == [1] * 7 + [MIN_PREFILL_TOKENS]
    assert batch.num_tokens <= sched.buckets.tokens[-1]


def test_adapter_that_cannot_join_does_not_block_the_queue():
    sched = make_scheduler(slots=OneSlotPerStep())
    for i, adapter in enumerate(["a", "b", None, "a"]):
        sched.add(req(f"r{i}", adapter=adapter, t=i))
    batch = sched.schedule()
    assert [r.rid for r in batch.reqs] == ["r0", "r2", "r3"]  # arrival order; "b" skipped
    assert [r.rid for r in sched.waiting] == ["r1"]
    finish_prefill(batch)


def test_admission_keeps_arrival_order_when_slots_are_free():
    slots = DeviceSlots(num_slots=2)
    slots.resident["hot"] = None  # left on the device by an earlier request
    sched = make_scheduler(slots=slots, max_prefill_seqs=1)
    sched.add(req("cold", adapter="cold", t=0))
    sched.add(req("hot", adapter="hot", t=1))
    assert [r.rid for r in sched.schedule().reqs] == ["cold"]


def test_adapter_wanted_by_a_waiting_request_is_not_evicted():
    slots = DeviceSlots(num_slots=1)
    slots.resident["hot"] = None
    sched = make_scheduler(slots=slots, max_prefill_seqs=1)
    sched.add(req("cold", adapter="cold", t=0))
    sched.add(req("hot", adapter="hot", t=1))
    # "cold" would have to evict "hot", which the waiting request "hot" wants: it is skipped, not thrashed
    assert [r.rid for r in sched.schedule().reqs] == ["hot"]
    assert list(slots.resident) == ["hot"] and slots.loads == 0


def run_to_completion(sched: Scheduler, output_len: int) -> int:
    """Drives the scheduler as the engine loop does, every request decoding `output_len` tokens; -> steps with decode
    rows."""
    decode_steps = 0
    while sched.waiting or sched.running:
        batch = sched.schedule()
        assert batch is not None, "nothing runnable while requests remain"
        decode_steps += batch.num_decode_rows > 0
        finish_prefill(batch)
        for r in batch.reqs:
            if len(r.output_ids) == output_len:
                sched.finish(r)
    return decode_steps


def run_backlog(
    adapters,
    slots,
    max_running: int,
    output_len: int,
    chunk: int = 32,
    max_prefill_seqs: int = 4,
    num_pages: int = 4096,
) -> tuple[int, int]:
    """A backlog of 3-token prompts, one per entry of `adapters`, all at once with equal outputs, run to the end
    -> (decode steps, the fewest the running limit allows)."""
    sched = Scheduler(
        Buckets.build(max_running, chunk, 256, 4),
        PageAllocator(num_pages, 4),
        max_running,
        chunk,
        max_prefill_seqs,
        adapter_slots=slots,
    )
    for i, adapter in enumerate(adapters):
        sched.add(req(f"r{i}", length=3, adapter=f"a{adapter}", t=i, max_new_tokens=output_len))
    fewest = len(adapters) * (output_len - 1) // max_running  # the first token of each comes from its prefill
    return run_to_completion(sched, output_len), fewest


def skewed_adapters() -> np.ndarray:
    """128 requests' adapters over 200, Zipf 1.5 (bench_serving's "skewed"): 37 distinct, a few popular."""
    popularity = 1.0 / np.arange(1, 201) ** 1.5
    return np.random.default_rng(0).choice(200, size=128, p=popularity / popularity.sum())


def test_skewed_backlog_keeps_the_running_batch_full():
    # A backlog over many adapters, a few popular (Zipf 1.5, as bench_serving's "skewed"), more distinct adapters
    # than device slots, all outputs equally long. Packing admission (the popular adapters fill the batch, the spare
    # slots take turns among the rare ones) needs the fewest decode steps the running-request limit allows, 504.
    # Admission in plain arrival order took 567, and resident adapters first 630: both left rare adapters to the end,
    # where 8 slots cap a step at 8 requests while 16 may run.
    adapters = skewed_adapters()
    num_slots, max_running, output_len = 8, 16, 64
    num_distinct = len(set(adapters.tolist()))
    assert num_distinct > 4 * num_slots
    slots = DeviceSlots(num_slots)
    decode_steps, fewest = run_backlog(adapters, slots, max_running, output_len)
    assert decode_steps <= 1.05 * fewest, (decode_steps, fewest)
    # a popular adapter may leave the device between turns, but reloads stay few (43 loads for 37 adapters here)
    assert slots.loads <= 1.25 * num_distinct, (slots.loads, num_distinct)


def test_adapters_left_on_the_device_do_not_decide_the_packing():
    # The same backlog arriving after an earlier workload left the 8 most popular adapters on the device (as when
    # bench_serving's 32-distinct scenario precedes the skewed one). All 8 are wanted by waiting requests; if that
    # kept them from being evicted for the adapters the plan chose, the first turn of every slot would go to them
    # and the rare adapters would pile up at the end again (567 decode steps here instead of 504).
    adapters = skewed_adapters()
    num_slots, max_running, output_len = 8, 16, 64
    slots = DeviceSlots(num_slots)
    for key in range(num_slots):
        slots.resident[f"a{key}"] = None
    decode_steps, fewest = run_backlog(adapters, slots, max_running, output_len)
    assert decode_steps <= 1.05 * fewest, (decode_steps, fewest)


def test_a_request_overtaken_by_more_than_a_batch_goes_first():
    slots = DeviceSlots(num_slots=1)
    slots.resident["hot"] = None  # and a stream of requests keeps wanting it
    sched = make_scheduler(slots=slots, max_prefill_seqs=1)
    starving = req("cold", adapter="cold", t=0)
    sched.add(starving)
    for i in range(sched.max_running + 3):
        sched.add(req(f"hot{i}", adapter="hot", t=1 + i))
        batch = sched.schedule()
        if starving in batch.reqs:
            break
        finish_prefill(batch)
        for r in list(sched.running):
            sched.finish(r)
    assert starving in batch.reqs
    assert starving.times_overtaken == sched.max_running + 1


def starved_behind_two_running_adapters(starved_priority: int = 0):
    """Two slots held by running requests of adapters a and b (b's finishes first), a starved request for c waiting,
    and a waiting request for each of a and b. -> (scheduler, slots, running b, the starved request, more a, more b)"""
    slots = DeviceSlots(num_slots=2)
    sched = make_scheduler(slots=slots)
    running_a = req("run-a", adapter="a", max_new_tokens=8)
    running_b = req("run-b", adapter="b", max_new_tokens=4)
    for r in (running_a, running_b):
        sched.add(r)
    finish_prefill(sched.schedule())
    starved = req("starved-c", adapter="c", t=1)
    starved.priority = starved_priority
    starved.times_overtaken = sched.max_running + 1
    more_a, more_b = req("more-a", adapter="a", t=2), req("more-b", adapter="b", t=3)
    for r in (starved, more_a, more_b):
        sched.add(r)
    return sched, slots, running_b, starved, more_a, more_b


def test_a_starved_request_drains_one_slot_while_others_keep_joining():
    # Both slots are held by running requests and both adapters are wanted by waiting requests. The starved request
    # drains the adapter that can finish first (b); a's waiting request still joins, b's waits. Blocking all
    # admission instead would leave the batch to empty while the starved request waits for a slot.
    sched, slots, running_b, starved, more_a, more_b = starved_behind_two_running_adapters()
    batch = sched.schedule()
    assert chunks(batch) == [more_a]
    assert sched.draining == {"b"} and list(sched.waiting) == [starved, more_b]
    finish_prefill(batch)

    sched.finish(running_b)  # b's last running request ends: its slot is free for the starved request
    batch = sched.schedule()
    assert chunks(batch) == [starved]
    assert not sched.draining and "b" not in slots.resident


def test_a_request_that_reached_the_engine_late_keeps_its_place():
    # The frontend stamps when a request came in; one whose adapter had to be registered first reaches the engine
    # after requests that came in later, and is queued ahead of them.
    sched = make_scheduler()
    first, late, last = req("first", t=0.0), req("late", t=1.0), req("last", t=2.0)
    for r in (first, last, late):
        sched.add(r)
    assert list(sched.waiting) == [first, late, last]


def test_a_pinned_adapter_is_never_drained():
    class PinnedSlots(DeviceSlots):
        def can_evict(self, key: str) -> bool:
            return key != "pinned"

    slots = PinnedSlots(num_slots=1)
    sched = make_scheduler(slots=slots)
    sched.add(req("run-pinned", adapter="pinned"))
    finish_prefill(sched.schedule())
    starved = req("starved", adapter="other", t=1)
    starved.times_overtaken = sched.max_running + 1
    sched.add(starved)
    sched.add(req("more-pinned", adapter="pinned", t=2))
    batch = sched.schedule()
    assert [r.rid for r in chunks(batch)] == ["more-pinned"] and not sched.draining


def test_more_adapters_than_slots_keep_the_batch_full():
    # 12 adapters over 8 slots, 64 running requests, equal outputs. When every slot is held by running requests,
    # a starved request drains one adapter and the others keep joining, so the batch stays full: the fewest steps
    # the running limit allows (124 here; blocking all admission for the starved request would empty the batch).
    rng = np.random.default_rng(0)
    adapters = rng.integers(0, 12, 256)
    num_slots, max_running, output_len = 8, 64, 32
    decode_steps, fewest = run_backlog(
        adapters, DeviceSlots(num_slots), max_running, output_len, chunk=256, max_prefill_seqs=64, num_pages=8192
    )
    assert decode_steps <= 1.05 * fewest, (decode_steps, fewest)


def test_a_request_whose_last_token_is_in_flight_is_not_scheduled_again():
    # Overlap schedule: the step that samples a request's last allowed token is advanced before the token lands.
    sched = make_scheduler()
    last, more = req("last", max_new_tokens=2), req("more", max_new_tokens=3)
    for r in (last, more):
        sched.add(r)
    finish_prefill(sched.schedule())
    assert [r.rid for r in sched.schedule().reqs] == ["last", "more"]
    tokens_in_flight = InFlightTokens()
    for row, r in enumerate((last, more)):
        r.num_computed += 1
        tokens_in_flight.add(r, step=1, row=row)
    assert last.out_of_new_tokens and not more.out_of_new_tokens
    assert [r.rid for r in sched.schedule().reqs] == ["more"]
    tokens_in_flight.pop(last)
    last.output_ids.append(7)
    sched.finish(last)  # its token lands: length stop
    assert sched.running == [more]


@pytest.mark.parametrize("old_length, new_length", [(8, 7), (7, 8)])  # the old or the new one needs the page
def test_decode_out_of_pages_preempts_the_newest_request_itself_included(old_length, new_length):
    sched = make_scheduler(num_pages=5)  # 4 usable pages of 4 tokens
    old, new = req("old", length=old_length, t=0), req("new", length=new_length, t=1)
    sched.add(old)
    sched.add(new)
    finish_prefill(sched.schedule())  # both prefilled: 2 pages each, every page used
    batch = sched.schedule()  # the one of 8 tokens needs a third page for its 9th token
    assert batch.kind == "decode" and batch.reqs == [old]  # "new" is not admitted again in the step that preempted it
    assert list(sched.waiting) == [new] and new.num_computed == 0 and new.pages == []
    assert sched.num_preemptions == 1 and len(old.pages) == old_length // 4 + 1


def test_among_requests_of_one_arrival_time_the_last_received_is_preempted():
    # The prompts (and n samples) of one call share an arrival time; the scheduler's order of receipt breaks the tie.
    sched = make_scheduler(num_pages=7)  # 6 usable pages of 4 tokens
    first, second, third = req("first", length=8), req("second", length=7), req("third", length=7)
    for r in (first, second, third):
        sched.add(r)
    finish_prefill(sched.schedule())  # 2 pages each, every page used
    assert [r.arrival_time for r in (first, second)] == [third.arrival_time] * 2
    batch = sched.schedule()  # "first" needs a third page for its 9th token
    assert batch.reqs == [first, second] and list(sched.waiting) == [third] and sched.num_preemptions == 1


@pytest.mark.parametrize(
    "lazy_first, lazy_length, urgent_length",
    # the one that prefills first decodes a token while the other prefills; then one of them needs a third page
    [(True, 7, 7), (True, 6, 8), (False, 8, 6), (False, 6, 7)],
)
def test_out_of_pages_the_lazy_request_is_preempted_whichever_needs_the_page(lazy_first, lazy_length, urgent_length):
    sched = make_scheduler(num_pages=5)  # 4 usable pages of 4 tokens
    lazy, urgent = req("lazy", length=lazy_length, t=0), req("urgent", length=urgent_length, t=1)
    lazy.priority = 10
    for r in (lazy, urgent) if lazy_first else (urgent, lazy):
        sched.add(r)
        finish_prefill(sched.schedule())
    assert sched.allocator.num_free == 0 and not sched.waiting
    assert sched.running == ([lazy, urgent] if lazy_first else [urgent, lazy])
    batch = sched.schedule()
    assert batch.reqs == [urgent]
    assert list(sched.waiting) == [lazy] and lazy.pages == [] and sched.num_preemptions == 1


def test_token_buckets_cover_every_step_and_refuse_nonpositive_sizes():
    buckets = Buckets.build(64, 2048, 1024, 16, token_buckets=[64, 4096])
    assert buckets.tokens == (64, 2048)  # 4096 is capped at the largest step (the step's budget), not dropped
    assert buckets.max_pages_per_seq == 64
    assert [s for s, _ in buckets.shapes()] == [64, 64]
    default = Buckets.build(64, 1024, 1024, 16)  # ServerArgs.step_token_budget: 2048 capped at a 1024 context
    assert default.tokens == (8, 16, 32, 64, 128, 256, 512, 1024)
    assert default.sample_sizes() == (8, 16, 32, 64)  # a step's sequences: at most its tokens and the running limit
    # every running request's decode row plus MIN_PREFILL_TOKENS fit the largest step
    assert Buckets.build(256, 128, 1024, 16).tokens[-1] == 256 + 32
    with pytest.raises(ValueError, match="--token-buckets must be positive"):
        Buckets.build(64, 2048, 1024, 16, token_buckets=[0, 8])

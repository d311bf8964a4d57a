"""LoRAManager (managers/lora_manager.py) plans, then applies: reserving an adapter's device slot for a step is host
bookkeeping (the slot table, the slot arrays made ready), and the device is written only by `apply`, which
EngineCore calls after scheduling and before the launch. Here the manager drives a runner that records its slot
writes (no model, no device), alone and under Scheduler.schedule(). Last, the compiled segment buckets
(`segment_buckets`)."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.lora.host_cache import HostAdapter, HostAdapterCache
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.prefetch_queue import PrefetchQueue
from sgl_jax_lora.managers.adapter_staging import StagedSlotArrays
from sgl_jax_lora.managers.lora_manager import LoRAManager, segment_buckets
from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.managers.scheduler import Scheduler
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator
from sgl_jax_lora.sampling.sampling_params import SamplingParams


class RecordingRunner:
    """The runner calls the manager makes: slot arrays are tagged with their adapter's name; writes are recorded."""

    cfg = None
    dtype = np.dtype(np.float32)

    def __init__(self):
        self.writes: list[tuple[int, str]] = []  # (slot, adapter name)
        self.stage_failures: set[str] = set()  # adapter names whose staging on the device raises

    def stage_lora_slot_values(self, values: list[np.ndarray]) -> list[np.ndarray]:
        if values[0].item() in self.stage_failures:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of device memory")
        return list(values)

    def lora_buffer_shapes(self) -> dict:
        return {}

    def lora_slot_values(self, update: dict) -> list[np.ndarray]:
        return [np.zeros(1)]

    def write_lora_slot(self, slot: int, values: list[np.ndarray]) -> None:
        self.writes.append((slot, values[0].item() if values[0].dtype.kind == "U" else "zeros"))


def make_manager(max_loras_per_batch: int = 2, gone: frozenset[str] = frozenset()):
    """A manager over a RecordingRunner; adapters named in `gone` cannot be read."""

    def lay_out(ref: LoRARef) -> HostAdapter:
        if ref.lora_name in gone:
            raise LoRAAdapterError(f"adapter '{ref.lora_name}': adapter_model.safetensors is gone; load it again")
        # the slot arrays carry the adapter's name, so that a recorded write says whose arrays went where
        return HostAdapter(ref.lora_name, 8, 2.0, [np.asarray(ref.lora_name)])

    runner = RecordingRunner()
    args = types.SimpleNamespace(
        max_loras_per_batch=max_loras_per_batch,
        tp_size=1,
        max_loaded_loras=None,
        lora_host_cache_gib=None,
        lora_eviction_policy="lru",
        lora_segment_buckets=None,
        disable_lora_base_program=False,
        max_prefill_seqs=8,
    )
    summary = types.SimpleNamespace(rank=8, target_modules=frozenset())
    manager = LoRAManager(args, runner, None, 8, frozenset(), None, lambda ref: summary)
    manager.host_cache = HostAdapterCache(None, lay_out)  # no weights to read or lay out
    return manager, runner


def register(manager: LoRAManager, *names: str) -> dict[str, str]:
    ids = {}
    for name in names:
        ref = LoRARef(lora_name=name, lora_path=f"/adapters/{name}")
        manager.register(ref)
        ids[name] = ref.lora_id
    return ids


def test_reserving_a_slot_writes_nothing_until_apply():
    manager, runner = make_manager()
    ids = register(manager, "a", "b")
    plan = manager.plan_step(set())
    assert manager.reserve(plan, ids["a"]) == 1 and manager.reserve(plan, ids["b"]) == 2
    assert manager.reserve(plan, ids["a"]) == 1 and manager.reserve(plan, None) == 0  # in the plan already; base
    assert runner.writes == []  # planned: the slot table holds them, the device not yet
    assert manager.pool.slot_of == {ids["a"]: 1, ids["b"]: 2} and plan.adapters == {ids["a"], ids["b"]}
    assert [(w.slot, w.lora_id) for w in plan.slot_writes] == [(1, ids["a"]), (2, ids["b"])]
    assert (manager.device_misses, manager.device_hits, len(manager.load_latencies_s)) == (2, 0, 0)
    manager.apply(plan.slot_writes)
    assert runner.writes == [(1, "a"), (2, "b")]
    assert len(manager.load_latencies_s) == 2 and manager.load_seconds_total == sum(manager.load_latencies_s)
    plan = manager.plan_step({ids["a"]})
    assert manager.reserve(plan, ids["a"]) == 1 and plan.slot_writes == []  # on the device: nothing to write
    assert (manager.device_misses, manager.device_hits) == (2, 1)


def test_eviction_is_planned_and_spares_running_and_kept_adapters():
    manager, runner = make_manager(max_loras_per_batch=2)
    ids = register(manager, "a", "b", "c")
    plan = manager.plan_step(set())
    manager.reserve(plan, ids["a"])
    manager.reserve(plan, ids["b"])
    manager.apply(plan.slot_writes)
    plan = manager.plan_step({ids["a"]})  # "a" running: its slot stays put
    assert manager.reserve(plan, ids["c"], keep=frozenset({ids["b"]})) is None  # "b" kept for a waiting request
    assert manager.reserve(plan, ids["c"]) == 2  # evicts "b", in the slot table only
    assert manager.pool.slot_of == {ids["a"]: 1, ids["c"]: 2} and manager.pool.num_evictions == 1
    assert runner.writes == [(1, "a"), (2, "b")]
    assert manager.reserve(plan, ids["b"]) is None  # the step holds max_loras_per_batch adapters
    manager.apply(plan.slot_writes)
    assert runner.writes[-1] == (2, "c")


def test_a_plan_that_is_never_applied_is_forgotten():
    # the step failed between planning and applying: the slots it reserved hold other weights on the device
    manager, runner = make_manager()
    ids = register(manager, "a")
    plan = manager.plan_step(set())
    manager.reserve(plan, ids["a"])
    plan = manager.plan_step(set())
    assert manager.pool.slot_of == {} and not manager.is_resident(ids["a"])
    assert manager.reserve(plan, ids["a"]) == 1 and len(plan.slot_writes) == 1  # loaded again
    manager.apply(plan.slot_writes)
    assert runner.writes == [(1, "a")]


def test_a_failed_slot_write_leaves_the_slot_table_as_the_device_is():
    manager, runner = make_manager()
    ids = register(manager, "a", "b")
    plan = manager.plan_step(set())
    manager.reserve(plan, ids["a"])
    manager.reserve(plan, ids["b"])

    def fault(slot, values):
        raise RuntimeError("device fault")

    runner.write_lora_slot = fault
    with pytest.raises(RuntimeError, match="device fault"):
        manager.apply(plan.slot_writes)
    assert manager.pool.slot_of == {}


def req(rid: str, adapter: str | None, t: float) -> Req:
    return Req(
        rid=rid,
        input_ids=list(range(2, 8)),
        sampling=SamplingParams(max_new_tokens=4),
        seed=0,
        lora_slot_key=adapter,
        arrival_time=t,
    )


def test_schedule_is_a_plan_without_device_writes():
    manager, runner = make_manager(max_loras_per_batch=2, gone=frozenset({"gone"}))
    ids = register(manager, "a", "b", "gone")
    sched = Scheduler(Buckets.build(8, 32, 256, 4), PageAllocator(64, 4), 8, 32, 4, adapter_slots=manager)
    for i, key in enumerate([ids["a"], None, ids["gone"], ids["b"], ids["a"]]):
        sched.add(req(f"r{i}", key, t=i))
    plan = sched.schedule()
    assert runner.writes == []
    slot_of = {r.rid: slot for r, slot in zip(plan.reqs, plan.token_slots)}
    assert slot_of == {"r0": 1, "r1": 0, "r3": 2, "r4": 1}
    assert [(w.slot, w.lora_id) for w in plan.slot_writes] == [(1, ids["a"]), (2, ids["b"])]
    # the adapter that cannot be read rejects its request alone, while planning
    [(rejected, message)] = sched.pop_rejected()
    assert rejected.rid == "r2" and "adapter 'gone'" in message
    manager.apply(plan.slot_writes)
    assert runner.writes == [(1, "a"), (2, "b")]


def test_segment_buckets_default_and_flag() -> None:
    assert segment_buckets(33) == (4, 33)
    assert segment_buckets(3) == (3,)
    assert segment_buckets(9) == (9,)  # a small pool: one bucket (each bucket is a compiled program per token bucket)
    assert segment_buckets(17) == (4, 17)
    # --lora-segment-buckets: sorted, capped at the slot count, which is always compiled
    assert segment_buckets(129, [33, 4, 33]) == (4, 33, 129)
    assert segment_buckets(9, [64]) == (9,)
    with pytest.raises(ValueError, match="--lora-segment-buckets"):
        segment_buckets(9, [0])


def test_a_header_check_done_ahead_is_not_repeated():
    """`inspect_ahead` runs the header check on a worker thread; registering with its result reads nothing again,
    and still refuses an adapter whose targets the pool does not cover."""
    manager, _ = make_manager()
    checked = []
    manager.inspect = lambda ref: (
        checked.append(ref.lora_name) or types.SimpleNamespace(rank=8, target_modules=frozenset())
    )
    ref = LoRARef(lora_name="a", lora_path="/adapters/a")
    summary = manager.inspect_ahead(ref).result(timeout=5)
    assert checked == ["a"]
    assert manager.register(ref, summary) is summary and ref.lora_id in manager.refs
    assert checked == ["a"]  # not read a second time
    uncovered = types.SimpleNamespace(rank=8, target_modules=frozenset({"q_proj"}))
    with pytest.raises(LoRAAdapterError, match="does not cover"):
        manager.register(LoRARef(lora_name="b", lora_path="/adapters/b"), uncovered)


def test_prefetched_adapters_wait_on_the_device_within_the_staging_budget():
    """A prefetch stages its adapter's slot arrays on the device (the engine loop's write then copies device to
    device) while fewer than the staging budget's staged arrays are alive; past it, or when staging fails, the host
    arrays, which the write copies itself. Staged arrays give their budget back once freed."""
    manager, runner = make_manager(max_loras_per_batch=4)
    manager.staging.budget = 2
    ids = register(manager, "a", "b", "c", "d")
    runner.stage_failures.add("d")
    for name in "abc":
        manager.prefetch(ids[name])
    manager.wait_for_prefetches()
    staged = sorted(n for n in "abc" if isinstance(manager._prefetches[ids[n]].result()[1], StagedSlotArrays))
    assert len(staged) == 2 and manager.staging.num_staged == 2
    stats = manager.stats()
    assert stats["prefetches"] == 3 and stats["prefetch_s"] >= stats["staging_s"] > 0
    plan = manager.plan_step(set())
    assert [manager.reserve(plan, ids[n]) for n in "abc"] == [1, 2, 3]
    manager.apply(plan.slot_writes)
    assert runner.writes == [(1, "a"), (2, "b"), (3, "c")] and manager.stats()["staged_slot_writes"] == 2
    del plan  # the step is done: its slot writes and their staged arrays go
    assert manager.staging.num_staged == 0
    manager.prefetch(ids["d"])  # staging fails: the host arrays, and no budget kept
    manager.wait_for_prefetches()
    assert (
        not isinstance(manager._prefetches[ids["d"]].result()[1], StagedSlotArrays) and manager.staging.num_staged == 0
    )
    plan = manager.plan_step(set())
    assert manager.reserve(plan, ids["d"]) == 4
    manager.apply(plan.slot_writes)
    assert runner.writes[-1] == (4, "d") and manager.staged_writes == 2


def test_adapters_are_read_in_the_order_of_their_requests_priority():
    """With one prefetch thread busy, the adapters asked for next are read most urgent request first; a more urgent
    request for an adapter still waiting moves its read forward; one on the device is not read again."""
    manager, _ = make_manager(max_loras_per_batch=4)
    manager._prefetcher = PrefetchQueue(max_workers=1)
    ids = register(manager, "hold", "a", "b", "c", "d")
    read, started, release = [], threading.Event(), threading.Event()
    arrays_of = manager._host_slot_arrays

    def slow_read(ref):
        read.append(ref.lora_name)
        if ref.lora_name == "hold":
            started.set()
            assert release.wait(10)
        return arrays_of(ref)

    manager._host_slot_arrays = slow_read
    manager.prefetch(ids["hold"])
    assert started.wait(10)
    manager.prefetch(ids["a"], 0)
    manager.prefetch(ids["b"], 0)
    manager.prefetch(ids["c"], -1)
    manager.prefetch(ids["b"], -2)  # an urgent request for b, whose read still waits
    manager.prefetch(ids["d"])  # fcfs requests carry 0
    release.set()
    manager.wait_for_prefetches()
    assert read == ["hold", "b", "c", "a", "d"]
    plan = manager.plan_step(set())
    assert manager.reserve(plan, ids["b"]) is not None
    manager.prefetch(ids["b"], -9)  # on the device now: nothing to read
    manager.wait_for_prefetches()
    assert read == ["hold", "b", "c", "a", "d"]


def test_a_pin_waits_for_a_slot_that_running_requests_hold_and_takes_the_first_freed():
    # an update of a pinned adapter while requests of every other slot's adapter run: refused before, now it waits
    manager, runner = make_manager(max_loras_per_batch=2)
    ids = register(manager, "a", "b")
    plan = manager.plan_step(set())
    manager.reserve(plan, ids["a"])
    manager.reserve(plan, ids["b"])
    manager.apply(plan.slot_writes)
    manager.plan_step({ids["a"], ids["b"]})  # both running
    pinned = LoRARef(lora_name="p", lora_path="/adapters/p", pinned=True)
    manager.register(pinned)
    assert pinned.lora_id not in manager.pool.slot_of and manager.stats()["pinned"] == 1
    with pytest.raises(LoRAAdapterError, match="at most 1 adapters may be pinned"):  # the waiting pin counts
        manager.register(LoRARef(lora_name="q", lora_path="/adapters/q", pinned=True))
    manager.plan_step({ids["a"]})  # "b" finished: its slot goes to the waiting pin at once
    assert manager.pool.slot_of[pinned.lora_id] == 2 and pinned.lora_id in manager.pool.pinned
    assert runner.writes[-1] == (2, "p")
    plan = manager.plan_step(set())
    assert manager.reserve(plan, ids["b"]) == 1  # evicts "a", never the pinned adapter
    manager.unregister(pinned.lora_id)
    assert manager.stats()["pinned"] == 0

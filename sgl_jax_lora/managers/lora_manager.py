"""LoRAManager: the engine process's side of multi-LoRA: registered adapters, host cache, device slots.

Flow: EngineCore.add_request -> `prefetch(lora_id, priority)`: an adapter that is not on the device is read from disk,
laid out as slot arrays (model dtype) into the host cache (which keeps those, not the weights read) and staged on the
device (a bounded number at a time: managers/adapter_staging.py) on a background thread (lora/prefetch_queue.py: the
most urgent request's adapter first), so the engine loop never waits on disk or on a host-to-device copy for it.
Scheduler.schedule() plans a step: `plan_step(running adapters)` then `reserve(plan, lora_id, keep)` for each
request it considers: the adapter's device slot, or None when the step already holds --max-loras-per-batch
distinct adapters, no slot can be freed, or its prefetch is still running.
An adapter not on the device takes a free slot or one evicted by the policy in the slot table (host
bookkeeping: LoRAMemoryPool), and its slot arrays go into the plan's `slot_writes`; reading them (when no
prefetch did) happens here, so an unreadable adapter rejects its request while planning. Adapters of running
requests are never evicted (no reload thrash between a prefill and the next decode), nor are those in `keep`
(the scheduler passes the adapters other waiting requests want). EngineCore then `apply`s the plan's slot writes
(ModelRunner.write_lora_slot), the only device writes of a step's adapters, and `lora_batch(token_slots)`
builds the step's LoRABatch. Frontend calls (`register`, `unregister`) arrive as RPCs through the engine loop;
a pinned adapter is written into its slot by `register`, or, when running requests hold every slot, waits
(`_waiting_pins`) and is pinned in the first slot a step frees (`plan_step`, before the step's requests take any).

Where it sits: a manager of the engine process, above the model runner whose LoRA buffers it writes; built by
`build_lora_manager` from the engine's LoRASetup (lora/lora_setup.py: adapters, max rank, covered modules).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from sgl_jax_lora.configs.buckets import segment_buckets
from sgl_jax_lora.lora.adapter import AdapterSummary, LoRAAdapter
from sgl_jax_lora.lora.adapter_plan import AdapterPlan, SlotWrite
from sgl_jax_lora.lora.host_cache import HostAdapter, HostAdapterCache, max_bytes_of
from sgl_jax_lora.lora.lora_batch import LoRABatch, build_lora_batch, padding_lora_batches
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.lora_setup import LoRASetup
from sgl_jax_lora.lora.memory_pool import LoRAMemoryPool
from sgl_jax_lora.lora.peft_config import LoRAAdapterError
from sgl_jax_lora.lora.prefetch_queue import PrefetchQueue
from sgl_jax_lora.lora.target_shapes import LoRATargetShapes
from sgl_jax_lora.managers.adapter_staging import AdapterStaging, StagedSlotArrays, prefetch_workers
from sgl_jax_lora.model_executor.model_runner import ModelRunner
from sgl_jax_lora.server_args import ServerArgs


class LoRAManager:
    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner,
        target_shapes: LoRATargetShapes,
        max_rank: int,
        target_modules: frozenset[str],
        load: Callable[[LoRARef], LoRAAdapter],
        inspect: Callable[[LoRARef], AdapterSummary],
    ):
        self.max_per_batch = args.max_loras_per_batch
        self.max_chunks = args.max_prefill_seqs  # bounds a step's adapter runs (lora_batch.py `max_lora_runs`)
        self.max_rank = max_rank
        self.target_modules = target_modules  # HF module names the device buffers cover
        self.runner = runner
        self.target_shapes = target_shapes
        self.refs: dict[str, LoRARef] = {}
        self.load = load  # an adapter's weights (LoRASetup.load: its directory, or the copy given from memory)
        max_bytes = max_bytes_of(args.lora_host_cache_gib)
        self.host_cache = HostAdapterCache(args.max_loaded_loras, self._lay_out, args.lora_eviction_policy, max_bytes)
        self.inspect = inspect  # header-only validation (adapter.inspect_peft_adapter)
        self.pool = LoRAMemoryPool(
            runner.cfg,
            args.tp_size,
            args.max_loras_per_batch + 1,
            max_rank,
            runner.lora_buffer_shapes(),
            args.lora_eviction_policy,
        )
        self._running_ids: frozenset[str] = frozenset()  # adapters of running requests when the last step was planned
        self._unapplied: list[SlotWrite] = []  # reserved by the last plan, not on the device yet
        self._prefetcher = PrefetchQueue(max_workers=prefetch_workers())  # by the requests' priority
        self._inspector = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lora-inspect")  # headers: ms each
        self._prefetches: dict[str, Future] = {}  # lora_id -> (HostAdapter, slot arrays to write), started on arrival
        slot_bytes = sum(np.prod((s[0],) + s[2:]) for s in self.pool.buffer_shapes.values()) * runner.dtype.itemsize
        self.staging = AdapterStaging(runner.stage_lora_slot_values, int(slot_bytes))
        self.staged_writes = 0  # slot writes whose arrays were on the device before the engine loop wrote them
        self._zero_values: list[np.ndarray] | None = None  # a slot's zeros in the model dtype, made on first release
        self.segment_buckets = segment_buckets(self.pool.num_slots, args.lora_segment_buckets)
        # steps whose tokens are all base run the LoRA-free program (LoRABatch None) unless disabled
        self.base_program = not args.disable_lora_base_program
        self.load_latencies_s: collections.deque[float] = collections.deque(maxlen=1000)  # the latest loads
        self.load_seconds_total = 0.0
        self.device_hits = 0
        self.device_misses = 0
        self._waiting_pins: set[str] = set()  # pinned adapters waiting for a slot that running requests hold

    # ---- registration (RPCs from the frontend) ----------------------------------------------
    def inspect_ahead(self, ref: LoRARef) -> Future:
        """The header-only validation `register` starts with, on a worker thread: the engine loop keeps stepping while
        it reads the adapter's config and tensor headers, then registers with the result (`register(ref, summary)`).
        The future raises what `inspect` raises."""
        return self._inspector.submit(self.inspect, ref)

    def run_ahead(self, work: Callable[[], object]) -> Future:
        """Other work of a LoRA call done on the same worker thread first, off the engine loop (a tensors load's
        config matched against the model: LoRASetup.match_config)."""
        return self._inspector.submit(work)

    def register(self, ref: LoRARef, summary: AdapterSummary | None = None) -> AdapterSummary:
        """Validate from the adapter's config and tensor headers (no weights read; `summary`: that validation's
        result, done ahead by `inspect_ahead`); pinned adapters are loaded and take a device slot now, the others
        are read on first use (prefetch)."""
        if ref.pinned and len(self.pool.pinned) + len(self._waiting_pins) >= self.max_per_batch - 1:
            raise LoRAAdapterError(
                f"adapter '{ref.lora_name}': at most {self.max_per_batch - 1} adapters may be pinned "
                f"(--max-loras-per-batch {self.max_per_batch} minus one); unpin one or raise --max-loras-per-batch"
            )
        adapter = summary if summary is not None else self.inspect(ref)
        self._check_targets(ref, adapter)
        self.refs[ref.lora_id] = ref
        if ref.pinned:
            try:
                self._pin(ref)
            except Exception:
                self.refs.pop(ref.lora_id, None)
                raise
        return adapter

    def _pin(self, ref: LoRARef) -> None:
        """Write the adapter into a slot and keep it there; when running requests use every slot (an update of a
        pinned adapter under load), it waits for the first slot a step frees."""
        slot = self.pool.slot_of.get(ref.lora_id) or self.pool.free_slot() or self.pool.victim(busy=self._running_ids)
        if slot is None:
            self._waiting_pins.add(ref.lora_id)
            return
        self._waiting_pins.discard(ref.lora_id)
        if ref.lora_id not in self.pool.slot_of:
            self.apply([self._reserve_slot(slot, ref.lora_id)])
        self.pool.pinned.add(ref.lora_id)

    def unpin(self, lora_id: str) -> None:
        """The adapter may leave its slot (or stops waiting for one): an update's old version."""
        self.pool.pinned.discard(lora_id)
        self._waiting_pins.discard(lora_id)

    def unregister(self, lora_id: str) -> None:
        """Forget an adapter; its device slot, if it held one, is zeroed so that nothing of it stays on the device."""
        ref = self.refs.pop(lora_id, None)
        self._waiting_pins.discard(lora_id)
        if ref is not None and all(other.lora_name != ref.lora_name for other in self.refs.values()):
            self.host_cache.forget_name(ref.lora_name)  # an update's new version keeps the name's counters
        self._prefetches.pop(lora_id, None)
        slot = self.pool.slot_of.get(lora_id)
        self.pool.release(lora_id)
        if slot is not None:
            self._zero(slot)
        self.host_cache.drop(lora_id)

    def _zero(self, slot: int) -> None:
        """Write zeros over every buffer of `slot` (a freed slot holds no adapter's values)."""
        if self._zero_values is None:
            self._zero_values = self.runner.lora_slot_values(self.pool.zero_update())
        self.runner.write_lora_slot(slot, self._zero_values)

    def _check_targets(self, ref: LoRARef, adapter: AdapterSummary) -> None:
        missing = sorted(adapter.target_modules - self.target_modules)
        if missing:
            raise LoRAAdapterError(
                f"adapter '{ref.lora_name}' targets {missing}, which the LoRA pool does not cover; "
                f"restart with --lora-target-modules including them"
            )

    # ---- per step (the scheduler's AdapterSlots, managers/adapter_slots.py) ---------------------
    def plan_step(self, running: set[str | None] = frozenset()) -> AdapterPlan:
        """A new step's adapter plan. running: adapters of the requests already running; their slots are not
        evicted by this step (nor by a pin before the next one)."""
        self._forget_unapplied()
        self._running_ids = frozenset(lora_id for lora_id in running if lora_id is not None)
        for lora_id in list(self._waiting_pins):  # a slot the last step freed
            self._pin(self.refs[lora_id])
        return AdapterPlan(running=self._running_ids)

    def prefetch(self, lora_id: str | None, priority: int = 0) -> None:
        """Start reading `lora_id` from disk and laying it out for a slot off the engine thread, after the reads asked
        for by more urgent requests (`priority`: the request's, lower first); no-op if it is on the device, and only a
        move forward if it is already on its way for a less urgent request."""
        if lora_id is None or lora_id in self.pool.slot_of or lora_id not in self.refs:
            return
        if lora_id in self._prefetches:
            self._prefetcher.hasten(lora_id, priority)
            return
        if len(self._prefetches) >= 4 * self.pool.num_slots:  # forget finished ones no request came back for
            for done in [i for i, f in self._prefetches.items() if f.done()]:
                del self._prefetches[done]
        self._prefetches[lora_id] = self._prefetcher.submit(
            lora_id, priority, self._staged_slot_arrays, self.refs[lora_id], time.perf_counter()
        )

    def wait_for_prefetches(self) -> None:
        """Block until every adapter on its way from disk is ready for a slot (scripts that profile one step with
        all its requests admitted; the engine never waits, it admits a request once its adapter has arrived)."""
        wait(list(self._prefetches.values()))

    def _lay_out(self, ref: LoRARef) -> HostAdapter:
        """The host cache's loader: the adapter's weights laid out as its slot arrays in the model dtype. The weights
        are dropped once laid out (the cache keeps the slot arrays, all a slot write reads)."""
        adapter = self.load(ref)
        values = self.runner.lora_slot_values(self.pool.slot_update(adapter, self.runner.dtype))
        return HostAdapter(adapter.name, adapter.rank, adapter.scaling, values)

    def _host_slot_arrays(self, ref: LoRARef) -> tuple[HostAdapter, list[np.ndarray]]:
        """(host adapter, its slot arrays in the model dtype) from the host cache, laid out on a miss; thread-safe."""
        host = self.host_cache.get(ref)
        return host, host.values

    def _staged_slot_arrays(self, ref: LoRARef, submitted: float) -> tuple[HostAdapter, list]:
        """`_host_slot_arrays`, then staged on the device while the staging budget allows (AdapterStaging.stage).
        submitted: when the prefetch was asked for (its latency is counted)."""
        try:
            host, values = self._host_slot_arrays(ref)
            return host, self.staging.stage(ref.lora_name, values)
        finally:
            self.staging.finished(submitted)

    def can_evict(self, lora_id: str) -> bool:
        return lora_id not in self.pool.pinned

    def is_resident(self, lora_id: str) -> bool:
        return lora_id in self.pool.slot_of

    def reserve(self, plan: AdapterPlan, lora_id: str | None, keep: frozenset[str | None] = frozenset()) -> int | None:
        if lora_id is None:
            return 0
        if lora_id not in self.refs:
            raise LoRAAdapterError(f"adapter id {lora_id} is not registered (it was unloaded)")
        if lora_id in plan.adapters:
            return self.pool.slot_of[lora_id]
        if len(plan.adapters) >= self.max_per_batch:
            return None
        slot = self.pool.slot_of.get(lora_id)
        if slot is None:
            pending = self._prefetches.get(lora_id)
            if pending is not None and not pending.done():
                return None  # still on its way from disk; a later step admits it
            slot = self.pool.free_slot()
            if slot is None:
                slot = self.pool.victim(busy=plan.adapters | plan.running | keep)
            if slot is None:
                return None
            plan.slot_writes.append(self._reserve_slot(slot, lora_id))
            self.device_misses += 1
        else:
            self.device_hits += 1
        self.pool.policy.mark_used(lora_id)
        plan.adapters.add(lora_id)
        return slot

    def _reserve_slot(self, slot: int, lora_id: str) -> SlotWrite:
        """Give `slot` to the adapter in the slot table and make its slot arrays on the host: a finished prefetch
        supplies them, else they are made here (errors raise, and nothing is reserved). No device write: `apply`."""
        start = time.perf_counter()
        prefetched = self._prefetches.pop(lora_id, None)
        host, values = prefetched.result() if prefetched is not None else self._host_slot_arrays(self.refs[lora_id])
        self.pool.assign(slot, lora_id, host.rank, host.scaling)
        write = SlotWrite(slot, lora_id, values, time.perf_counter() - start)
        self._unapplied.append(write)
        return write

    def apply(self, writes: list[SlotWrite]) -> None:
        """Write planned adapters into their device slots (host -> device). Every element of a slot is written (rows
        above the adapter's rank as zeros): nothing of the adapter it evicts remains."""
        for write in writes:
            start = time.perf_counter()
            try:
                self.runner.write_lora_slot(write.slot, write.values)
            except BaseException:
                self._forget_unapplied()  # this write and the ones after it never reached the device
                raise
            self._unapplied.remove(write)
            self.staged_writes += isinstance(write.values, StagedSlotArrays)
            elapsed = write.host_s + time.perf_counter() - start
            self.load_latencies_s.append(elapsed)
            self.load_seconds_total += elapsed

    def _forget_unapplied(self) -> None:
        """A plan whose step failed before its slot writes were applied: its slots hold something else on the
        device, so the slot table forgets them (their adapters load again when next wanted)."""
        for write in self._unapplied:
            if self.pool.slot_of.get(write.lora_id) == write.slot:
                self.pool.release(write.lora_id)
        self._unapplied = []

    def lora_batch(self, token_slots: np.ndarray) -> LoRABatch | None:
        """The step's LoRABatch, its segment count padded to the smallest segment bucket that fits; None (the
        LoRA-free program, as fast as an engine without LoRA) when no token uses an adapter."""
        if self.base_program and not np.any(token_slots):
            return None
        num_distinct = len(np.unique(token_slots))
        num_segments = next(g for g in self.segment_buckets if g >= num_distinct)
        return build_lora_batch(token_slots, num_segments, self.pool.slot_scale, self.pool.slot_rank, self.max_chunks)

    def padding_batches(self, num_tokens: int) -> list[LoRABatch | None]:
        """One all-base LoRABatch per segment bucket (and None for the LoRA-free program), for compiling every
        bucket at warmup."""
        pool = self.pool
        return padding_lora_batches(
            num_tokens, self.segment_buckets, pool.slot_scale, pool.slot_rank, self.base_program
        )

    def stats(self) -> dict:
        cache = self.host_cache.stats
        return {
            "registered": len(self.refs),
            "resident_on_device": sum(o is not None for o in self.pool.slot_owner[1:]),
            "device_slots": self.pool.num_slots - 1,
            "pinned": len(self.pool.pinned) + len(self._waiting_pins),  # placed, or waiting for a slot
            "in_host_cache": len(self.host_cache),
            "host_cache_bytes": self.host_cache.nbytes,
            "host_cache_max_bytes": self.host_cache.max_bytes,
            "device_hits": self.device_hits,
            "device_misses": self.device_misses,
            "device_evictions": self.pool.num_evictions,
            "host_hits": cache.hits,
            "host_misses": cache.misses,
            "host_evictions": cache.evictions,
            "hits_by_name": dict(cache.hits_by_name),
            "misses_by_name": dict(cache.misses_by_name),
            "slot_load_seconds": list(self.load_latencies_s),
            "slot_load_seconds_total": self.load_seconds_total,
            "staged_slot_writes": self.staged_writes,
            **self.staging.times,
        }


def build_lora_manager(setup: LoRASetup, runner: ModelRunner) -> LoRAManager:
    """The engine's LoRAManager of `setup`'s adapters on `runner`'s buffers; registers the initial adapters."""
    manager = LoRAManager(
        setup.args, runner, setup.target_shapes, setup.max_rank, setup.covered_modules, setup.load, setup.inspect
    )
    for ref in setup.initial_refs:
        manager.register(ref)
    return manager

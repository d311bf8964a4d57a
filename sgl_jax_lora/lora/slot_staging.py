"""SlotStaging: device memory where prefetched adapters' slot arrays wait for their slot write.

Where it sits: LoRAManager's prefetch threads lay an adapter out as slot arrays on the host, then `try_stage` copies
them to the device (ModelRunner.stage_lora_slot_values), so that the engine loop's slot write copies device to
device. At most `budget` adapters wait there at once (STAGING_BYTES of them, `staging_budget`); staged arrays give
their place back when freed, that is once their slot is written. A prefetch that finds no place keeps its host
arrays and is remembered: once a step the engine loop calls `stage_left_on_host`, which stages those adapters, oldest
first, on a thread of its own as places come free, and hands their prefetch a new future. The loop's slot write then
copies from the device, not from the host (tens of ms an adapter on the loop, while every running request waits); a
request whose adapter is being staged waits for it, as for its read. Names: STAGING_BYTES, staging_budget,
StagedSlotArrays, SlotStaging.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

logger = logging.getLogger(__name__)

STAGING_BYTES = 1 << 30  # device memory that adapters staged ahead of their slot writes may take at once


def staging_budget(slot_bytes: int) -> int:
    """How many adapters' slot arrays may wait on the device for their slot write at once: those STAGING_BYTES holds,
    1 to 16 (a backlog of requests beyond them keeps its adapters on the host until places come free)."""
    return min(16, max(1, STAGING_BYTES // max(slot_bytes, 1)))


class StagedSlotArrays(list):
    """One slot's arrays on the device (ModelRunner.stage_lora_slot_values), counted against the staging budget until
    they are freed."""


class SlotStaging:
    """The staging budget's places, the adapters left on the host for want of one, and the thread that stages those
    later. stage: copies a slot's host arrays to the device (ModelRunner.stage_lora_slot_values)."""

    def __init__(self, stage: Callable[[list], list], budget: int):
        self._stage = stage
        self.budget = budget
        self.num_staged = 0  # places taken: StagedSlotArrays alive, and stagings under way
        self.staging_s = 0.0  # seconds spent copying to the device, all threads together
        self.staged_later = 0  # adapters staged by `stage_left_on_host`
        self._left_on_host: dict[str, str] = {}  # lora id -> name, of prefetches that found no place, oldest first
        self._lock = threading.RLock()  # a staged copy freed (its finalizer) while this thread holds it re-enters
        self._stager = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lora-stage")

    def try_stage(self, lora_id: str, name: str, values: list) -> list:
        """`values` staged on the device if a place is free (StagedSlotArrays); else `values` themselves, and the
        adapter is remembered for `stage_left_on_host`. A failed copy (e.g. no device memory left) gives the host
        arrays too: the loop's write copies them."""
        with self._lock:
            if self.num_staged >= self.budget:
                self._left_on_host[lora_id] = name
                return values
            self.num_staged += 1
        return self._stage_in_place(name, values)

    def _stage_in_place(self, name: str, values: list) -> list:
        """Copy to the device in a place already taken; the place is given back when the copy is freed, or at once if
        the copy fails."""
        start = time.perf_counter()
        try:
            staged = StagedSlotArrays(self._stage(values))
        except Exception as e:
            self._give_back()
            logger.warning("adapter '%s': staging its slot arrays on the device failed (%s)", name, e)
            return values
        weakref.finalize(staged, self._give_back)
        with self._lock:
            self.staging_s += time.perf_counter() - start
        return staged

    def _give_back(self) -> None:
        with self._lock:
            self.num_staged -= 1

    def stage_left_on_host(self, prefetches: dict[str, Future]) -> None:
        """The engine loop, once a step: while places are free, take the oldest adapter left on the host whose
        prefetch in `prefetches` (lora id -> future of (adapter, slot arrays)) ended with host arrays, and replace
        that future with one of the same adapter staged on the device by the staging thread. Adapters no longer
        waiting there (written into a slot, unregistered) are dropped."""
        while True:
            with self._lock:
                if self.num_staged >= self.budget or not self._left_on_host:
                    return
                lora_id = next(iter(self._left_on_host))
                name = self._left_on_host.pop(lora_id)
                pending = prefetches.get(lora_id)
                if pending is None or not pending.done() or pending.exception() is not None:
                    continue
                adapter, values = pending.result()
                if isinstance(values, StagedSlotArrays):
                    continue
                self.num_staged += 1
                self.staged_later += 1
            prefetches[lora_id] = self._stager.submit(self._staged_result, name, adapter, values)

    def _staged_result(self, name: str, adapter, values: list) -> tuple:
        return adapter, self._stage_in_place(name, values)

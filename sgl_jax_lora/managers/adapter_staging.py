"""Adapters staged on the device ahead of their slot write: the last step of an adapter's prefetch.

Where it sits: LoRAManager's prefetch threads (managers/lora_manager.py) lay an adapter out as its slot arrays on the
host, then hand them to `AdapterStaging.stage`, which copies them to the device (ModelRunner.stage_lora_slot_values)
while the staging budget allows, so that the engine loop's slot write copies device to device. What exists here:
`prefetch_workers` (the prefetch threads), `STAGING_BYTES` and `staging_budget` (how many adapters wait on the device
at once), `StagedSlotArrays` (one slot's arrays on the device) and `AdapterStaging` (the count and the prefetch times).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

logger = logging.getLogger(__name__)


def prefetch_workers(cpu_count: int | None = None) -> int:
    """Threads that read adapters from disk and lay out their slot arrays: half the host's cores, 2 to 8. The work is
    numpy (casts, copies) and file reads, which release the GIL, so a cold start of many adapters (a burst over
    adapters no cache holds) loads about as many at once as there are threads; the other half of the cores stay with
    the engine loop and the frontend."""
    return min(8, max(2, (cpu_count or os.cpu_count() or 2) // 2))


STAGING_BYTES = 1 << 30  # device memory that adapters staged ahead of their slot writes may take at once


def staging_budget(slot_bytes: int) -> int:
    """How many adapters' slot arrays may wait on the device for their slot write at once: those STAGING_BYTES holds,
    1 to 16 (a backlog of requests beyond them keeps its adapters on the host)."""
    return min(16, max(1, STAGING_BYTES // max(slot_bytes, 1)))


class StagedSlotArrays(list):
    """One slot's arrays on the device (ModelRunner.stage_lora_slot_values), counted against the staging budget until
    they are freed."""


class AdapterStaging:
    """Copies prefetched slot arrays to the device, at most `budget` alive at once, and times the prefetches.
    Thread-safe: the prefetch threads call `stage` and `finished` side by side."""

    def __init__(self, stage_values: Callable[[list], list], slot_bytes: int):
        self.stage_values = stage_values  # host slot arrays -> the same on the device
        self.budget = staging_budget(slot_bytes)
        self.num_staged = 0  # StagedSlotArrays alive, under _lock
        # prefetches done, and their seconds from request to ready (queue, disk, layout, staging) and in staging
        self.times = {"prefetches": 0, "prefetch_s": 0.0, "staging_s": 0.0}
        self._lock = threading.Lock()

    def stage(self, lora_name: str, values: list) -> list:
        """`values` copied to the device as StagedSlotArrays while the budget allows; past it, or if the copy fails,
        `values` themselves (the engine loop's slot write then copies them from the host)."""
        with self._lock:
            if self.num_staged >= self.budget:
                return values
            self.num_staged += 1
        start = time.perf_counter()
        try:
            staged = StagedSlotArrays(self.stage_values(values))
        except Exception as e:  # e.g. no device memory left
            self._unstaged()
            logger.warning("adapter '%s': staging its slot arrays on the device failed (%s)", lora_name, e)
            return values
        weakref.finalize(staged, self._unstaged)
        with self._lock:
            self.times["staging_s"] += time.perf_counter() - start
        return staged

    def finished(self, submitted: float) -> None:
        """Counts a prefetch asked for at `submitted` (time.perf_counter) as done now, staged or not."""
        with self._lock:
            self.times["prefetches"] += 1
            self.times["prefetch_s"] += time.perf_counter() - submitted

    def _unstaged(self) -> None:
        with self._lock:
            self.num_staged -= 1

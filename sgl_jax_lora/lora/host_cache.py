"""HostAdapterCache: the host tier of adapters (`--max-loaded-loras`, `--lora-host-cache-gib`), between disk and device
slots.

Flow: LoRAManager needs an adapter that is not on the device (a prefetch on request arrival, on a
background thread, or `reserve` while a step is planned) -> `get(ref)` returns the host copy, loading it through
`loader` on a miss (LoRAManager's: read from disk, or from LoRASetup's in-memory adapters, then laid out for a slot)
and evicting the least recently used unpinned adapter when the cache is full -> the manager writes its slot arrays
into a device slot when the plan is applied.
`/unload_lora_adapter` ends with `drop(lora_id)`. Hits, misses and evictions feed the metrics.

What an entry holds: a `HostAdapter`, the adapter laid out for a device slot (its slot arrays in the model dtype)
with the scaling and rank the slot table keeps. The weights it was laid out from are not kept: the slot arrays are
all a slot write reads, so a cached adapter costs its slot arrays' bytes once (`nbytes`), not those and its weights.

The cache is bounded by count (`--max-loaded-loras`) and by bytes (`max_bytes`: `--lora-host-cache-gib`, by default
`default_max_bytes`, a quarter of the host's RAM), so a server that loads adapters on demand from
--lora-allowed-dirs does not grow until the host runs out of memory.
Pinned adapters are never evicted. If pinned adapters alone fill the cache, it holds more than
its bounds rather than drop one of them; the unpinned adapter just loaded is kept for the
batch that asked for it and is the first to go on the next miss. Disk reads happen outside the cache lock
(LoRAManager prefetches on a background thread).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from collections.abc import Callable

import numpy as np

from sgl_jax_lora.lora.eviction import EvictionPolicy, make_eviction_policy
from sgl_jax_lora.lora.lora_ref import LoRARef

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, eq=False)  # identity equality: arrays
class HostAdapter:
    """One adapter as the host tier holds it: laid out for a device slot, ready to write."""

    name: str
    rank: int  # max r_m over its modules (the slot table's rank of the slot it takes)
    scaling: float  # lora_alpha / r (or / sqrt(r) with rslora)
    values: list[np.ndarray]  # its slot arrays [L, ...] in the model dtype, in the order the slot write takes

    @property
    def nbytes(self) -> int:
        return sum(value.nbytes for value in self.values)


@dataclasses.dataclass
class HostCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    hits_by_name: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    misses_by_name: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class HostAdapterCache:
    def __init__(
        self,
        max_loaded_loras: int | None,
        loader: Callable[[LoRARef], HostAdapter],
        eviction_policy: str = "lru",
        max_bytes: int | None = None,
    ) -> None:
        if max_loaded_loras is not None and max_loaded_loras < 1:
            raise ValueError(f"--max-loaded-loras must be >= 1 (got {max_loaded_loras})")
        self.max_loaded_loras = max_loaded_loras  # None = unbounded
        self.max_bytes = max_bytes  # None = unbounded
        self._nbytes = 0  # the entries' bytes, under _lock
        self._loader = loader
        self._policy: EvictionPolicy = make_eviction_policy(eviction_policy)
        self._entries: dict[str, tuple[LoRARef, HostAdapter]] = {}  # lora_id -> (ref, laid-out adapter)
        self._lock = threading.Lock()  # a background prefetch thread may share the cache
        self.stats = HostCacheStats()

    def get(self, ref: LoRARef) -> HostAdapter:
        """The host copy of `ref`, loaded through the loader on a miss (loader errors propagate, nothing is cached).

        The load runs outside the lock, so a background prefetch never stalls the engine thread's hits.
        """
        with self._lock:
            adapter = self._hit(ref)
            if adapter is not None:
                return adapter
            self.stats.misses += 1
            self.stats.misses_by_name[ref.lora_name] += 1
        loaded = self._loader(ref)
        with self._lock:
            entry = self._entries.get(ref.lora_id)
            if entry is not None:  # another thread loaded it meanwhile: keep one copy
                return entry[1]
            self._entries[ref.lora_id] = (ref, loaded)
            self._nbytes += loaded.nbytes
            self._policy.mark_used(ref.lora_id)
            self._evict_over_capacity(keep=ref.lora_id)
            return loaded

    def _hit(self, ref: LoRARef) -> HostAdapter | None:
        entry = self._entries.get(ref.lora_id)
        if entry is None:
            return None
        self.stats.hits += 1
        self.stats.hits_by_name[ref.lora_name] += 1
        self._policy.mark_used(ref.lora_id)
        return entry[1]

    def drop(self, lora_id: str) -> None:
        """Forget an adapter (unload); unknown ids are ignored."""
        with self._lock:
            entry = self._entries.pop(lora_id, None)
            self._nbytes -= entry[1].nbytes if entry is not None else 0
            self._policy.remove(lora_id)

    def forget_name(self, lora_name: str) -> None:
        """Drop the per-name counters of an adapter name no longer registered: under load/unload churn with fresh
        names they would grow without bound (and with them /metrics' `adapter` label)."""
        with self._lock:
            self.stats.hits_by_name.pop(lora_name, None)
            self.stats.misses_by_name.pop(lora_name, None)

    def resident_ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes

    def __contains__(self, lora_id: str) -> bool:
        return lora_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _over_capacity(self) -> bool:
        over_count = self.max_loaded_loras is not None and len(self._entries) > self.max_loaded_loras
        return over_count or (self.max_bytes is not None and self._nbytes > self.max_bytes)

    def _evict_over_capacity(self, keep: str) -> None:
        while self._over_capacity():
            candidates = [i for i, (ref, _) in self._entries.items() if not ref.pinned and i != keep]
            if not candidates:
                return
            victim = self._policy.select_victim(candidates)
            ref, adapter = self._entries.pop(victim)
            self._nbytes -= adapter.nbytes
            self._policy.remove(victim)
            self.stats.evictions += 1
            logger.info("host cache: evicted adapter '%s' (%s)", ref.lora_name, victim)


def default_max_bytes() -> int:
    """The host cache's bytes when --lora-host-cache-gib is unset: a quarter of the host's physical memory (the rest
    for the frontend, the engine's own host arrays and whatever else the host runs)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def max_bytes_of(gib: float | None) -> int:
    """--lora-host-cache-gib in bytes (its default when unset)."""
    return default_max_bytes() if gib is None else int(gib * (1 << 30))

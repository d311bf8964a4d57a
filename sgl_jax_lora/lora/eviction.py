"""Eviction policies (`--lora-eviction-policy lru|fifo`) for the adapter tiers.

Flow: HostAdapterCache (host tier) and LoRAManager (device slots) call `mark_used` when an adapter is
used, `remove` when it leaves, and `select_victim(candidates)` when a tier is full; the caller passes
only evictable keys (pinned adapters and adapters of the running batch are never candidates).
"""

from __future__ import annotations

import abc
import collections
from collections.abc import Hashable, Iterable

EVICTION_POLICIES: tuple[str, ...] = ("lru", "fifo")


class EvictionPolicy(abc.ABC):
    """Orders keys for eviction; keys it never saw count as the oldest."""

    def __init__(self) -> None:
        self._order: collections.OrderedDict[Hashable, None] = collections.OrderedDict()

    @abc.abstractmethod
    def mark_used(self, key: Hashable) -> None: ...

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def select_victim(self, candidates: Iterable[Hashable]) -> Hashable:
        """The candidate to evict first; raises ValueError when there is none."""
        candidates = list(candidates)
        if not candidates:
            raise ValueError("no evictable adapter: every resident adapter is pinned or in use")
        position = {key: i for i, key in enumerate(self._order)}
        return min(candidates, key=lambda key: position.get(key, -1))


class LRUEvictionPolicy(EvictionPolicy):
    """Evicts the least recently used key."""

    def mark_used(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)


class FIFOEvictionPolicy(EvictionPolicy):
    """Evicts the key that arrived first, however often it was used since."""

    def mark_used(self, key: Hashable) -> None:
        self._order.setdefault(key, None)


def make_eviction_policy(name: str) -> EvictionPolicy:
    """Policy for `--lora-eviction-policy NAME` (lru or fifo)."""
    policies = {"lru": LRUEvictionPolicy, "fifo": FIFOEvictionPolicy}
    if name not in policies:
        raise ValueError(f"unknown --lora-eviction-policy {name!r}; choose one of: {', '.join(EVICTION_POLICIES)}")
    return policies[name]()

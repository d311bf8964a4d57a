"""KeyedLocks: one asyncio lock per key (e.g. an adapter's name), forgotten once nobody holds or waits for it.

Flow: TokenizerManager.update_lora_adapter runs one update of an adapter at a time under `hold(lora_name)`; a
client naming fresh adapters over days leaves no lock behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # key -> (lock, [holders + waiters])

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)

"""Awaiting the requests of one call together: `gather_or_cancel` returns every result in order, and the first
failure cancels the others (a cancelled request generator aborts its engine request). Used by the HTTP routes
(entrypoints/native_api.py, openai_api.py) and the offline Engine (engine.py), so that a call refused in part is
refused whole and leaves nothing running."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def gather_or_cancel(awaitables: list[Awaitable[T]]) -> list[T]:
    """All results in order; the first failure cancels the others and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_as_coroutine(a)) for a in awaitables]
    except ExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return [task.result() for task in tasks]


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable

"""Page allocator for the paged KV cache: a free list of page ids with a fixed budget set at start.

Flow: the Scheduler asks for pages when a request's prefill chunk or decode token needs room and frees a
request's pages when it finishes, aborts or is preempted. Page 0 is reserved (scratch for padding).
"""

from __future__ import annotations

from collections import deque

SCRATCH_PAGE = 0  # the reserved page (padding tokens write it); in a request's page list, a page it gave back


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"KV cache needs at least 2 pages (1 scratch + 1 usable), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(SCRATCH_PAGE + 1, num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise MemoryError(f"asked for {num_pages} KV pages, {len(self._free)} free")
        return [self._free.popleft() for _ in range(num_pages)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

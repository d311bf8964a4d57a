"""PageAllocator (mem_cache/page_allocator.py): page 0 is never handed out, the counts add up, pages round up to
whole pages, and asking for more than is free raises without taking any."""

from __future__ import annotations

import pytest

from sgl_jax_lora.mem_cache.page_allocator import PageAllocator


def test_page_zero_is_reserved_and_counts_add_up():
    allocator = PageAllocator(num_pages=5, page_size=16)
    assert (allocator.num_usable, allocator.num_free, allocator.num_used) == (4, 4, 0)
    pages = allocator.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    assert (allocator.num_free, allocator.num_used) == (0, 4)
    assert not allocator.can_allocate(1) and allocator.can_allocate(0)


def test_freed_pages_come_back_and_are_reused():
    allocator = PageAllocator(num_pages=4, page_size=8)
    first = allocator.allocate(2)
    allocator.free(first)
    assert allocator.num_free == 3
    again = allocator.allocate(3)
    assert sorted(again) == [1, 2, 3] and 0 not in again


def test_over_allocation_raises_and_takes_nothing():
    allocator = PageAllocator(num_pages=3, page_size=8)
    with pytest.raises(MemoryError, match="asked for 3 KV pages, 2 free"):
        allocator.allocate(3)
    assert allocator.num_free == 2


@pytest.mark.parametrize("num_tokens, pages", [(0, 0), (1, 1), (16, 1), (17, 2), (33, 3)])
def test_pages_for_rounds_up_to_whole_pages(num_tokens, pages):
    assert PageAllocator(num_pages=2, page_size=16).pages_for(num_tokens) == pages


def test_fewer_than_two_pages_is_refused():
    with pytest.raises(ValueError, match="at least 2 pages"):
        PageAllocator(num_pages=1, page_size=16)

"""mem_cache/window_pages.py and its use by the Scheduler: a sliding-window model's running requests give back the
pages below their next query's window (freed, or their hold on cached ones dropped), the page table keeps each page at
its position, the prefix cache caches nothing after a given-back page, and a request's pages held stay about one
window wide however long it runs."""

from __future__ import annotations

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.managers.scheduler import Scheduler
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator
from sgl_jax_lora.mem_cache.prefix_cache import SCRATCH_PAGE, PrefixCache
from sgl_jax_lora.mem_cache.window_pages import drop_pages_below_window, pages_below_window
from tests.sgl_jax_lora.mem_cache.test_prefix_cache import TOKENS, make_req


def test_pages_below_the_next_querys_window():
    # the next query at position n reads keys n - W + 1 .. n: pages wholly below n - W + 1 go
    assert pages_below_window(num_computed=40, window=11, page_size=16) == 1  # keys 30..40: page 0 (0..15) only
    assert pages_below_window(num_computed=42, window=11, page_size=16) == 2  # keys 32..42: pages 0 and 1
    assert pages_below_window(num_computed=5, window=11, page_size=16) == 0


def test_pages_below_the_window_are_freed_once_without_a_prefix_cache():
    allocator = PageAllocator(16, 4)
    pages = allocator.allocate(5)
    first_two = pages[:2]
    assert drop_pages_below_window(pages, num_computed=17, window=8, allocator=allocator, prefix_cache=None) == 2
    assert pages[:2] == [SCRATCH_PAGE] * 2 and allocator.num_free == 15 - 3  # keys 10..17 need pages 2..4
    assert drop_pages_below_window(pages, num_computed=17, window=8, allocator=allocator, prefix_cache=None) == 0
    assert set(first_two) <= set(allocator.allocate(allocator.num_free))  # given back to the free list


def test_a_cached_page_below_the_window_stays_cached_for_later_requests():
    allocator = PageAllocator(16, 4)
    cache = PrefixCache(allocator)
    pages = allocator.allocate(3)
    cache.insert(None, TOKENS, num_computed=11, pages=pages)  # its two full pages shared while it runs
    assert drop_pages_below_window(pages, num_computed=11, window=3, allocator=allocator, prefix_cache=cache) == 2
    assert cache.num_cached == 2 and cache.num_evictable == 2  # its hold dropped, the pages kept
    assert cache.match(None, TOKENS, max_tokens=10) == [p for p in cache._key_of]  # a later request reuses them
    cache.release(None, TOKENS, num_computed=11, pages=pages)  # its end skips the pages it gave back
    assert allocator.num_free == 15 - 2


def test_no_page_after_a_given_back_one_is_cached():
    # a prefix matches from its first page: pages after a given-back one could never be matched
    allocator = PageAllocator(16, 4)
    cache = PrefixCache(allocator)
    tokens = TOKENS + [7] * 9  # five whole pages
    pages = allocator.allocate(5)
    drop_pages_below_window(pages, num_computed=12, window=4, allocator=allocator, prefix_cache=cache)
    assert pages[:2] == [SCRATCH_PAGE] * 2
    cache.release(None, tokens, num_computed=20, pages=pages)
    assert cache.num_cached == 0 and allocator.num_free == 15


def test_a_running_request_holds_about_one_window_of_pages():
    allocator = PageAllocator(64, 4)
    buckets = Buckets.build(8, 32, 256, 4)
    sched = Scheduler(buckets, allocator, 8, 32, 4, prefix_cache=PrefixCache(allocator), sliding_window=10)
    req = make_req("long", TOKENS + list(range(200, 229)))  # 40 tokens: two 32-token chunks
    req.sampling.max_new_tokens = 100
    sched.add(req)
    held = []
    for _ in range(60):  # the prefill's two chunks, then decode rows
        batch = sched.schedule()
        table = batch.to_forward_batch(sched.buckets, 4, lambda slots: None).page_table[0]
        first_read = pages_below_window(req.num_computed, 10, 4)  # the step's first query's window
        assert all(table[i] != SCRATCH_PAGE for i in range(first_read, len(req.pages)))  # every page it reads is real
        for r, n in zip(batch.reqs, batch.num_new_tokens):
            r.num_computed += n
            if r.num_computed == r.seq_len:  # the step samples the request's next token
                r.output_ids.append(5)
        held.append(sum(page != SCRATCH_PAGE for page in req.pages))
    assert req.num_computed == 40 + 58 and len(req.pages) == 25  # a place for every page of its 98 tokens
    assert max(held[2:]) <= 4  # the window's 10 keys span at most 4 pages of 4, with the page being filled
    assert sched.num_pages_held == max(held[-1], 0)

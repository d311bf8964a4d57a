"""mem_cache/window_pages.py and its use by the Scheduler: a sliding-window model's running requests give back the
pages below their next query's window (freed, or their hold on cached ones dropped), the page table keeps each page at
its position, a request's pages held stay about one window wide however long it runs, and the prefix cache matches a
prefix longer than the window by the pages of its last window (the ones below it given back or evicted)."""

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


def test_pages_after_a_given_back_one_are_cached_and_matched_by_window():
    allocator = PageAllocator(16, 4)
    cache = PrefixCache(allocator)
    tokens = TOKENS + [7] * 10  # five whole pages and a token
    pages = allocator.allocate(5)
    drop_pages_below_window(pages, num_computed=12, window=4, allocator=allocator, prefix_cache=cache)
    assert pages[:2] == [SCRATCH_PAGE] * 2
    cache.release(None, tokens, num_computed=20, pages=pages)
    assert cache.num_cached == 3 and allocator.num_free == 15 - 3  # pages 2..4: their keys chain the whole prefix
    assert cache.match(None, tokens, max_tokens=20) == []  # a full-attention match needs the prefix from page 0
    # the query at position 20 with a 4-key window reads keys 17..20: page 4 alone of the 20 cached tokens
    assert cache.match(None, tokens, max_tokens=20, window=4) == [SCRATCH_PAGE] * 4 + pages[4:]
    assert cache.num_evictable == 2  # the match holds the page it hands out, and only it
    # a 9-key window from position 20 reads keys 12..20 (pages 3 and 4), from 16 keys 8..16 (pages 2 and 3)
    assert cache.match(None, tokens, max_tokens=20, window=9) == [SCRATCH_PAGE] * 3 + pages[3:]
    assert cache.match(None, tokens, max_tokens=16, window=9) == [SCRATCH_PAGE] * 2 + pages[2:4]
    # a different prefix matches nothing, whatever the window
    assert cache.match(None, [9] + tokens[1:], max_tokens=20, window=4) == []


def test_the_window_match_stops_before_a_page_its_window_needs_is_missing():
    allocator = PageAllocator(16, 4)
    cache = PrefixCache(allocator)
    tokens = TOKENS + [7] * 10
    pages = allocator.allocate(5)
    cache.insert(None, tokens, num_computed=20, pages=pages)
    cache.give_back(pages)
    cache.evict(5)  # every page gone: nothing matches
    assert cache.num_cached == 0 and cache.match(None, tokens, max_tokens=20, window=6) == []
    pages = allocator.allocate(5)
    cache.insert(None, tokens, num_computed=12, pages=[SCRATCH_PAGE, *pages[1:3]])  # pages 1 and 2 cached
    # from position 12 a 6-key window reads keys 7..12 (pages 1 and 2); from 16 it would need page 3, not cached
    assert cache.match(None, tokens, max_tokens=20, window=6) == [SCRATCH_PAGE, *pages[1:3]]
    assert cache.match(None, tokens, max_tokens=20) == []  # page 0 is not cached


def test_a_later_request_reuses_the_last_window_of_a_finished_ones_history():
    # a conversation's next turn: its prompt repeats the finished request's prompt and output
    allocator = PageAllocator(64, 4)
    buckets = Buckets.build(8, 32, 256, 4)
    sched = Scheduler(buckets, allocator, 8, 32, 4, prefix_cache=PrefixCache(allocator), sliding_window=6)
    first = make_req("first", list(range(100, 130)))
    first.sampling.max_new_tokens = 11
    sched.add(first)
    while sched.running or sched.waiting:
        batch = sched.schedule()
        for r, n in zip(batch.reqs, batch.num_new_tokens):
            r.num_computed += n
            if r.num_computed == r.seq_len:
                r.output_ids.append(5)
        if first.num_output_tokens == first.sampling.max_new_tokens:
            sched.finish(first)
    assert first.pages == []  # 40 tokens computed: pages 0..7 were given back below the window, 8 and 9 cached
    history = list(range(100, 130)) + [5] * 11
    second = make_req("second", history + [9, 9, 9])
    sched.add(second)
    sched.schedule()
    # from position 40 a 6-key window reads keys 35..40: pages 8 and 9; the 40 tokens before it are not computed again
    assert second.num_computed == 40 and second.cached_tokens == 40
    assert second.pages[:8] == [SCRATCH_PAGE] * 8 and SCRATCH_PAGE not in second.pages[8:]


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

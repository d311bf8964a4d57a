"""PrefixCache on the host alone: whole-page matches keyed by adapter and prefix, holders, LRU eviction, a running
request's pages shared before it ends; and the Scheduler's use of it (a request starts after its cached prefix, one
whose first page another admission computes waits a step for it, cached pages make room when pages run short)."""

from __future__ import annotations

from sgl_jax_lora.configs.buckets import Buckets
from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.managers.scheduler import Scheduler
from sgl_jax_lora.mem_cache.page_allocator import PageAllocator
from sgl_jax_lora.mem_cache.prefix_cache import PrefixCache
from sgl_jax_lora.sampling.sampling_params import SamplingParams

TOKENS = list(range(100, 111))  # 11 tokens: two whole pages of 4 and 3 more


def test_release_keeps_whole_pages_and_match_returns_the_longest_cached_prefix():
    allocator = PageAllocator(16, 4)
    cache = PrefixCache(allocator)
    pages = allocator.allocate(3)
    cache.release("a", TOKENS, num_computed=11, pages=pages)
    assert cache.num_cached == 2 and cache.num_evictable == 2 and allocator.num_free == 15 - 2  # third page freed
    assert cache.match("a", TOKENS, max_tokens=10) == pages[:2]
    assert cache.num_evictable == 0  # held by the matching request
    assert cache.match("a", TOKENS, max_tokens=7) == pages[:1]  # whole pages within max_tokens only
    assert cache.match("b", TOKENS, max_tokens=10) == []  # another adapter's K/V never match
    assert cache.match(None, TOKENS, max_tokens=10) == []
    assert cache.match("a", [1] + TOKENS[1:], max_tokens=10) == []  # a different first token: no page matches
    assert cache.match("a", TOKENS[:4] + [0] * 7, max_tokens=10) == pages[:1]  # the first page only


def test_a_held_page_is_not_evicted_and_eviction_frees_the_deepest_first():
    allocator = PageAllocator(16, 4)
    cache = PrefixCache(allocator)
    pages = allocator.allocate(2)
    cache.release(None, TOKENS, num_computed=8, pages=pages)
    held = cache.match(None, TOKENS, max_tokens=4)
    assert held == pages[:1]
    assert cache.evict(5) == 1 and cache.num_cached == 1  # only the second page was free to go
    cache.release(None, TOKENS, num_computed=4, pages=held)  # the holder gives it back
    assert cache.num_evictable == 1 and cache.evict(1) == 1 and cache.num_cached == 0
    assert allocator.num_free == 15

    other = allocator.allocate(3)
    cache.release(None, TOKENS + [0], num_computed=12, pages=other)
    assert cache.evict(1) == 1  # the third page goes first: the prefix's first pages stay matchable
    assert cache.match(None, TOKENS + [0], max_tokens=11) == other[:2]


def test_a_prefix_cached_twice_keeps_one_copy():
    allocator = PageAllocator(16, 4)
    cache = PrefixCache(allocator)
    first, second = allocator.allocate(2), allocator.allocate(2)
    cache.release(None, TOKENS, num_computed=8, pages=first)
    cache.release(None, TOKENS, num_computed=8, pages=second)  # computed beside the first, not from it
    assert cache.num_cached == 2 and allocator.num_free == 15 - 2
    assert cache.match(None, TOKENS, max_tokens=10) == first


def test_a_running_request_shares_its_full_pages_while_it_holds_them():
    allocator = PageAllocator(16, 4)
    cache = PrefixCache(allocator)
    pages = allocator.allocate(3)
    cache.insert(None, TOKENS, num_computed=11, pages=pages)  # its prefill launched: two whole pages and 3 tokens
    assert cache.num_cached == 2 and cache.num_evictable == 0  # held by the request: never evicted under it
    assert cache.evict(5) == 0
    later = cache.match(None, TOKENS, max_tokens=10)
    assert later == pages[:2]
    cache.insert(None, TOKENS, num_computed=11, pages=pages)  # again (its next chunk): nothing changes
    assert cache.num_cached == 2
    cache.release(None, TOKENS, num_computed=11, pages=pages)  # it ends: its hold goes, the later request's stays
    assert cache.num_evictable == 0 and allocator.num_free == 15 - 2  # the partial third page freed
    cache.release(None, TOKENS, num_computed=11, pages=later)
    assert cache.num_evictable == 2 and cache.evict(2) == 2 and allocator.num_free == 15


def test_a_page_whose_prefix_is_cached_stays_the_requests_own():
    allocator = PageAllocator(16, 4)
    cache = PrefixCache(allocator)
    first, beside = allocator.allocate(2), allocator.allocate(3)  # the same prefix computed twice, side by side
    cache.insert(None, TOKENS, num_computed=8, pages=first)
    cache.insert(None, TOKENS + [7, 7, 7, 7], num_computed=12, pages=beside)
    assert cache.num_cached == 3  # first's two pages, and beside's third (its first two duplicate first's)
    assert cache.match(None, TOKENS + [7, 7, 7, 7, 0], max_tokens=12) == [*first, beside[2]]
    cache.release(None, TOKENS + [7, 7, 7, 7], num_computed=12, pages=beside)
    assert allocator.num_free == 15 - 2 - 3 + 2  # its duplicates freed, its cached third page kept


def make_scheduler(num_pages: int) -> Scheduler:
    allocator = PageAllocator(num_pages, 4)
    buckets = Buckets.build(8, 32, 256, 4)
    return Scheduler(buckets, allocator, 8, 32, 4, prefix_cache=PrefixCache(allocator))


def make_req(rid: str, tokens: list[int], adapter: str | None = None, **req_args) -> Req:
    return Req(
        rid=rid,
        input_ids=list(tokens),
        sampling=SamplingParams(max_new_tokens=4),
        seed=0,
        lora_slot_key=adapter,
        **req_args,
    )


def prefill(sched: Scheduler) -> None:
    batch = sched.schedule()
    assert batch.kind == "extend"
    for r, n in zip(batch.reqs, batch.num_new_tokens):
        r.num_computed += n


def test_scheduler_starts_a_request_after_its_cached_prefix():
    sched = make_scheduler(num_pages=16)
    first = make_req("first", TOKENS)
    sched.add(first)
    prefill(sched)
    first_pages = list(first.pages)
    sched.finish(first)
    assert sched.num_pages_held == 0 and sched.prefix_cache.num_cached == 2
    again = make_req("again", TOKENS)
    sched.add(again)
    batch = sched.schedule()
    assert batch.reqs == [again] and batch.num_new_tokens == [3]  # 8 tokens from the cache, 3 prefilled
    assert again.cached_tokens == 8 and sched.num_cached_tokens == 8 and again.pages[:2] == first_pages[:2]
    again.num_computed += 3
    other_adapter = make_req("other", TOKENS, adapter="b")
    wants_logprobs = make_req("logprobs", TOKENS, return_logprob=True, logprob_start_len=0)
    exact_pages = make_req("exact", TOKENS[:8])  # one token is always left to prefill: only the first page
    for r in (other_adapter, wants_logprobs, exact_pages):
        sched.add(r)
    batch = sched.schedule()
    assert batch.reqs[: batch.num_decode_rows] == [again]  # it decodes in the same step
    assert [r.cached_tokens for r in batch.reqs[batch.num_decode_rows :]] == [0, 0, 4]
    assert batch.num_new_tokens[batch.num_decode_rows :] == [11, 11, 4]


def test_a_request_whose_first_page_is_computed_in_the_same_step_waits_for_it():
    sched = make_scheduler(num_pages=32)
    first, same, shares_a_page, other = (
        make_req("first", TOKENS),
        make_req("same", TOKENS),  # the same prompt (n samples)
        make_req("shares", TOKENS[:4] + [9] * 6),  # the same first page only
        make_req("other", list(range(300, 311))),
    )
    logprobs = make_req("logprobs", TOKENS, return_logprob=True, logprob_start_len=0)  # takes no cached pages
    for r in (first, same, shares_a_page, other, logprobs):
        sched.add(r)
    batch = sched.schedule()
    assert batch.reqs == [first, other, logprobs]  # the two that could reuse first's first page wait a step
    for r, n in zip(batch.reqs, batch.num_new_tokens):  # the step launched: its full pages shared (EngineCore)
        r.num_computed += n
        sched.prefix_cache.insert(r.lora_slot_key, r.all_ids, r.num_computed, r.pages)
    batch = sched.schedule()
    chunks = batch.reqs[batch.num_decode_rows :]
    assert chunks == [logprobs, same, shares_a_page]  # the first chunk: the rest of logprobs' prompt (32-token steps)
    assert [r.cached_tokens for r in chunks[1:]] == [8, 4] and batch.num_new_tokens[-2:] == [3, 6]


def test_cached_pages_make_room_when_pages_run_short():
    sched = make_scheduler(num_pages=5)  # 4 usable pages of 4 tokens
    first = make_req("first", TOKENS[:8] + [1])  # 3 pages
    sched.add(first)
    prefill(sched)
    sched.finish(first)
    assert sched.prefix_cache.num_cached == 2 and sched.allocator.num_free == 2
    big = make_req("big", list(range(300, 316)))  # 4 pages: both cached pages are evicted for it
    sched.add(big)
    batch = sched.schedule()
    assert batch.reqs == [big] and len(big.pages) == 4 and sched.prefix_cache.num_cached == 0


def test_a_request_that_cannot_join_gives_its_cached_pages_back():
    sched = make_scheduler(num_pages=5)
    first = make_req("first", TOKENS[:8] + [1])
    sched.add(first)
    prefill(sched)
    sched.finish(first)
    blocker = make_req("blocker", list(range(300, 306)))  # 2 pages: the free ones
    sched.add(blocker)
    prefill(sched)
    # needs 3 pages: the 2 cached ones it matches and one more, which only evicting its own prefix could give
    late = make_req("late", TOKENS[:8] + [2, 3])
    sched.add(late)
    batch = sched.schedule()
    assert late not in batch.reqs and late in sched.waiting
    assert late.pages == [] and late.num_computed == 0 and sched.prefix_cache.num_evictable == 2

"""RequestPages: the KV pages the scheduler's requests hold (host only).

Where it sits: under managers/scheduler.py, over mem_cache/page_allocator.py and mem_cache/prefix_cache.py. A
request's pages come from the allocator, which gives up cached pages no request holds when its free list is short;
a request gives them back to the prefix cache, which keeps the full ones, or to the allocator without one; a request
entering with no pages starts after the longest cached prefix of its tokens.

What exists here: `RequestPages` (`can_allocate`, `allocate`, `release`, `num_held`, `chunk`, `reuse_cached_prefix`).
"""

from __future__ import annotations

from sgl_jax_lora.managers.req import Req
from sgl_jax_lora.mem_cache.page_allocator import SCRATCH_PAGE, PageAllocator
from sgl_jax_lora.mem_cache.prefix_cache import PrefixCache


class RequestPages:
    def __init__(self, allocator: PageAllocator, prefix_cache: PrefixCache | None, sliding_window: int | None):
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.sliding_window = sliding_window  # a prefix match needs only the pages of its last window

    @property
    def num_evictable(self) -> int:
        return self.prefix_cache.num_evictable if self.prefix_cache is not None else 0

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.allocator.num_free + self.num_evictable

    def allocate(self, num_pages: int) -> list[int]:
        """num_pages fresh pages, evicting cached pages no request holds when the free list is short."""
        short = num_pages - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return self.allocator.allocate(num_pages)

    @property
    def num_held(self) -> int:
        """Pages that requests hold (cached pages no request holds are not counted: they are free to evict)."""
        return self.allocator.num_used - self.num_evictable

    def release(self, req: Req) -> None:
        """req gives back its KV pages: to the prefix cache, which keeps the full ones, or to the allocator."""
        if self.prefix_cache is not None:
            self.prefix_cache.release(req.lora_slot_key, req.all_ids, req.num_computed, req.pages)
        else:
            self.allocator.free([page for page in req.pages if page != SCRATCH_PAGE])
        req.pages = []

    def chunk(self, req: Req, budget: int) -> tuple[int, int]:
        """(prefill tokens req may take under `budget`, pages it needs for them)."""
        num_new = min(req.remaining_prefill, budget)
        return num_new, self.allocator.pages_for(req.num_computed + num_new) - len(req.pages)

    def reuse_cached_prefix(self, req: Req, budget: int, reserve: int) -> int:
        """Start a request that holds no pages after the longest cached prefix of its tokens (whole pages, at least
        one token left to prefill) -> the prompt tokens the cache saved it, counted at its first admission only (a
        preempted request's recompute is not). Called once it may join, so a request that waits hashes nothing. Not
        for requests that want prompt logprobs: those need every position's logits. `reserve`: pages kept free."""
        if self.prefix_cache is None or req.prompt_logprob_start < len(req.input_ids):
            return 0
        req.pages = self.prefix_cache.match(
            req.lora_slot_key, req.all_ids, req.remaining_prefill - 1, window=self.sliding_window
        )
        req.num_computed = len(req.pages) * self.allocator.page_size
        if not self.can_allocate(self.chunk(req, budget)[1] + reserve):  # it would have evicted its prefix
            self.release(req)
            req.num_computed = 0
            return 0
        if req.num_output_tokens:
            return 0
        req.cached_tokens = req.num_computed
        return req.num_computed

"""PrefixCache: the KV pages of earlier requests' tokens (running or released), for later requests that start with
the same tokens.

Flow: the Scheduler admits a request -> `match` hands it the cached pages of its longest cached prefix, in whole
pages, and its prefill starts after them -> once a step computing a prefill chunk is launched, EngineCore `insert`s
the request's full pages, which it keeps holding -> when the request gives its pages back (finish, abort,
preemption) `release` keeps its full pages for reuse (or drops its hold on the cached ones) and frees the rest ->
cached pages that no request holds are evicted, least recently used first, when the allocator runs short (`evict`).
A request of a sliding-window model may give back its pages below the window while it runs (mem_cache/window_pages.py,
`give_back`); their places in its page list hold SCRATCH_PAGE. Its other full pages are cached as any request's, and
`match` with the window hands a later request the pages of its prefix's last window (the ones below it as
SCRATCH_PAGE), so a prefix longer than the window is reused whichever of its earlier pages are gone.

Keys: a page's key is a SHA-256 chain over the adapter (`LoRARef.lora_id`, a new UUID at every load, None for the
base model) and every token up to the page's end, so a page is only reused for the same prefix under the same
adapter load: a reloaded or different adapter, whose K/V differ, never matches.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from sgl_jax_lora.mem_cache.page_allocator import SCRATCH_PAGE, PageAllocator
from sgl_jax_lora.mem_cache.window_pages import pages_below_window


class PrefixCache:
    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._page_of: dict[bytes, int] = {}  # key -> cached page
        self._key_of: dict[int, bytes] = {}  # cached page -> key
        self._holders: dict[int, int] = {}  # cached page -> requests holding it
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # held by none, LRU first

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def page_keys(self, adapter: str | None, tokens: list[int], num_pages: int) -> list[bytes]:
        """Keys of the first num_pages whole pages of tokens under this adapter."""
        chain = hashlib.sha256(b"adapter:" + (adapter or "").encode())
        keys = []
        for i in range(num_pages):
            page = np.asarray(tokens[i * self.page_size : (i + 1) * self.page_size], dtype=np.int64)
            chain.update(page.tobytes())
            keys.append(chain.copy().digest())
        return keys

    def match(self, adapter: str | None, tokens: list[int], max_tokens: int, window: int | None = None) -> list[int]:
        """Pages holding the K/V of the longest cached prefix of tokens[:max_tokens] (whole pages); the caller
        holds them until it releases them. With `window` (a sliding window on every layer, the widest of them;
        mem_cache/window_pages.py), a prefix needs cached only the pages its next query's window reads: the pages
        below that are SCRATCH_PAGE in the result, as a running request's given-back pages are. So the next turn of
        a conversation longer than the window reuses its history's last window, wherever its earlier pages went."""
        pages: list[int | None] = [
            self._page_of.get(key) for key in self.page_keys(adapter, tokens, max_tokens // self.page_size)
        ]
        num_pages, num_below, cached_run = 0, 0, 0  # cached_run: cached pages up to and including page i
        for i, page in enumerate(pages):
            cached_run = cached_run + 1 if page is not None else 0
            below = pages_below_window((i + 1) * self.page_size, window, self.page_size) if window else 0
            if cached_run >= i + 1 - below:  # every page the query after page i reads is cached
                num_pages, num_below = i + 1, below
            elif window is None:
                break
        matched = [SCRATCH_PAGE] * num_below + pages[num_below:num_pages]
        for page in matched[num_below:]:
            self._holders[page] += 1
            self._evictable.pop(page, None)
        return matched

    def insert(self, adapter: str | None, tokens: list[int], num_computed: int, pages: list[int]) -> None:
        """A running request's full pages join the cache while it holds them (tokens[:num_computed] have their K/V
        written, or being written by a step already launched, which every later step follows on the device), so
        requests admitted after it skip that prefix too: a burst of requests sharing a system prompt computes it
        once, not once per request until the first of them ends. A page whose prefix is cached already (computed
        beside it) stays the request's own. The request's `release` then gives its hold back."""
        keys = self.page_keys(adapter, tokens, min(num_computed // self.page_size, len(pages)))
        for page, key in zip(pages, keys):
            if page == SCRATCH_PAGE:  # given back below a sliding window: the pages after it are matched by window
                continue
            if page not in self._key_of and key not in self._page_of:
                self._page_of[key], self._key_of[page], self._holders[page] = page, key, 1

    def release(self, adapter: str | None, tokens: list[int], num_computed: int, pages: list[int]) -> None:
        """A request gives back its pages (pages[i] holds tokens i*P .. (i+1)*P - 1; tokens[:num_computed] have
        their K/V written). Its full pages stay cached, unless the same prefix is cached already; the others
        are freed."""
        self.insert(adapter, tokens, num_computed, pages)  # every page it may keep is now cached and held by it
        self.give_back(pages)

    def give_back(self, pages: list[int]) -> None:
        """A request's pages go: from the cached ones it drops its hold (they stay for later requests), the others
        are freed; SCRATCH_PAGE entries (pages it gave back before) are skipped."""
        to_free, kept = [], []
        for page in pages:
            if page == SCRATCH_PAGE:
                continue
            if page in self._key_of:  # cached: it drops its hold (from `match` or `insert`)
                self._holders[page] -= 1
                kept.append(page)
            else:
                to_free.append(page)
        # deepest page first, so that a prefix's first page is the last of it to be evicted
        for page in reversed(kept):
            if self._holders[page] == 0:
                self._evictable[page] = None
                self._evictable.move_to_end(page)
        self.allocator.free(to_free)

    def evict(self, num_pages: int) -> int:
        """Free up to num_pages cached pages that no request holds, least recently used first; -> pages freed."""
        freed = []
        while len(freed) < num_pages and self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of[self._key_of.pop(page)], self._holders[page]
            freed.append(page)
        self.allocator.free(freed)
        return len(freed)

"""Pages below every layer's sliding window: a running request gives them back before it ends.

Where it sits: the Scheduler calls `drop_pages_below_window` for each running request as it plans a step, when every
layer of the served model has a sliding window (a full layer reads every key; ModelConfig.served_within gives the
windows as served, EngineCore the widest of them). A query at position p of a layer with window W reads the keys at
p - W + 1 .. p, and a request's next query sits at num_computed, so its pages wholly below num_computed - W + 1 are
read by no later step. The step in flight may still read them: the device runs it before any later step, which is
the first that can write a page given out again. A dropped page's entry in the request's `pages` becomes SCRATCH_PAGE (page 0,
which no request owns), so the page table keeps each page at its position; no attention backend reads a key below
its window (the Pallas kernels load nothing there, the native path masks what it gathers). A page the prefix cache
holds keeps serving later requests that share the prefix (this request drops its hold); the others go back to the
allocator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_jax_lora.mem_cache.page_allocator import SCRATCH_PAGE, PageAllocator

if TYPE_CHECKING:
    from sgl_jax_lora.mem_cache.prefix_cache import PrefixCache


def pages_below_window(num_computed: int, window: int, page_size: int) -> int:
    """The leading pages of a request no later query reads: those wholly below its next query's window."""
    return max(num_computed - window + 1, 0) // page_size


def drop_pages_below_window(
    pages: list[int], num_computed: int, window: int, allocator: PageAllocator, prefix_cache: PrefixCache | None
) -> int:
    """Give back the pages (a request's `pages`, changed in place) below the window of its next query, at position
    num_computed; -> the pages given back."""
    num_below = min(pages_below_window(num_computed, window, allocator.page_size), len(pages))
    dropped = [page for page in pages[:num_below] if page != SCRATCH_PAGE]
    if not dropped:
        return 0
    pages[:num_below] = [SCRATCH_PAGE] * num_below
    if prefix_cache is not None:
        prefix_cache.give_back(dropped)
    else:
        allocator.free(dropped)
    return len(dropped)

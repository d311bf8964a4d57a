"""sgl_jax_lora/lora/host_cache.py: HostAdapterCache keeps at most --max-loaded-loras adapters on the host besides the
pinned ones, evicts by its policy (LRU or FIFO), counts hits, misses and evictions per name, and passes a loader's
error on without caching anything.
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl_jax_lora.lora.host_cache import HostAdapter, HostAdapterCache, default_max_bytes, max_bytes_of
from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.lora.peft_config import LoRAAdapterError


def _tiny_adapter(ref: LoRARef) -> HostAdapter:
    return HostAdapter(ref.lora_name, 2, 2.0, [np.ones((1, 2, 4), np.float32), np.ones((1, 4, 2), np.float32)])


class CountingLoader:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    def __call__(self, ref: LoRARef) -> HostAdapter:
        if ref.lora_path == "/broken":
            raise LoRAAdapterError(f"adapter '{ref.lora_name}': broken")
        self.loaded.append(ref.lora_name)
        return _tiny_adapter(ref)


def test_host_cache_lru_with_pinned() -> None:
    loader = CountingLoader()
    cache = HostAdapterCache(max_loaded_loras=2, loader=loader)
    pinned, a, b = LoRARef("pinned", "/p", pinned=True), LoRARef("a", "/a"), LoRARef("b", "/b")
    assert cache.get(pinned).name == "pinned"
    assert cache.get(a) is cache.get(a)  # second get is a hit
    cache.get(b)  # full: evicts a, never the pinned one (even though it is least recently used)
    assert set(cache.resident_ids()) == {pinned.lora_id, b.lora_id}
    cache.get(a)  # a reloads from disk; b goes
    assert loader.loaded == ["pinned", "a", "b", "a"]
    assert pinned.lora_id in cache and b.lora_id not in cache and len(cache) == 2
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 4, 2)
    assert cache.stats.hits_by_name["a"] == 1 and cache.stats.misses_by_name["a"] == 2
    assert cache.nbytes == 2 * _tiny_adapter(a).nbytes == 2 * 2 * 8 * 4  # each entry its slot arrays' bytes
    cache.drop(a.lora_id)
    cache.drop("unknown-id")
    assert cache.resident_ids() == [pinned.lora_id]
    cache.forget_name("a")  # unregistered: its per-name counters go, the others stay
    assert "a" not in cache.stats.hits_by_name and "a" not in cache.stats.misses_by_name
    assert cache.stats.misses_by_name["b"] == 1


def test_host_cache_pinned_overflow_and_errors() -> None:
    loader = CountingLoader()
    cache = HostAdapterCache(max_loaded_loras=1, loader=loader)
    p1, p2, a = LoRARef("p1", "/p1", pinned=True), LoRARef("p2", "/p2", pinned=True), LoRARef("a", "/a")
    cache.get(p1)
    cache.get(p2)  # pinned adapters are kept even beyond the limit
    cache.get(a)
    assert len(cache) == 3
    cache.get(LoRARef("b", "/b"))  # the unpinned a goes; the pinned ones stay
    assert a.lora_id not in cache and {p1.lora_id, p2.lora_id} <= set(cache.resident_ids())
    with pytest.raises(LoRAAdapterError, match="broken"):
        cache.get(LoRARef("bad", "/broken"))
    assert len(cache) == 3
    with pytest.raises(ValueError, match="--max-loaded-loras"):
        HostAdapterCache(max_loaded_loras=0, loader=loader)


def test_host_cache_fifo_policy() -> None:
    cache = HostAdapterCache(max_loaded_loras=2, loader=CountingLoader(), eviction_policy="fifo")
    a, b, c = LoRARef("a", "/a"), LoRARef("b", "/b"), LoRARef("c", "/c")
    cache.get(a)
    cache.get(b)
    cache.get(a)  # a hit does not refresh a FIFO position
    cache.get(c)
    assert set(cache.resident_ids()) == {b.lora_id, c.lora_id}


def test_host_cache_evicts_past_its_bytes() -> None:
    """max_bytes bounds the entries' slot arrays (64 bytes each here) as max_loaded_loras bounds their count: the
    least recently used unpinned adapters go; pinned ones and the one just loaded stay even past it."""
    cache = HostAdapterCache(max_loaded_loras=None, loader=CountingLoader(), max_bytes=150)
    a, b, c = LoRARef("a", "/a"), LoRARef("b", "/b"), LoRARef("c", "/c")
    cache.get(a)
    cache.get(b)
    assert cache.nbytes == 128 and len(cache) == 2
    cache.get(a)  # b is the least recently used now
    cache.get(c)  # 192 bytes > 150: b goes
    assert set(cache.resident_ids()) == {a.lora_id, c.lora_id} and cache.nbytes == 128
    assert cache.stats.evictions == 1
    cache.drop(a.lora_id)
    assert cache.nbytes == 64
    tiny = HostAdapterCache(max_loaded_loras=None, loader=CountingLoader(), max_bytes=10)
    p1, p2 = LoRARef("p1", "/p1", pinned=True), LoRARef("p2", "/p2", pinned=True)
    tiny.get(p1)
    tiny.get(p2)
    tiny.get(a)  # over the bytes with nothing evictable but the one just loaded: all kept
    assert len(tiny) == 3 and tiny.nbytes == 192
    tiny.get(b)  # a is evictable now
    assert a.lora_id not in tiny and b.lora_id in tiny and tiny.nbytes == 192


def test_host_cache_bytes_default_to_a_quarter_of_the_hosts_memory() -> None:
    import os

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_max_bytes() == physical // 4 == max_bytes_of(None)
    assert max_bytes_of(1.5) == 3 << 29

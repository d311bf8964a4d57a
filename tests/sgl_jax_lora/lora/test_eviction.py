"""Eviction policies (lora/eviction.py): LRU evicts the least recently used key, FIFO the first to arrive however
often it was used since; keys never seen count as the oldest; removed keys start over; no candidate is an error."""

from __future__ import annotations

import pytest

from sgl_jax_lora.lora.eviction import FIFOEvictionPolicy, LRUEvictionPolicy, make_eviction_policy


def test_lru_and_fifo_pick_different_victims() -> None:
    lru, fifo = make_eviction_policy("lru"), make_eviction_policy("fifo")
    assert isinstance(lru, LRUEvictionPolicy) and isinstance(fifo, FIFOEvictionPolicy)
    for policy in (lru, fifo):
        for key in ("a", "b", "c", "a"):
            policy.mark_used(key)
    assert lru.select_victim(["a", "b", "c"]) == "b"
    assert fifo.select_victim(["a", "b", "c"]) == "a"
    assert lru.select_victim(["a", "c"]) == "c"
    assert lru.select_victim(["a", "never-seen"]) == "never-seen"
    lru.remove("b")
    lru.remove("not-there")
    lru.mark_used("b")
    assert lru.select_victim(["a", "b", "c"]) == "c"
    with pytest.raises(ValueError, match="no evictable adapter"):
        lru.select_victim([])
    with pytest.raises(ValueError, match="--lora-eviction-policy 'mru'.*lru, fifo"):
        make_eviction_policy("mru")


def test_fifo_keeps_the_arrival_order_until_a_key_is_removed() -> None:
    fifo = make_eviction_policy("fifo")
    for key in ("a", "b", "a", "a"):
        fifo.mark_used(key)
    assert fifo.select_victim(["b", "a"]) == "a"
    fifo.remove("a")
    fifo.mark_used("a")  # arrives again, after b
    assert fifo.select_victim(["a", "b"]) == "b"
    assert fifo.select_victim(iter(["a", "new"])) == "new"

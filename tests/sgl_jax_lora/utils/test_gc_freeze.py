"""utils/gc_freeze.py: the startup objects frozen out of the collector's generations, and its pauses timed."""

from __future__ import annotations

import gc

import pytest

from sgl_jax_lora.utils.gc_freeze import CollectorPauses, collector_stats, freeze_startup_objects


@pytest.fixture
def unfrozen_after():
    yield
    gc.unfreeze()  # the rest of the test session collects as usual


def test_a_full_collection_is_timed_in_generation_2():
    with CollectorPauses() as pauses:
        gc.collect()
    assert pauses.counts == [0, 0, 1] and pauses.seconds[2] > 0
    gc.collect()  # stopped: no longer counted
    assert pauses.counts == [0, 0, 1]
    pauses.start().start()  # started twice: each collection still counted once
    gc.collect()
    pauses.stop()
    assert pauses.counts == [0, 0, 2]


def test_frozen_objects_leave_the_full_collections_walk(unfrozen_after):
    """After the freeze the collector's generations hold only what came since: a live object made before it is out of
    them, a cycle made after it is freed by the next full collection; the process's pause clock runs from the freeze
    on."""

    class Node:
        pass

    def cycle() -> None:
        a, b = Node(), Node()
        a.other, b.other = b, a

    startup = [Node()]  # a live container made before the freeze
    frozen = freeze_startup_objects()
    assert not any(o is startup for o in gc.get_objects())
    # frozen objects leave the permanent generation only when they die, which another thread of the test process
    # may make a few of do between two reads: the count never grows without another freeze
    assert 0 < collector_stats()["frozen_objects"] <= frozen
    before = collector_stats()
    cycle()  # garbage made after the freeze
    assert gc.collect() >= 2
    after = collector_stats()
    assert after["collections"][2] == before["collections"][2] + 1
    assert after["pause_s"][2] > before["pause_s"][2]
    assert not any(isinstance(o, Node) for o in gc.get_objects())  # the post-freeze cycle was freed

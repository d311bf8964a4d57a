"""PrefetchQueue (lora/prefetch_queue.py): adapter reads run most urgent first, first in first out within a priority,
a more urgent request moves a waiting read forward, and a read's result or exception reaches its future. Each test
holds the queue's one worker on a first job (an Event) while it queues the others, so the order is the queue's."""

from __future__ import annotations

import threading

import pytest

from sgl_jax_lora.lora.prefetch_queue import PrefetchQueue


class Recorder:
    """Jobs that append their name to `ran`; `hold` blocks the worker until released."""

    def __init__(self):
        self.ran: list[str] = []
        self.release = threading.Event()

    def hold(self) -> str:
        assert self.release.wait(10)
        return "held"

    def job(self, name: str) -> str:
        self.ran.append(name)
        return name


def held_queue() -> tuple[PrefetchQueue, Recorder]:
    queue, recorder = PrefetchQueue(max_workers=1), Recorder()
    started = threading.Event()
    queue.submit("hold", 0, lambda: started.set() or recorder.hold())
    assert started.wait(10)  # the worker is busy: what follows waits in the queue
    return queue, recorder


def test_jobs_run_by_priority_then_in_the_order_they_came():
    queue, recorder = held_queue()
    futures = [
        queue.submit(key, priority, recorder.job, key)
        for key, priority in [("a", 0), ("b", 0), ("c", -1), ("d", 5), ("e", -1)]
    ]
    recorder.release.set()
    assert [f.result(10) for f in futures] == ["a", "b", "c", "d", "e"]
    assert recorder.ran == ["c", "e", "a", "b", "d"]


def test_all_priorities_equal_is_first_in_first_out():
    queue, recorder = held_queue()
    futures = [queue.submit(key, 0, recorder.job, key) for key in "abcdef"]
    recorder.release.set()
    for f in futures:
        f.result(10)
    assert recorder.ran == list("abcdef")


def test_a_more_urgent_request_moves_a_waiting_job_forward():
    queue, recorder = held_queue()
    futures = {key: queue.submit(key, 0, recorder.job, key) for key in "abc"}
    queue.hasten("c", -1)
    queue.hasten("a", 3)  # less urgent than its own: no change
    again = queue.submit("b", -1, recorder.job, "b-again")  # already waiting: hastened, its own future back
    assert again is futures["b"]
    recorder.release.set()
    assert [futures[k].result(10) for k in "abc"] == ["a", "b", "c"]
    assert recorder.ran == ["c", "b", "a"]  # each hastened job after those already waiting at its new priority


def test_hastening_a_job_that_ran_changes_nothing_and_a_key_can_come_back():
    queue, recorder = held_queue()
    recorder.release.set()
    assert queue.submit("a", 0, recorder.job, "a").result(10) == "a"
    queue.hasten("a", -5)  # done: no-op
    assert queue.submit("a", 0, recorder.job, "a2").result(10) == "a2"  # a new job for the same key
    assert recorder.ran == ["a", "a2"]


def test_an_exception_reaches_the_future_and_the_worker_goes_on():
    queue = PrefetchQueue(max_workers=2)

    def unreadable():
        raise OSError("adapter_model.safetensors is gone")

    failed = queue.submit("bad", 0, unreadable)
    with pytest.raises(OSError, match="is gone"):
        failed.result(10)
    assert queue.submit("good", 0, lambda: 7).result(10) == 7


def test_workers_start_as_jobs_wait_up_to_the_limit():
    queue = PrefetchQueue(max_workers=3)
    release, started = threading.Event(), threading.Semaphore(0)

    def block():
        started.release()
        assert release.wait(10)

    futures = [queue.submit(i, 0, block) for i in range(5)]
    for _ in range(3):
        assert started.acquire(timeout=10)  # three run at once
    assert not started.acquire(timeout=0.2)  # the limit holds the other two back
    release.set()
    for f in futures:
        f.result(10)
    with pytest.raises(ValueError, match="at least 1"):
        PrefetchQueue(max_workers=0)

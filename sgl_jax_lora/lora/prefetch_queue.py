"""PrefetchQueue: worker threads that read adapters from disk in the order of their requests' priority.

Where it sits: LoRAManager.prefetch submits one job per adapter on its way from disk (the read, the slot arrays'
layout, the staging on the device) with the priority of the request that asked for it (EngineCore passes it; 0 for
every request under `--scheduling-policy fcfs`). A worker takes the most urgent job first (lower first, as the
scheduler orders requests), and jobs of one priority in the order they came, so under fcfs the queue is first in,
first out. A more urgent request for an adapter whose job still waits moves that job forward (`hasten`); a job
already running is not interrupted. Without this, an urgent request whose adapter is cold waits behind the reads
of every adapter a burst of less urgent requests asked for first.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor


@dataclasses.dataclass
class _Job:
    fn: Callable
    args: tuple
    future: Future
    priority: int
    seq: int  # the heap entry that stands for this job; older entries of its key are stale


class PrefetchQueue:
    """Jobs wait in a heap by (priority, arrival); each job submits one "run the most urgent waiting job" task to a
    thread pool, so a worker picks its job when it becomes free, not when the job came (the pool's threads, their
    start on demand and their join at exit are ThreadPoolExecutor's)."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "lora-prefetch"):
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        self._heap: list[tuple[int, int, Hashable]] = []  # (priority, seq, key); stale entries are skipped
        self._waiting: dict[Hashable, _Job] = {}  # submitted, not yet taken by a worker
        self._seq = itertools.count()

    def submit(self, key: Hashable, priority: int, fn: Callable, *args) -> Future:
        """Run fn(*args) on a worker, after the waiting jobs of lower priority values and of the same one; the future
        holds its result or its exception. One waiting job per key: for a key already waiting, that job is hastened
        to `priority` and its future returned."""
        with self._lock:
            if key in self._waiting:
                self._hasten(key, priority)
                return self._waiting[key].future
            seq = next(self._seq)
            job = self._waiting[key] = _Job(fn, args, Future(), priority, seq)
            heapq.heappush(self._heap, (priority, seq, key))
        self._pool.submit(self._run_most_urgent)
        return job.future

    def hasten(self, key: Hashable, priority: int) -> None:
        """Give the waiting job of `key` this priority if it is more urgent than its own (no-op for a job that is
        running or done, or already as urgent); it then runs after the waiting jobs of that priority."""
        with self._lock:
            self._hasten(key, priority)

    def _hasten(self, key: Hashable, priority: int) -> None:
        job = self._waiting.get(key)
        if job is None or priority >= job.priority:
            return
        job.priority, job.seq = priority, next(self._seq)
        heapq.heappush(self._heap, (job.priority, job.seq, key))

    def _take_most_urgent(self) -> _Job:
        """The most urgent waiting job, off the heap (one exists: every job submitted one task, and a job is taken
        once)."""
        with self._lock:
            while True:
                _, seq, key = heapq.heappop(self._heap)
                job = self._waiting.get(key)
                if job is not None and job.seq == seq:
                    del self._waiting[key]
                    return job

    def _run_most_urgent(self) -> None:
        job = self._take_most_urgent()
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn(*job.args))
        except BaseException as e:  # the caller's future carries it
            job.future.set_exception(e)

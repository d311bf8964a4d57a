"""The garbage collector in the serving processes: what startup built is frozen out of its generations, so that a full
collection while serving walks only the objects made since; and the collector's pauses are timed.

Where it sits: the engine process calls `freeze_startup_objects()` once its EngineCore is built (model, compiled
programs, KV cache) and before its step loop (managers/engine_process.py); a multi-host follower once node 0's
warmup is replayed (distributed/follower.py); the HTTP frontend once its engine is up, before it serves
(entrypoints/http_server.py). `collector_stats()` is what /server_info reports of a process's collector
(`engine_gc`, `frontend_gc`), and `CollectorPauses` times the collections (per generation) from its start.

Why: startup leaves hundreds of thousands of objects the collector tracks (JAX's traced and compiled programs, the
model's pytrees, the tokenizer). A full (generation 2) collection walks them all; in the engine process that stops
the step loop for a few hundred milliseconds while the device idles (the garbage collector's pauses in
docs/benchmarks.md "ShareGPT-like, 1000 requests at once, one ragged step"). `gc.freeze()` moves them to the
collector's permanent generation. Reference counting still frees any of them that is dropped later; only reference
cycles among them would stay, and the collection before the freeze takes the cycles startup left behind.
"""

from __future__ import annotations

import gc
import time


class CollectorPauses:
    """Seconds and counts of the collector's pauses per generation while started (a gc callback); a context manager
    too."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._began = 0.0

    def start(self) -> CollectorPauses:
        """Time the collections from now on (again started: no change)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._callback)

    def __enter__(self) -> CollectorPauses:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._began
            self.counts[info["generation"]] += 1


_PROCESS_PAUSES = CollectorPauses()  # the serving process's own, started by freeze_startup_objects


def freeze_startup_objects() -> int:
    """Collect startup's garbage, freeze every object left, and time the collector's pauses from here on; -> how many
    objects are frozen."""
    gc.collect()
    gc.freeze()
    _PROCESS_PAUSES.start()
    return gc.get_freeze_count()


def collector_stats() -> dict:
    """This process's collector: objects frozen, and per generation the collections, the objects they freed and (from
    `freeze_startup_objects` on) their pauses in seconds."""
    stats = gc.get_stats()
    return {
        "frozen_objects": gc.get_freeze_count(),
        "collections": [s["collections"] for s in stats],
        "collected": [s["collected"] for s in stats],
        "pause_s": list(_PROCESS_PAUSES.seconds),
    }

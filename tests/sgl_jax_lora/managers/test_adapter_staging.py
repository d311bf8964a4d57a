"""AdapterStaging (managers/adapter_staging.py): prefetched slot arrays copied to the device within a budget, given
back when freed, the host arrays kept when the budget is spent or the copy fails; and the sizes behind it (the
prefetch threads, the budget from a slot's bytes). The copies are real `jax.device_put`s on the CPU device."""

from __future__ import annotations

import gc
import time

import jax
import numpy as np

from sgl_jax_lora.managers.adapter_staging import AdapterStaging, StagedSlotArrays, prefetch_workers, staging_budget


def device_put_all(values: list) -> list:
    return [jax.device_put(v) for v in values]


def test_prefetch_threads_follow_the_host_cores():
    """Half the cores read adapters from disk, at least 2 (a small machine keeps two loads in flight) and at most 8."""
    assert [prefetch_workers(cores) for cores in (1, 2, 4, 16, 64)] == [2, 2, 2, 8, 8]
    assert prefetch_workers(12) == 6


def test_staging_budget_is_a_gibibyte_of_slots():
    assert [staging_budget(size) for size in (0, 1 << 20, 84 << 20, 300 << 20, 2 << 30)] == [16, 16, 12, 3, 1]


def test_arrays_are_staged_within_the_budget_and_give_it_back_when_freed():
    staging = AdapterStaging(device_put_all, slot_bytes=300 << 20)
    assert staging.budget == 3
    host = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)]
    staged = [staging.stage(f"a{i}", host) for i in range(4)]
    assert [isinstance(s, StagedSlotArrays) for s in staged] == [True, True, True, False]
    assert staged[3] is host and staging.num_staged == 3  # past the budget: the host arrays themselves
    assert all(isinstance(a, jax.Array) for a in staged[0])
    np.testing.assert_array_equal(np.asarray(staged[0][0]), host[0])
    del staged
    gc.collect()
    assert staging.num_staged == 0
    assert isinstance(staging.stage("again", host), StagedSlotArrays)


def test_a_failed_copy_keeps_the_host_arrays_and_no_budget():
    """What device_put cannot copy (here a string among the arrays) leaves the host arrays for the slot write."""
    staging = AdapterStaging(device_put_all, slot_bytes=1)
    host = [np.zeros(2, np.float32), "not an array"]
    assert staging.stage("bad", host) is host and staging.num_staged == 0
    assert staging.times["staging_s"] == 0.0


def test_finished_prefetches_are_counted_with_their_latency():
    staging = AdapterStaging(device_put_all, slot_bytes=1)
    submitted = time.perf_counter() - 0.25
    staging.stage("a", [np.zeros(2, np.float32)])
    staging.finished(submitted)
    staging.finished(time.perf_counter())
    assert staging.times["prefetches"] == 2
    assert staging.times["prefetch_s"] >= 0.25 and staging.times["staging_s"] > 0

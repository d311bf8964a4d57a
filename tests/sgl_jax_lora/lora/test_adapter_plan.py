"""sgl_jax_lora/lora/adapter_plan.py: a new AdapterPlan starts empty with containers of its own (no state shared
between plans); a SlotWrite is frozen, keeps its arrays as given, and compares by identity, so plans holding
numpy arrays can be compared and searched without an ambiguous array comparison."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sgl_jax_lora.lora.adapter_plan import AdapterPlan, SlotWrite


def test_a_new_plan_is_empty():
    plan = AdapterPlan()
    assert plan.running == frozenset()
    assert plan.adapters == set()
    assert plan.slot_writes == []


def test_plans_do_not_share_their_containers():
    first, second = AdapterPlan(), AdapterPlan()
    first.adapters.add("a")
    first.slot_writes.append(SlotWrite(1, "a", []))
    assert second.adapters == set()
    assert second.slot_writes == []


def test_running_adapters_are_kept_as_given():
    plan = AdapterPlan(running=frozenset({"x", "y"}))
    plan.adapters.update({"y", "z"})
    assert plan.running == {"x", "y"}
    assert plan.adapters == {"y", "z"}


def test_a_slot_write_holds_its_arrays_and_defaults_its_host_time():
    values = [np.ones((2, 3), np.float32), np.zeros((3, 2), np.float32)]
    write = SlotWrite(slot=4, lora_id="a", values=values)
    assert (write.slot, write.lora_id, write.host_s) == (4, "a", 0.0)
    assert write.values is values


def test_a_slot_write_is_frozen():
    write = SlotWrite(2, "a", [], host_s=0.25)
    with pytest.raises(dataclasses.FrozenInstanceError):
        write.slot = 3


def test_slot_writes_compare_by_identity_not_by_their_arrays():
    values = [np.arange(4.0)]
    first, same = SlotWrite(1, "a", values), SlotWrite(1, "a", values)
    assert first == first
    assert first != same  # a field comparison would have to compare arrays
    plan = AdapterPlan(slot_writes=[first])
    assert same not in plan.slot_writes
    assert first in plan.slot_writes
    assert len({first, same}) == 2  # hashable by identity

"""The order in which the scheduler admits waiting requests when their adapters outnumber the free device slots.

Where it sits: the scheduler's admission pass (`Scheduler._admit`, managers/scheduler.py) asks for the order of the
waiting requests it may admit in this step (one priority class at a time under `--scheduling-policy priority`), then
admits down that order under the step's token budget; a starved request whose adapter finds no slot has one drained
(`adapter_to_drain`). Host only. What exists here: `admission_order`, `adapter_to_drain`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from sgl_jax_lora.managers.adapter_slots import AdapterSlots
from sgl_jax_lora.managers.req import Req


def admission_order(
    waiting: Sequence[Req],
    running: Sequence[Req],
    adapter_slots: AdapterSlots | None,
    max_running: int,
    starved: Callable[[Req], bool],
) -> tuple[list[Req], frozenset]:
    """Starved requests first. Then, when waiting requests want adapters that are not running, the batch is
    packed: the adapters with the most waiting requests get slots until their requests, with those that need no
    new slot (base, or a running adapter), fill the rest of the batch; each slot left over goes to an adapter with
    the fewest waiting requests, whose requests go ahead. So rarely used adapters take turns on the spare slots
    while popular ones keep the batch full, instead of all waiting for the end of a backlog, where the slot limit,
    not the running-request limit, caps the batch. Everything else follows; within each group, the order of
    `waiting` (arrival). -> (the order, the adapters given slots by the plan: an adapter left on the device by
    earlier requests that the plan did not choose is evicted for them even when requests further back want it, or
    slots held from a previous backlog would decide the plan)."""
    starved_first = sorted(waiting, key=lambda r: not starved(r))  # stable: arrival order in each
    if adapter_slots is None:
        return starved_first, frozenset()
    running_keys = {r.lora_slot_key for r in running}
    needs_slot: dict[str, int] = {}  # adapter -> its waiting requests, adapters by first arrival
    num_ready = 0  # waiting requests that need no new slot
    for r in waiting:
        if starved(r):
            continue
        if r.lora_slot_key is None or r.lora_slot_key in running_keys:
            num_ready += 1
        else:
            needs_slot[r.lora_slot_key] = needs_slot.get(r.lora_slot_key, 0) + 1
    if not needs_slot:
        return starved_first, frozenset()
    free_slots = adapter_slots.max_per_batch - len(running_keys - {None})
    room = max_running - len(running) - num_ready
    # ties: an adapter on the device first (no load), then by first arrival (the sort is stable)
    loaded = {key: adapter_slots.is_resident(key) for key in needs_slot}
    largest_first = sorted(needs_slot, key=lambda key: (-needs_slot[key], not loaded[key]))
    num_fill = 0
    while room > 0 and num_fill < min(free_slots, len(largest_first)):
        room -= needs_slot[largest_first[num_fill]]
        num_fill += 1
    rarest = sorted(largest_first[num_fill:], key=lambda key: (needs_slot[key], not loaded[key]))
    rank = {key: (0, i) for i, key in enumerate(rarest[: free_slots - num_fill])}  # each rare adapter's turn
    rank.update((key, (1, 0)) for key in largest_first[:num_fill])  # the fill, with the requests that need no slot

    def place(r: Req) -> tuple[int, int]:
        if starved(r):
            return (-1, 0)
        if r.lora_slot_key not in needs_slot:
            return (1, 0)
        return rank.get(r.lora_slot_key, (2, 0))

    return sorted(waiting, key=place), frozenset(rank)


def adapter_to_drain(running: Sequence[Req], adapter_slots: AdapterSlots, num_wanting: Counter) -> str | None:
    """The running adapter whose slot should run dry for a starved request: the one the fewest waiting requests want,
    then the one whose running requests can finish soonest; never a pinned one. None when an adapter no waiting
    request wants is running (it runs dry by itself). `num_wanting`: waiting requests per adapter."""
    steps_left: dict[str, int] = {}
    for r in running:
        key = r.lora_slot_key
        if key is not None and adapter_slots.can_evict(key):
            steps_left[key] = max(steps_left.get(key, 0), r.sampling.max_new_tokens - r.num_output_tokens)
    if not steps_left:
        return None
    victim = min(steps_left, key=lambda key: (num_wanting[key], steps_left[key]))
    return victim if num_wanting[victim] else None

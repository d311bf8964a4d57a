"""The order in which the Scheduler tries its waiting requests for admission each step (host only).

Flow: Scheduler._add_prefill_chunks -> `admission_order` -> the requests in that order, each admitted while the step's
token budget, KV pages, running limit and adapter slots allow.

Groups first: starved requests (overtaken by more than a full batch), then, when waiting requests want adapters that
are not running, adapter packing (`_packing_groups`; docs/lora.md "Scheduling and fairness"). Within a group the
schedule policy (`--schedule-policy`) decides:
- `fcfs`: arrival order.
- `lpm` (longest prefix match, as SGLang's policy of that name): the requests whose prompt has the most pages in the
  prefix cache first, arrival order among equals. When the KV cache cannot hold every waiting conversation, arrival
  order admits the requests that have waited longest, whose earlier turns were released longest ago and so evicted
  first, and each admission evicts more of the prefixes behind it; lpm admits the requests whose prefix is still
  cached, so they skip its prefill. The starvation bound still holds: a request overtaken by more than a full batch
  goes first.
"""

from __future__ import annotations

from collections.abc import Callable

from sgl_jax_lora.managers.adapter_slots import AdapterSlots
from sgl_jax_lora.managers.req import Req


def admission_order(
    waiting: list[Req],
    running: list[Req],
    max_running: int,
    adapter_slots: AdapterSlots | None,
    starved: Callable[[Req], bool],
    cached_pages: Callable[[Req], int] | None = None,
) -> tuple[list[Req], frozenset]:
    """The waiting requests in admission order, and the adapters the packing plan gives slots (an adapter left on the
    device by earlier requests that the plan did not choose is evicted for them even when requests further back want
    it, or slots held from a previous backlog would decide the plan). cached_pages: the `lpm` policy's count of a
    request's cached prefix pages (None: `fcfs`)."""
    group, planned = _packing_groups(waiting, running, max_running, adapter_slots, starved)
    if cached_pages is None:
        return sorted(waiting, key=group), planned  # stable: arrival order within each group
    return sorted(waiting, key=lambda r: (group(r), -cached_pages(r))), planned


def _packing_groups(
    waiting: list[Req],
    running: list[Req],
    max_running: int,
    adapter_slots: AdapterSlots | None,
    starved: Callable[[Req], bool],
) -> tuple[Callable[[Req], tuple[int, int]], frozenset]:
    """Each request's group: starved first. When waiting requests want adapters that are not running, the batch is
    packed: the adapters with the most waiting requests get slots until their requests, with those that need no new
    slot (base, or a running adapter), fill the rest of the batch; each slot left over goes to an adapter with the
    fewest waiting requests, whose requests go ahead. So rarely used adapters take turns on the spare slots while
    popular ones keep the batch full, instead of all waiting for the end of a backlog, where the slot limit, not the
    running-request limit, caps the batch. Everything else follows."""
    needs_slot: dict[str, int] = {}  # adapter -> its waiting requests, adapters by first arrival
    running_keys = {r.lora_slot_key for r in running}
    num_ready = 0  # waiting requests that need no new slot
    for r in waiting if adapter_slots is not None else ():
        if starved(r):
            continue
        if r.lora_slot_key is None or r.lora_slot_key in running_keys:
            num_ready += 1
        else:
            needs_slot[r.lora_slot_key] = needs_slot.get(r.lora_slot_key, 0) + 1
    if not needs_slot:
        return lambda r: (-1, 0) if starved(r) else (1, 0), frozenset()
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

    return place, frozenset(rank)

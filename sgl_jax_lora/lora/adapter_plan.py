"""AdapterPlan: the adapters of one planned step, and the slot writes it needs.

Flow: Scheduler.schedule() -> LoRAManager.plan_step(running) -> `reserve(plan, adapter, keep)` per request (host
bookkeeping only: the slot table, the host arrays) -> the ScheduleBatch carries the plan -> EngineCore applies its
`slot_writes` (LoRAManager.apply: host -> device) before launching the step.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class SlotWrite:
    """An adapter to write into a device slot before the planned step runs (the slot table, LoRAMemoryPool, already
    gives it the slot)."""

    slot: int
    lora_id: str
    values: list[np.ndarray]  # the slot's arrays in the model dtype, made on the host while planning
    host_s: float = 0.0  # seconds planning spent making them (part of the adapter's load latency)


@dataclasses.dataclass
class AdapterPlan:
    """The adapters of the step being planned (LoRAManager.plan_step, then `reserve` for each request)."""

    running: frozenset[str] = frozenset()  # adapters of requests already running: their slots stay put
    adapters: set[str] = dataclasses.field(default_factory=set)  # adapters the step uses (base not counted)
    slot_writes: list[SlotWrite] = dataclasses.field(default_factory=list)  # host -> device, applied before launch

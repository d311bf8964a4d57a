"""AdapterSlots: what the Scheduler asks of the LoRA manager about device slots, step by step.

Where it sits: managers/scheduler.py plans each step through it (which adapter joins the step, in which slot);
managers/lora_manager.py's LoRAManager implements it, as do the tests' minimal stand-ins and
scripts/simulate_schedule.py's weightless one.
"""

from __future__ import annotations

from typing import Protocol

from sgl_jax_lora.lora.adapter_plan import AdapterPlan


class AdapterSlots(Protocol):
    """What the scheduler needs from the LoRA manager."""

    def plan_step(self, running: set[str | None]) -> AdapterPlan:
        """The adapter plan of a new step; `running` holds the adapter keys of running requests (their slots stay
        put)."""
        ...

    def reserve(
        self, plan: AdapterPlan, adapter_key: str | None, keep: frozenset[str | None] = frozenset()
    ) -> int | None:
        """Device slot for this adapter in the planned step, or None if it cannot join it; adapters in `keep` are
        not evicted for it. A slot the adapter is not in yet is reserved in host bookkeeping and its write added
        to `plan.slot_writes`; nothing is written to the device. Raises ValueError (naming the adapter and the
        fix) if the adapter cannot be served at all."""
        ...

    def can_evict(self, adapter_key: str) -> bool:
        """Whether this adapter's slot can ever go to another adapter (False for pinned adapters)."""
        ...

    @property
    def max_per_batch(self) -> int:
        """How many adapters the device holds at once (slots besides the base's)."""
        ...

    def is_resident(self, adapter_key: str) -> bool:
        """Whether this adapter is on the device now (taking it needs no load)."""
        ...

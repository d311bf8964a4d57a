"""The device side of a LoRA slot write: a slot's host arrays staged on the devices, and the program that writes them.

Flow: LoRAManager lays an adapter out for one slot (host arrays [L, ...] in the model dtype, memory_pool.py) ->
`stage_slot_values` copies them to the devices in the layout the write reads (`slot_value_shardings`: each LoRA
buffer's sharding without its slot axis) -> ModelRunner's jitted, donated `write_slot` sets [:, slot] of every buffer.
The staged arrays always have those shardings, so the write is one compiled program whoever staged them: a
prefetch thread (the engine loop's write then copies device to device) or the write itself (host arrays).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, Sharding


def slot_value_shardings(lora_state: nnx.State) -> list[Sharding]:
    """For each LoRA buffer [L, A, ...] in flat-state order, the sharding of one slot's values [L, ...]."""
    shardings = []
    for _, var in nnx.to_flat_state(lora_state):
        value = var.get_value()
        sharding = value.sharding
        if isinstance(sharding, NamedSharding):
            spec = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*(spec[:1] + spec[2:])))
        shardings.append(sharding)
    return shardings


def stage_slot_values(values: list, shardings: list[Sharding], wait: bool) -> list[jax.Array]:
    """Host `values` on the devices with `shardings` (every process of a multi-host mesh passes the same values and
    places its own shards); values staged already, as a plain list. wait: return once every copy has landed (one wait
    for all: a copy may queue behind the device's work in flight, so waiting after each would wait for it each time)."""
    if all(isinstance(value, jax.Array) for value in values):
        return list(values)
    staged = [
        jax.make_array_from_callback(value.shape, sharding, lambda index, value=value: value[index])
        for value, sharding in zip(values, shardings, strict=True)
    ]
    if wait:
        jax.block_until_ready(staged)
    return staged


def write_slot(lora_state: nnx.State, slot: jax.Array, values: list[jax.Array]) -> nnx.State:
    """Set [:, slot] of every LoRA buffer (flat-state order) to values[i] [L, ...]."""
    flat = nnx.to_flat_state(lora_state)
    updated = [(path, var.replace(var.get_value().at[:, slot].set(value))) for (path, var), value in zip(flat, values)]
    return nnx.from_flat_state(updated)

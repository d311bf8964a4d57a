"""LoRAMemoryPool: the device tier: which adapter sits in which slot, and writing one into a slot.

Flow: an adapter entering LoRAManager's host cache -> `slot_update(adapter)` lays its host weights out as the
model's LoRA buffers expect (one [L, ...] array per buffer: A parts stacked along rank, B per part, kv
heads replicated like the base weights, rows above the adapter's rank zero; the host cache keeps these) ->
LoRAManager picks a slot for the adapter (`assign`) -> ModelRunner.write_lora_slot
runs one jitted, donated `.at[:, slot].set(...)` per buffer. The shapes never change, so loading,
evicting and unloading never compile. Slot 0 is the base model and stays all zeros; a slot whose adapter is
unloaded is written with `zero_update()`, an evicted one is overwritten whole by its successor.
"""

from __future__ import annotations

import numpy as np

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.weight_layout import replicate_kv_heads
from sgl_jax_lora.lora.adapter import LoRAAdapter
from sgl_jax_lora.lora.eviction import make_eviction_policy
from sgl_jax_lora.lora.target_shapes import LORA_TARGETS

_KV_MODULES = ("k_proj", "v_proj")


class LoRAMemoryPool:
    def __init__(
        self, cfg: ModelConfig, tp_size: int, num_slots: int, max_rank: int, buffer_shapes: dict, eviction_policy: str
    ):
        self.cfg, self.tp_size = cfg, tp_size
        self.num_slots, self.max_rank = num_slots, max_rank
        self.buffer_shapes = buffer_shapes  # state path -> [L, A, ...] shape
        self.slot_owner: list[str | None] = [None] * num_slots  # slot -> lora_id; slot 0 never owned
        self.slot_of: dict[str, int] = {}
        self.slot_scale = np.zeros(num_slots, np.float32)
        self.slot_rank = np.zeros(num_slots, np.int32)
        self.pinned: set[str] = set()
        self.policy = make_eviction_policy(eviction_policy)
        self.num_evictions = 0

    def free_slot(self) -> int | None:
        for slot in range(1, self.num_slots):
            if self.slot_owner[slot] is None:
                return slot
        return None

    def victim(self, busy: set[str]) -> int | None:
        """An occupied slot whose adapter is neither pinned nor used by the step being built."""
        candidates = [o for o in self.slot_owner[1:] if o is not None and o not in busy and o not in self.pinned]
        if not candidates:
            return None
        return self.slot_of[self.policy.select_victim(candidates)]

    def assign(self, slot: int, lora_id: str, rank: int, scaling: float) -> None:
        """Give `slot` to the adapter (its max rank and scaling), evicting the adapter that held it."""
        previous = self.slot_owner[slot]
        if previous is not None:
            self.release(previous)
            self.num_evictions += 1
        self.slot_owner[slot] = lora_id
        self.slot_of[lora_id] = slot
        self.slot_scale[slot] = scaling
        self.slot_rank[slot] = rank
        self.policy.mark_used(lora_id)

    def release(self, lora_id: str) -> None:
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.slot_owner[slot] = None
            self.slot_scale[slot] = 0.0
            self.slot_rank[slot] = 0
        self.policy.remove(lora_id)
        self.pinned.discard(lora_id)

    def zero_update(self, dtype=np.float32) -> dict[tuple[str, ...], np.ndarray]:
        """Host arrays that clear one slot: state path -> zeros [L, *buffer.shape[2:]] in `dtype`."""
        return {path: np.zeros((shape[0],) + tuple(shape[2:]), dtype) for path, shape in self.buffer_shapes.items()}

    def slot_update(self, adapter: LoRAAdapter, dtype=np.float32) -> dict[tuple[str, ...], np.ndarray]:
        """Host arrays for one slot: state path -> [L, *buffer.shape[2:]] in `dtype` (the model's, so that the slot
        write needs no cast: the adapter's weights, in their file's dtype, are cast once, as they are copied in)."""
        by_module: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}  # module -> layer -> (A, B)
        for (layer, module), pair in adapter.weights.items():
            by_module.setdefault(module, {})[layer] = pair
        updates = {}
        for path, shape in self.buffer_shapes.items():
            packed, leaf = path[-2], path[-1]
            hf_modules = LORA_TARGETS[packed][0]
            if leaf == "lora_a":  # (layer -> A, its rows' index) for each part
                copies = [
                    (
                        {layer: a for layer, (a, _) in by_module.get(module, {}).items()},
                        _rows_from(part * self.max_rank),
                    )
                    for part, module in enumerate(hf_modules)
                ]
            else:
                module = _module_of_b(leaf, hf_modules)
                by_layer = {layer: b for layer, (_, b) in by_module.get(module, {}).items()}
                if module in _KV_MODULES:
                    by_layer = {
                        layer: replicate_kv_heads(b, 0, self.cfg, self.tp_size) for layer, b in by_layer.items()
                    }
                copies = [(by_layer, _first_columns)]
            out = _unwritten_zero((shape[0],) + tuple(shape[2:]), dtype, copies)
            for by_layer, index in copies:
                _copy_layers(out, by_layer, index)
            updates[path] = out
        return updates


def _rows_from(start: int):
    return lambda a: (slice(start, start + a.shape[0]),)


def _first_columns(b: np.ndarray) -> tuple[slice, slice]:
    return slice(None), slice(0, b.shape[1])


def _unwritten_zero(shape: tuple[int, ...], dtype, copies: list) -> np.ndarray:
    """The array the copies fill, zero wherever they write nothing. Allocated unfilled (np.zeros memsets a recycled
    block while it holds the GIL: the prefetch threads' largest hold of it beside the engine loop in a profile of a
    cold burst) and zeroed by a fill, which releases it, only when the copies (disjoint: one layer and part each)
    leave some of it unwritten: ranks below max_rank, modules or layers the adapter lacks."""
    out = np.empty(shape, dtype)
    if sum(array.size for by_layer, _ in copies for array in by_layer.values()) != out.size:
        out.fill(0)
    return out


def _copy_layers(out: np.ndarray, by_layer: dict[int, np.ndarray], index) -> None:
    """out[layer][index(array)] = array for each layer's array: in one numpy call when the arrays lie evenly spaced in
    one buffer (an adapter read from one file, whose tensors are views of its data), else one call per layer. A
    prefetch thread beside a busy engine loop waits for the GIL after every numpy call, so the calls' number matters
    more than their size."""
    if not by_layer:
        return
    addresses = {layer: _address(array) for layer, array in by_layer.items()}  # once each: a dict built per call
    layers = sorted(by_layer, key=addresses.__getitem__)  # file order (safetensors sorts by name)
    arrays = [by_layer[layer] for layer in layers]
    stacked = _evenly_spaced(arrays, [addresses[layer] for layer in layers])
    if stacked is None:
        for layer, array in zip(layers, arrays):
            out[(layer,) + index(array)] = array
        return
    rows = slice(layers[0], layers[-1] + 1) if layers == list(range(layers[0], layers[-1] + 1)) else np.array(layers)
    out[(rows,) + index(arrays[0])] = stacked


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _evenly_spaced(arrays: list[np.ndarray], starts: list[int]) -> np.ndarray | None:
    """The arrays (starting at the addresses `starts`) as one read-only [n, ...] view when they are C-contiguous views
    of one buffer with one shape and dtype, each starting the same number of bytes (at least its size) after the one
    before; else None."""
    first = arrays[0]
    if len(arrays) < 2 or first.base is None or not first.flags.c_contiguous:
        return None
    step = starts[1] - starts[0]
    if step < first.nbytes or any(
        array.base is not first.base
        or array.shape != first.shape
        or array.dtype != first.dtype
        or not array.flags.c_contiguous
        or start != starts[0] + i * step
        for i, (array, start) in enumerate(zip(arrays, starts))
    ):
        return None
    return np.lib.stride_tricks.as_strided(
        first, shape=(len(arrays),) + first.shape, strides=(step,) + first.strides, writeable=False
    )


def _module_of_b(leaf: str, hf_modules: tuple[str, ...]) -> str:
    """'lora_b_q' -> 'q_proj', 'lora_b_gate' -> 'gate_proj', 'lora_b' -> the single module."""
    if leaf == "lora_b":
        return hf_modules[0]
    return leaf[len("lora_b_") :] + "_proj"

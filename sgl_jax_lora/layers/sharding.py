"""Mesh construction and the one rules table from logical axis names to mesh axes.

Flow: ServerArgs.tp_size -> make_mesh -> every parameter, KV cache and LoRA buffer gets a NamedSharding
from `logical_to_sharding(axes)` where `axes` are the logical names its module declares
(PARAM_LOGICAL_AXES below, keyed by the parameter's path suffix).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "tensor")

# Logical axis -> mesh axis. Everything not listed is replicated.
SHARDING_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "qkv": "tensor",  # packed q|k|v output, laid out shard-major (see models/weight_loader.py)
    "heads": "tensor",  # attention output features (o_proj input)
    "mlp": "tensor",  # packed gate|up output / down_proj input
    "kv_heads": "tensor",
    "embed": None,
    "layers": None,
    "head_dim": None,
    "lora_slots": None,
    "lora_rank": None,
    "kv_slots": None,
}

# Parameter path suffix -> logical axes (without the leading "layers" axis of stacked decoder layers).
PARAM_LOGICAL_AXES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("norm", "scale"): ("embed",),
    ("input_layernorm", "scale"): ("embed",),
    ("post_attention_layernorm", "scale"): ("embed",),
    ("q_norm", "scale"): ("head_dim",),
    ("k_norm", "scale"): ("head_dim",),
    ("qkv_proj", "kernel"): ("embed", "qkv"),
    ("qkv_proj", "bias"): ("qkv",),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("gate_up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    # LoRA buffers: A [A, R, in], B [A, out, R]; column-parallel B split on out, row-parallel A split on in.
    ("qkv_proj", "lora_a"): ("lora_slots", "lora_rank", "embed"),
    ("qkv_proj", "lora_b_q"): ("lora_slots", "heads", "lora_rank"),
    ("qkv_proj", "lora_b_k"): ("lora_slots", "kv_heads", "lora_rank"),
    ("qkv_proj", "lora_b_v"): ("lora_slots", "kv_heads", "lora_rank"),
    ("o_proj", "lora_a"): ("lora_slots", "lora_rank", "heads"),
    ("o_proj", "lora_b"): ("lora_slots", "embed", "lora_rank"),
    ("gate_up_proj", "lora_a"): ("lora_slots", "lora_rank", "embed"),
    ("gate_up_proj", "lora_b_gate"): ("lora_slots", "mlp", "lora_rank"),
    ("gate_up_proj", "lora_b_up"): ("lora_slots", "mlp", "lora_rank"),
    ("down_proj", "lora_a"): ("lora_slots", "lora_rank", "mlp"),
    ("down_proj", "lora_b"): ("lora_slots", "embed", "lora_rank"),
}


def make_mesh(tp_size: int, devices: list | None = None) -> Mesh:
    """A ("data", "tensor") mesh of 1 x tp_size devices."""
    devices = devices if devices is not None else jax.devices()
    if tp_size > len(devices):
        raise ValueError(
            f"--tp-size {tp_size} needs {tp_size} devices but only {len(devices)} "
            f"{devices[0].platform} device(s) are visible; lower --tp-size"
        )
    grid = np.array(devices[:tp_size]).reshape(1, tp_size)
    return Mesh(grid, MESH_AXES)


def logical_to_spec(axes: tuple[str | None, ...]) -> PartitionSpec:
    return PartitionSpec(*(SHARDING_RULES.get(a) if a else None for a in axes))


def logical_to_sharding(mesh: Mesh, axes: tuple[str | None, ...], shape: tuple[int, ...] | None = None) -> NamedSharding:
    """With `shape`, an axis that does not split evenly (e.g. a vocab of 32001 over 8) stays replicated."""
    spec = logical_to_spec(axes)
    if shape is not None:
        spec = PartitionSpec(
            *(m if m is None or dim % mesh.shape[m] == 0 else None for m, dim in zip(spec, shape))
        )
    return NamedSharding(mesh, spec)


def param_logical_axes(path: tuple[str, ...], ndim: int) -> tuple[str, ...]:
    """Logical axes of a parameter from its path in the model state."""
    for suffix, axes in PARAM_LOGICAL_AXES.items():
        if tuple(path[-len(suffix):]) == suffix:
            if "layers" in path:
                axes = ("layers",) + axes
            if len(axes) != ndim:
                raise ValueError(f"parameter {'.'.join(path)} has {ndim} dims but its rule names {axes}")
            return axes
    raise KeyError(f"no sharding rule for parameter {'.'.join(path)}; add it to PARAM_LOGICAL_AXES")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())

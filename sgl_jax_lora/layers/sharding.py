"""Mesh construction and the one rules table from logical axis names to mesh axes.

Flow: ServerArgs.tp_size -> make_mesh -> every parameter, KV cache and LoRA buffer gets a NamedSharding
from `logical_to_sharding(axes)`. A parameter's `axes` are declared where its module creates it
(`nnx.Param(value, logical_axes=(...))`; the stacked decoder layers add the leading "layers" axis), and
`state_shardings` turns a model state's declared axes into NamedShardings for the weight loader and the
orbax restore (models/weight_loader.py, models/orbax_checkpoint.py).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "tensor")

# Logical axis -> mesh axis (None: replicated). Every logical axis a module declares must be listed here.
SHARDING_RULES: dict[str, str | None] = {
    "vocab": "tensor",
    "qkv": "tensor",  # packed q|k|v output, laid out shard-major (see layers/linear.py)
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
    unknown = [a for a in axes if a is not None and a not in SHARDING_RULES]
    if unknown:
        raise KeyError(f"logical axes {unknown} have no rule; add them to SHARDING_RULES in layers/sharding.py")
    return PartitionSpec(*(SHARDING_RULES[a] if a else None for a in axes))


def logical_to_sharding(
    mesh: Mesh, axes: tuple[str | None, ...], shape: tuple[int, ...] | None = None
) -> NamedSharding:
    """With `shape`, an axis that does not split evenly (e.g. a vocab of 32001 over 8) stays replicated."""
    spec = logical_to_spec(axes)
    if shape is not None:
        spec = PartitionSpec(*(m if m is None or dim % mesh.shape[m] == 0 else None for m, dim in zip(spec, shape)))
    return NamedSharding(mesh, spec)


def declared_axes(path: tuple[str, ...], variable: nnx.Variable) -> tuple[str, ...]:
    """The logical axes a parameter's module declared for it (one per dimension)."""
    axes = variable.get_metadata().get("logical_axes")
    name = ".".join(path)
    if axes is None:
        raise KeyError(
            f"parameter {name} declares no logical axes; pass logical_axes=(...) where its module creates it"
        )
    ndim = len(variable.get_value().shape)
    if len(axes) != ndim:
        raise ValueError(f"parameter {name} has {ndim} dims but declares the logical axes {axes}")
    return tuple(axes)


def state_shardings(mesh: Mesh, state: nnx.State) -> dict[tuple[str, ...], NamedSharding]:
    """Parameter path -> its NamedSharding on `mesh`, from the axes each parameter declares (abstract state is fine)."""
    shardings = {}
    for path, variable in nnx.to_flat_state(state):
        path = tuple(str(p) for p in path)
        shape = tuple(variable.get_value().shape)
        shardings[path] = logical_to_sharding(mesh, declared_axes(path, variable), shape)
    return shardings


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())

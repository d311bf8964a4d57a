"""Lowering for CUDA on a host without a GPU: `hopper_target()` names the GPU a Triton kernel is lowered for.

Where it sits: around the tests' `.lower(lowering_platforms=("cuda",))` calls on CPU (the attention and K/V-write
kernels, the whole forward in tests/support/model_export.py). From JAX 0.11 the Triton lowering asks which GPU it
targets (its compute capability) and, with no GPU attached, reads it from the abstract mesh's device; JAX 0.10 takes
the capability from the lowering alone and needs no target. The Mosaic GPU kernels need none either way.
What exists here: `hopper_target`, `needs_a_target`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

# an H100's name as its CUDA device reports it, and its SMs: what the GPU kernels are tuned for (compute capability 9.0)
HOPPER_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
HOPPER_SMS = 132


@contextlib.contextmanager
def hopper_target() -> Iterator[None]:
    """A context in which CUDA lowering on a host without a GPU targets a Hopper GPU; a no-op where a GPU is
    attached or the JAX version does not ask."""
    if not needs_a_target():
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind=HOPPER_DEVICE_KIND, num_cores=HOPPER_SMS, platform="gpu")
    # Auto axes, as the model's meshes have: JAX checks a context mesh against a sharding's mesh only where axes are
    # explicit, so the forwards' shardings on the fake CPU devices stand beside it
    mesh = jax.sharding.AbstractMesh((1,), ("target",), (jax.sharding.AxisType.Auto,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def needs_a_target() -> bool:
    """Whether CUDA lowering here needs `hopper_target`: no GPU attached, and a JAX whose Triton lowering asks. Under
    it, a program that shards with `shard_map` on the fake CPU devices (tp > 1) does not lower: shard_map wants the
    context mesh to be its own."""
    return not any(device.platform == "gpu" for device in jax.devices()) and _triton_asks_for_a_target()


def _triton_asks_for_a_target() -> bool:
    """Whether this JAX's Triton lowering reads the target GPU from the abstract mesh (JAX 0.11 on)."""
    try:
        from jax._src.pallas.triton import gpu_info  # noqa: PLC0415 (a private module that only newer JAX has)
    except ImportError:
        return False
    return hasattr(gpu_info, "get_gpu_info")

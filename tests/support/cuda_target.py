"""Lowering for CUDA on a host without a GPU: `hopper_target()` names the GPU a Triton kernel is lowered for.

Where it sits: around the tests' `.lower(lowering_platforms=("cuda",))` calls on CPU (the attention and K/V-write
kernels, the whole forward in tests/support/model_export.py). From JAX 0.11 the Triton lowering asks which GPU it
targets (its compute capability): the kind of the abstract mesh's device where one names a GPU, else the kind of the
default device, looked up in the lowering's registry of device kinds. With no GPU attached that kind is the CPU's;
`hopper_target` registers it as a Hopper GPU while it lasts, which leaves every mesh as it is (an abstract GPU mesh
as the context would be refused by `shard_map` beside the fake CPU devices' mesh, tp > 1). JAX 0.10 takes the
capability from the lowering alone and needs no target; the Mosaic GPU kernels need none either way.
What exists here: `hopper_target`, `needs_a_target`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

# the compute capability of an H100 (Hopper), what the GPU kernels are tuned for
HOPPER_ARCH = "9.0"


@contextlib.contextmanager
def hopper_target() -> Iterator[None]:
    """A context in which CUDA lowering on a host without a GPU targets a Hopper GPU; a no-op where a GPU is
    attached or the JAX version does not ask."""
    if not needs_a_target():
        yield
        return
    from jax._src.pallas.triton import gpu_info  # noqa: PLC0415 (private; only a JAX that asks has it)

    kind = jax.devices()[0].device_kind
    hopper = gpu_info.GpuInfo(
        gpu_version=None, arch_name=HOPPER_ARCH, compute_capability=int(HOPPER_ARCH.replace(".", ""))
    )
    before = gpu_info.registry.get(kind)
    gpu_info.registry[kind] = lambda: hopper
    try:
        yield
    finally:
        if before is None:
            gpu_info.registry.pop(kind, None)
        else:
            gpu_info.registry[kind] = before


def needs_a_target() -> bool:
    """Whether CUDA lowering here needs `hopper_target`: no GPU attached, and a JAX whose Triton lowering asks."""
    return not any(device.platform == "gpu" for device in jax.devices()) and _triton_asks_for_a_target()


def _triton_asks_for_a_target() -> bool:
    """Whether this JAX's Triton lowering looks the target GPU up (JAX 0.11 on)."""
    try:
        from jax._src.pallas.triton import gpu_info  # noqa: PLC0415 (a private module that only newer JAX has)
    except ImportError:
        return False
    return hasattr(gpu_info, "get_gpu_info") and hasattr(gpu_info, "registry")

"""The engine's adapter commands, run between steps: register an adapter from its directory or from memory (an
update registers the next version of a loaded adapter), and unregister one.

Where it sits: EngineCore's `rpc_load_lora`, `rpc_load_lora_tensors` and `rpc_unload_lora` (the engine process's
calls, managers/engine_process.py) hand their arguments here with the engine's LoRAManager (managers/lora_manager.py:
names, pins, device slots) and LoRASetup (lora/lora_setup.py: the adapters' host weights); both are None when the
engine serves no LoRA. What exists here: `load_from_dir`, `load_from_memory`, `unload`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_jax_lora.lora.lora_ref import LoRARef
from sgl_jax_lora.managers.io_struct import AdapterLoaded, Unloaded

if TYPE_CHECKING:  # types only: the engine builds both
    from sgl_jax_lora.lora.lora_setup import LoRASetup
    from sgl_jax_lora.managers.lora_manager import LoRAManager

_NOT_ENABLED = "LoRA is not enabled; restart with --enable-lora or --lora-paths"


def load_from_dir(lora: LoRAManager | None, ref: LoRARef, summary=None) -> AdapterLoaded:
    """Register an adapter from its directory; `summary`: its header check done ahead (LoRAManager.inspect_ahead)."""
    if lora is None:
        raise ValueError(_NOT_ENABLED)
    adapter = lora.register(ref, summary)
    return AdapterLoaded(adapter.rank, sorted(adapter.target_modules))


def load_from_memory(
    lora: LoRAManager | None,
    lora_setup: LoRASetup | None,
    ref: LoRARef,
    tensors_paths: list[str],
    config: dict | None,
    replaces: str | None = None,
    checked_finite: bool = False,
) -> AdapterLoaded:
    """An adapter from memory (a safetensors-layout file in shared memory + config dict), or an update: the next
    version of adapter `replaces`, with its config unless one is given. The old version keeps serving its running
    requests until the frontend unloads it; it gives up its pin so that the new version can take one (and takes it
    back if the new version fails to register)."""
    if lora is None or lora_setup is None:
        raise ValueError(_NOT_ENABLED)
    old = lora.refs.get(replaces) if replaces is not None else None
    if replaces is not None and old is None:
        raise ValueError(f"adapter '{ref.lora_name}': the version to update is no longer loaded; load it again")
    adapter = lora_setup.from_memory(ref, tensors_paths, config, checked_finite, replaces=old)
    if old is not None:
        lora.unpin(old.lora_id)
    try:
        lora.register(ref)
    except Exception:
        lora_setup.forget(ref.lora_id)
        if old is not None and old.pinned:
            lora.pool.pinned.add(old.lora_id)
        raise
    return AdapterLoaded(adapter.rank, sorted(adapter.target_modules))


def unload(lora: LoRAManager | None, lora_setup: LoRASetup | None, lora_id: str) -> Unloaded:
    """Unregister an adapter and drop its host weights."""
    if lora is None or lora_setup is None:
        raise ValueError(_NOT_ENABLED)
    lora.unregister(lora_id)
    lora_setup.forget(lora_id)
    return Unloaded()

"""Adapter files as untrusted input: where they may lie, what their tensors may hold, what an error may show.

Flow: `/load_lora_adapter` and on-demand loads (TokenizerManager) -> `confined_dir` (the directory, resolved)
-> `check_adapter_files` on a worker thread (config and weights resolved with os.path.realpath and required
inside --lora-allowed-dirs; every tensor finite) -> the engine process, whose loader (peft_config.py,
adapter.py) resolves each file again through `confined_file` before opening it and checks each tensor with
`refuse_non_finite` when it reads the weights (the files may have changed since the frontend looked).

A symlink is followed, and what it points to must itself lie inside an allowed directory. Errors name the
adapter, the file (as the client spelled it) and the fix; they never quote what a file contains.
"""

from __future__ import annotations

import os

import numpy as np

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_SHOWN_CHARS = 64  # names and paths quoted in errors are cut to this many characters


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter, the problem and the fix."""


def adapter_error(name: str, problem: str, fix: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"adapter '{shown(name)}': {problem}; {fix}")


def shown(text: str) -> str:
    """`text` cut for an error message (a client may send a megabyte-long name)."""
    return text if len(text) <= MAX_SHOWN_CHARS else text[:MAX_SHOWN_CHARS] + f"...({len(text)} chars)"


def is_within(path: str, allowed_dirs: list[str] | tuple[str, ...]) -> bool:
    """Whether `path` (already resolved) lies strictly inside one of `allowed_dirs` (resolved here)."""
    for allowed in allowed_dirs:
        root = os.path.realpath(allowed)
        if path.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False


def confined_dir(name: str, path: str, allowed_dirs: list[str] | tuple[str, ...]) -> str:
    """The resolved adapter directory, refused unless it lies inside an allowed directory."""
    real = os.path.realpath(path)
    if not is_within(real, allowed_dirs) or not os.path.isdir(real):
        raise adapter_error(name, f"path '{shown(path)}' is not an adapter directory inside the directories "
                            "the operator allowed", "restart with --lora-allowed-dirs DIR containing it, or "
                            "register it with --lora-paths")
    return real


def confined_file(name: str, path: str, allowed_dirs: list[str] | tuple[str, ...] | None) -> str:
    """`path` resolved (symlinks followed); with `allowed_dirs`, refused unless the target lies inside one."""
    real = os.path.realpath(path)
    if allowed_dirs is not None and not is_within(real, allowed_dirs):
        raise adapter_error(name, f"{os.path.basename(path)} resolves (through a symlink) to a file outside "
                            "the directories the operator allowed", "copy the file into the adapter directory "
                            "instead of linking to it")
    return real


def refuse_non_finite(name: str, key: str, tensor: np.ndarray) -> None:
    """Raise if `tensor` holds NaN or Inf: one such value would make every token through its slot NaN."""
    if tensor.dtype.kind in "fc" or tensor.dtype.name == "bfloat16":
        if not np.isfinite(np.sum(tensor)) and not np.isfinite(tensor).all():  # the sum: one pass, no mask
            raise adapter_error(name, f"tensor {shown(key)!r} in {WEIGHTS_FILE} holds NaN or Inf values",
                                "fix the training run (or the conversion) that produced them and re-save the adapter")


def check_adapter_files(name: str, adapter_dir: str, allowed_dirs: list[str] | tuple[str, ...] | None) -> None:
    """Frontend check before an adapter is registered: its config and weights are inside the allowed directories
    (after resolving symlinks) and every tensor is finite. Reads the weights once, tensor by tensor."""
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy, so safetensors can hand bf16 tensors over
    from safetensors import SafetensorError, safe_open

    confined_file(name, os.path.join(adapter_dir, CONFIG_FILE), allowed_dirs)
    weights = os.path.join(adapter_dir, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        return  # the engine's loader names what is missing
    real = confined_file(name, weights, allowed_dirs)
    try:
        with safe_open(real, framework="np") as f:
            for key in f.keys():
                refuse_non_finite(name, key, f.get_tensor(key))
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        if isinstance(e, LoRAAdapterError):
            raise
        raise adapter_error(name, f"cannot read {WEIGHTS_FILE} ({type(e).__name__})", "re-save the adapter") from e

"""Quiet start: drop the messages that libraries print while probing the platform, which a new user reads
as failures although nothing is wrong.

Flow: `quiet_platform_probes()` runs first thing in each process that imports transformers or starts JAX
(launch.main, the engine process entry, the lazy `sgl_jax_lora.Engine`), before those imports. It drops:
- transformers' "PyTorch was not found. Models won't be available ..." (this engine needs no torch: it
  uses transformers only for tokenizers, configs and chat templates), and only that message;
- JAX's INFO lines "Unable to initialize backend 'tpu' / 'cuda' ...", logged while JAX looks for each
  platform it was built for. JAX's warnings (e.g. "An NVIDIA GPU may be present on this machine, but a
  CUDA-enabled jaxlib is not installed") stay: those a user should act on.

`skip_tpu_probe_without_chips()` runs in each process that starts JAX's devices (the engine process, a multi-host
follower), before it does: libtpu, installed on a host without a TPU (the test extra installs it, to compile for TPU
slices), prints lines of errors from C++ while JAX probes the 'tpu' platform ("Failed to find host bounds",
"unexpected worker hostname"), which no logging filter reaches. Without a TPU chip on the host the probe is
skipped, as JAX itself skips 'cuda' without a visible NVIDIA GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os

TRANSFORMERS_NO_TORCH = "PyTorch was not found"


class _DropMessagePrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_platform_probes(log_level: str = "info") -> None:
    """Install the filters (idempotent; call before importing transformers or initializing JAX).

    With --log-level debug nothing is dropped."""
    if log_level.lower() == "debug":
        return
    transformers_logger = logging.getLogger("transformers")
    if not any(isinstance(f, _DropMessagePrefix) for f in transformers_logger.filters):
        transformers_logger.addFilter(_DropMessagePrefix(TRANSFORMERS_NO_TORCH))
    # INFO: "Unable to initialize backend ..."; WARNING and above pass.
    bridge = logging.getLogger("jax._src.xla_bridge")
    if bridge.level == logging.NOTSET or bridge.level < logging.WARNING:
        bridge.setLevel(logging.WARNING)


def skip_tpu_probe_without_chips(log_level: str = "info") -> bool:
    """Leave the 'tpu' platform out of JAX's probe when this host has no TPU chip; True when it was left out.

    Nothing changes when JAX_PLATFORMS names the platforms, with JAX_FORCE_TPU_INIT, with --log-level debug, once
    JAX's devices have started, or where JAX's internals differ (the names read here are private to JAX: the
    probe then runs as before). Compiling for a TPU slice (model_executor/tpu_aot.py) loads libtpu by itself and
    still works."""
    if log_level.lower() == "debug" or os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ:
        return False
    try:
        from jax._src import hardware_utils, xla_bridge  # noqa: PLC0415 (JAX's import, only where devices start)

        if xla_bridge.config.jax_platforms.value or xla_bridge._backends:
            return False
        if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
            return False
        registration = xla_bridge._backend_factories.get("tpu")
        if registration is None:
            return False
        # the platform stays registered (the TPU kernels' lowering rules name it); its probe finds nothing
        xla_bridge._backend_factories["tpu"] = dataclasses.replace(registration, factory=_no_tpu_chip)
        return True
    except (ImportError, AttributeError, TypeError):
        return False


def _no_tpu_chip() -> None:
    """The 'tpu' probe on a host without a TPU chip: no client (JAX then goes on to the other platforms)."""
    return None

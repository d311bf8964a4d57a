"""Quiet start: drop the messages that libraries print while probing the platform, which a new user reads
as failures although nothing is wrong.

Flow: `quiet_platform_probes()` runs first thing in each process that imports transformers or starts JAX
(launch.main, the engine process entry, the lazy `sgl_jax_lora.Engine`), before those imports. It drops:
- transformers' "PyTorch was not found. Models won't be available ..." (this engine needs no torch: it
  uses transformers only for tokenizers, configs and chat templates), and only that message;
- JAX's INFO lines "Unable to initialize backend 'tpu' / 'cuda' ...", logged while JAX looks for each
  platform it was built for. JAX's warnings (e.g. "An NVIDIA GPU may be present on this machine, but a
  CUDA-enabled jaxlib is not installed") stay: those a user should act on.
"""

from __future__ import annotations

import logging

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

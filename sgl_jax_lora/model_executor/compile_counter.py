"""Counts compilations in this process, so tests can prove none happen after warmup.

Every new program is lowered to MLIR before XLA compiles it or finds it in the persistent compilation cache,
so counting lowerings counts cache hits too: a recompilation cannot hide behind the cache.

Flow: the engine process installs the listener at start; ModelRunner reports the count in server info
(`num_compilations`) and the engine's `get_server_info()` exposes it.
"""

from __future__ import annotations

import jax

_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


class CompileCounter:
    def __init__(self) -> None:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_secs: float, **kwargs: object) -> None:
        if event == _EVENT:
            self.count += 1

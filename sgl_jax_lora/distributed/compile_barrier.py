"""CompileBarrier: every node compiles a new program before any node runs it.

Flow: ReplicaModelRunner wraps each jitted step function with `CompileBarrier.wrap` -> the first call with new
argument shapes compiles the program ahead of time (`lower().compile()`, which fills the cache the call path reads),
waits at a barrier of the coordination service until every node has compiled it, then runs it. A node that ran a
program's collectives while another still compiled would wait in the collective's set-up, which gives up after a
fixed time (30 s with gloo on CPU). Calls with known shapes (every step after warmup) skip all of this.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

BARRIER_PREFIX = "sgl_jax_lora/compiled"


class CompileBarrier:
    def __init__(self, client, timeout_s: int):
        self.client = client
        self.timeout_ms = timeout_s * 1000
        self.num_barriers = 0  # every node counts the same: they compile the same programs in the same order

    def wait(self) -> None:
        """Until every node has reached this barrier (the next in order)."""
        self.client.wait_at_barrier(f"{BARRIER_PREFIX}/{self.num_barriers}", self.timeout_ms)
        self.num_barriers += 1

    def wrap(self, jitted, num_state_args: int) -> SyncedJit:
        """`jitted` whose first `num_state_args` arguments (model state, KV cache) never change shape."""
        return SyncedJit(self, jitted, num_state_args)


class SyncedJit:
    def __init__(self, barrier: CompileBarrier, jitted, num_state_args: int):
        self.barrier, self.jitted, self.num_state_args = barrier, jitted, num_state_args
        self.lower: Callable = jitted.lower
        self.compiled_keys: set = set()

    def key(self, args: tuple, kwargs: dict) -> tuple:
        leaves, structure = _flatten((args[self.num_state_args :], kwargs))
        return structure, tuple(_leaf_key(x) for x in leaves)

    def __call__(self, *args, **kwargs):
        key = self.key(args, kwargs)
        if key not in self.compiled_keys:
            self.jitted.lower(*args, **kwargs).compile()
            self.barrier.wait()
            self.compiled_keys.add(key)
        return self.jitted(*args, **kwargs)


def _leaf_key(leaf: object) -> tuple:
    """Shape and dtype of an array; the type and value of a Python scalar (a static argument such as num_top: jit
    compiles 1, True and 1.0 as three programs, though they compare equal)."""
    if isinstance(leaf, (bool, int, float, str)):
        return ("static", type(leaf).__name__, leaf)
    return np.shape(leaf), str(leaf.dtype)


def _flatten(tree) -> tuple[list, object]:
    import jax

    leaves, structure = jax.tree_util.tree_flatten(tree)
    return leaves, structure

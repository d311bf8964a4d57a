"""sgl_jax_lora/model_executor/compile_counter.py: the counter counts one per new program lowered (a new function, a
new shape, a new static argument), none for a call that reuses a compiled program, and still counts a program
lowered again after the in-memory caches are cleared; other monitoring events do not count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.model_executor.compile_counter import CompileCounter


@pytest.fixture
def counter():
    counter = CompileCounter()
    yield counter
    jax.monitoring.unregister_event_duration_listener(counter._on_event)


# Inputs are numpy arrays: making them with jax.numpy would lower programs of its own.
def test_a_new_program_counts_once_and_its_reuse_not_at_all(counter):
    @jax.jit
    def f(x):
        return x * 2 + 1

    f(np.ones((3,), np.float32)).block_until_ready()
    assert counter.count == 1
    for value in (2.0, 5.0):
        f(np.full((3,), value, np.float32)).block_until_ready()
    assert counter.count == 1


def test_each_new_shape_dtype_or_static_argument_counts(counter):
    def f(x, n):
        return x * n

    g = jax.jit(f, static_argnums=1)
    g(np.ones((2,)), 2)
    g(np.ones((4,)), 2)
    g(np.ones((4,), np.int32), 2)
    g(np.ones((4,), np.int32), 3)
    g(np.ones((4,), np.int32), 3)
    assert counter.count == 4


def test_a_program_lowered_again_after_the_caches_are_cleared_counts(counter):
    @jax.jit
    def f(x):
        return jnp.sin(x)

    f(np.ones((5,)))
    jax.clear_caches()
    f(np.ones((5,)))
    assert counter.count == 2


def test_only_the_lowering_event_counts(counter):
    counter._on_event("/jax/core/compile/backend_compile_duration", 0.1)
    counter._on_event("/jax/core/compile/jaxpr_trace_duration", 0.1)
    assert counter.count == 0
    counter._on_event("/jax/core/compile/jaxpr_to_mlir_module_duration", 0.1, fun_name="f")
    assert counter.count == 1


def test_two_counters_count_independently(counter):
    f = jax.jit(lambda x: x - 3)
    f(np.ones((6,)))
    second = CompileCounter()
    try:
        f(np.ones((7,)))
        assert (counter.count, second.count) == (2, 1)
    finally:
        jax.monitoring.unregister_event_duration_listener(second._on_event)

"""sgl_jax_lora/distributed/compile_barrier.py: barriers are numbered in the order they are reached; a call with new
argument shapes compiles its program once and waits at one barrier before running it, a call with known shapes does
neither; the state arguments do not enter the key; Python scalars are keyed by type and value, arrays by shape and
dtype; a wrapped call returns what the plain jitted function returns."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sgl_jax_lora.distributed.compile_barrier import BARRIER_PREFIX, CompileBarrier, _leaf_key


class FakeClient:
    """The coordination client's `wait_at_barrier`, recording each barrier it is asked to wait at."""

    def __init__(self):
        self.barriers: list[tuple[str, int]] = []

    def wait_at_barrier(self, barrier_id: str, timeout_in_ms: int) -> None:
        self.barriers.append((barrier_id, timeout_in_ms))


class CountingJit:
    """A jitted function that counts its `lower` calls (each is one ahead-of-time compile by SyncedJit)."""

    def __init__(self, jitted):
        self.jitted, self.num_lowered = jitted, 0

    def lower(self, *args, **kwargs):
        self.num_lowered += 1
        return self.jitted.lower(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.jitted(*args, **kwargs)


def step(state, x, scale):
    return state["w"] @ x * scale


def make(num_state_args: int = 1, static: tuple[int, ...] = ()):
    client = FakeClient()
    jitted = CountingJit(jax.jit(step, static_argnums=static))
    return client, jitted, CompileBarrier(client, timeout_s=7).wrap(jitted, num_state_args)


def test_barriers_are_numbered_in_order_with_the_timeout_in_ms():
    client = FakeClient()
    barrier = CompileBarrier(client, timeout_s=3)
    for _ in range(3):
        barrier.wait()
    assert client.barriers == [(f"{BARRIER_PREFIX}/{i}", 3000) for i in range(3)]
    assert barrier.num_barriers == 3


def test_a_new_shape_compiles_once_and_waits_once_a_known_one_does_neither():
    client, jitted, synced = make()
    state = {"w": jnp.ones((4, 4), jnp.float32)}
    synced(state, jnp.ones((4,), jnp.float32), jnp.float32(2))
    assert (jitted.num_lowered, len(client.barriers)) == (1, 1)
    for _ in range(3):
        synced(state, jnp.full((4,), 3.0, jnp.float32), jnp.float32(5))  # same shapes, other values
    assert (jitted.num_lowered, len(client.barriers)) == (1, 1)
    synced(state, jnp.ones((4, 2), jnp.float32), jnp.float32(2))  # a new shape: a new program
    synced(state, jnp.ones((4,), jnp.bfloat16), jnp.float32(2))  # a new dtype: a new program
    assert jitted.num_lowered == 3
    assert [name for name, _ in client.barriers] == [f"{BARRIER_PREFIX}/{i}" for i in range(3)]


def test_state_arguments_do_not_enter_the_key():
    _, _, synced = make(num_state_args=1)
    x, scale = jnp.ones((4,), jnp.float32), jnp.float32(1)
    small = synced.key(({"w": jnp.ones((4, 4))}, x, scale), {})
    other = synced.key(({"w": jnp.ones((4, 4), jnp.bfloat16), "b": jnp.ones(3)}, x, scale), {})
    assert small == other
    _, _, keyed_state = make(num_state_args=0)
    assert keyed_state.key(({"w": jnp.ones((4, 4))}, x, scale), {}) != keyed_state.key(
        ({"w": jnp.ones((4, 4), jnp.bfloat16)}, x, scale), {}
    )


def test_keyword_arguments_enter_the_key():
    _, _, synced = make()
    state, x = {"w": jnp.ones((2, 2))}, jnp.ones(2)
    assert synced.key((state, x), {"scale": jnp.ones(())}) != synced.key((state, x), {"scale": jnp.ones(3)})
    assert synced.key((state, x), {"scale": jnp.ones(())}) != synced.key((state, x, jnp.ones(())), {})


def test_a_known_key_skips_compile_and_barrier():
    client, jitted, synced = make()
    state, x, scale = {"w": jnp.eye(3)}, jnp.arange(3.0), jnp.float32(2)
    synced.compiled_keys.add(synced.key((state, x, scale), {}))  # as precompile_forwards marks its programs
    np.testing.assert_allclose(synced(state, x, scale), [0.0, 2.0, 4.0])
    assert (jitted.num_lowered, client.barriers) == (0, [])


def test_leaf_key_of_python_scalars_is_their_type_and_value_of_arrays_their_shape_and_dtype():
    assert _leaf_key(3) == ("static", "int", 3)
    assert _leaf_key(0.5) == ("static", "float", 0.5)
    assert _leaf_key("greedy") == ("static", "str", "greedy")
    assert _leaf_key(True) == ("static", "bool", True)
    assert _leaf_key(3) != _leaf_key(4)
    assert len({_leaf_key(1), _leaf_key(True), _leaf_key(1.0)}) == 3  # equal values, three programs
    assert _leaf_key(np.zeros((2, 3), np.int32)) == ((2, 3), "int32")
    assert _leaf_key(jnp.zeros((5,), jnp.bfloat16)) == ((5,), "bfloat16")
    assert _leaf_key(np.float32(1.0)) == ((), "float32")  # a numpy scalar is traced: its value does not matter
    assert _leaf_key(jnp.ones((2, 3))) == _leaf_key(jnp.zeros((2, 3)))


def test_a_new_static_value_is_a_new_program():
    client, jitted, synced = make(static=(2,))
    state, x = {"w": jnp.eye(2)}, jnp.ones(2)
    np.testing.assert_allclose(synced(state, x, 2), [2.0, 2.0])
    np.testing.assert_allclose(synced(state, x, 3), [3.0, 3.0])
    synced(state, x, 3)
    assert (jitted.num_lowered, len(client.barriers)) == (2, 2)


def test_an_equal_static_value_of_another_type_is_a_new_program():
    client, jitted, synced = make(static=(2,))
    state, x = {"w": jnp.eye(2)}, jnp.ones(2)
    synced(state, x, 1)
    synced(state, x, True)
    synced(state, x, 1.0)
    assert len(client.barriers) == 3


def test_the_call_path_reuses_the_program_compiled_ahead_of_time():
    events: list[str] = []

    def listen(event: str, duration: float, **kwargs: object) -> None:
        events.append(event)

    def fresh_step(state, x):  # its own function: no other test has compiled it
        return state["w"] @ x + 1.0

    synced = CompileBarrier(FakeClient(), timeout_s=1).wrap(jax.jit(fresh_step), 1)
    state, x = {"w": jnp.eye(7)}, jnp.arange(7.0)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        synced(state, x)
        synced(state, x)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert events.count("/jax/core/compile/backend_compile_duration") == 1


def test_results_equal_the_plain_jitted_function():
    _, _, synced = make()
    rng = np.random.default_rng(0)
    state = {"w": jnp.asarray(rng.standard_normal((5, 5)), jnp.float32)}
    plain = jax.jit(step)
    for n in (1, 3, 1):
        x = jnp.asarray(rng.standard_normal((5, n)), jnp.float32)
        scale = jnp.float32(rng.standard_normal())
        np.testing.assert_array_equal(synced(state, x, scale), plain(state, x, scale))
        np.testing.assert_allclose(
            synced(state, x, scale), np.asarray(state["w"]) @ np.asarray(x) * float(scale), rtol=1e-5
        )


def test_wrap_exposes_the_jitted_functions_lower():
    jitted = jax.jit(functools.partial(step, scale=1.0))
    synced = CompileBarrier(FakeClient(), timeout_s=1).wrap(jitted, 0)
    lowered = synced.lower({"w": jnp.eye(2)}, jnp.ones(2))
    assert lowered.out_info.shape == (2,)

"""sgl_jax_lora/layers/layer_stack.py: a LayerStack stands for layer `layer` of an [L, A, ...] buffer: `sliced()` is
that layer's [A, ...] array for a traced layer index too (inside jit and a `lax.scan` over layers), its layer shape
drops the leading L, it is a pytree of the stack and the index, and the helpers treat a plain [A, ...] array as
itself."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.layers.layer_stack import LayerStack, as_layer_array, layer_shape

STACK = np.arange(4 * 3 * 2 * 5, dtype=np.float32).reshape(4, 3, 2, 5)  # [L=4, A=3, 2, 5]


def test_sliced_is_the_layer_of_the_stack():
    for layer in range(4):
        view = LayerStack(jnp.asarray(STACK), jnp.int32(layer))
        np.testing.assert_array_equal(view.sliced(), STACK[layer])


def test_sliced_with_a_traced_layer_inside_jit():
    @jax.jit
    def pick(stack, layer):
        return LayerStack(stack, layer).sliced()

    for layer in (3, 0, 2):
        np.testing.assert_array_equal(pick(jnp.asarray(STACK), jnp.int32(layer)), STACK[layer])


def test_a_scan_over_layers_sees_each_layer_in_turn():
    def body(total, layer):
        view = LayerStack(jnp.asarray(STACK), layer)
        return total + as_layer_array(view).sum(), as_layer_array(view)[1, 0, 0]

    total, firsts = jax.lax.scan(body, jnp.float32(0), jnp.arange(4, dtype=jnp.int32))
    assert float(total) == STACK.sum()
    np.testing.assert_array_equal(firsts, STACK[:, 1, 0, 0])


def test_layer_shape_drops_the_layer_axis_and_leaves_an_array_as_it_is():
    view = LayerStack(jnp.asarray(STACK), jnp.int32(1))
    assert view.layer_shape == (3, 2, 5)
    assert layer_shape(view) == (3, 2, 5)
    assert layer_shape(jnp.zeros((3, 7))) == (3, 7)


def test_as_layer_array_passes_a_plain_array_through():
    array = jnp.asarray(STACK[2])
    assert as_layer_array(array) is array
    np.testing.assert_array_equal(as_layer_array(LayerStack(jnp.asarray(STACK), jnp.int32(2))), STACK[2])


def test_it_is_a_pytree_of_the_stack_and_the_layer():
    view = LayerStack(jnp.asarray(STACK), jnp.int32(3))
    leaves, treedef = jax.tree_util.tree_flatten(view)
    assert len(leaves) == 2
    np.testing.assert_array_equal(leaves[0], STACK)
    assert int(leaves[1]) == 3
    doubled = jax.tree_util.tree_unflatten(treedef, [leaves[0] * 2, leaves[1] - 1])
    assert isinstance(doubled, LayerStack)
    np.testing.assert_array_equal(doubled.sliced(), STACK[2] * 2)


def test_it_crosses_into_jit_whole():
    @jax.jit
    def shape_and_sum(view: LayerStack):
        return view.sliced().sum()

    view = LayerStack(jnp.asarray(STACK), jnp.int32(1))
    assert float(shape_and_sum(view)) == STACK[1].sum()


def test_it_is_frozen():
    view = LayerStack(jnp.asarray(STACK), jnp.int32(0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.layer = jnp.int32(1)

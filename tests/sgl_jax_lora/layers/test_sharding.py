"""sgl_jax_lora/layers/sharding.py: the mesh, the logical-axis rules table and the axes each parameter declares.
A parameter without declared axes, or with the wrong number of them, an axis without a rule, or more devices than
are visible are refused naming the fix; an axis that does not split evenly stays replicated. (The axes the model's
parameters declare are checked in tests/sgl_jax_lora/models/test_llama.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from sgl_jax_lora.layers.sharding import declared_axes, logical_to_sharding, logical_to_spec, make_mesh, state_shardings


def test_a_parameter_without_declared_axes_is_refused():
    with pytest.raises(KeyError, match="parameter w declares no logical axes"):
        declared_axes(("w",), nnx.Param(jnp.zeros((2, 3))))
    with pytest.raises(ValueError, match="has 2 dims but declares the logical axes"):
        declared_axes(("w",), nnx.Param(jnp.zeros((2, 3)), logical_axes=("embed",)))


def test_logical_axes_map_to_the_tensor_axis_and_an_unknown_axis_is_refused():
    assert logical_to_spec(("layers", "embed", "qkv")) == PartitionSpec(None, None, "tensor")
    assert logical_to_spec((None, "vocab")) == PartitionSpec(None, "tensor")
    with pytest.raises(KeyError, match=r"logical axes \['experts'\] have no rule"):
        logical_to_spec(("embed", "experts"))


def test_an_axis_that_does_not_split_evenly_stays_replicated():
    mesh = make_mesh(4)
    assert mesh.shape == {"data": 1, "tensor": 4}
    assert logical_to_sharding(mesh, ("embed", "vocab"), (8, 32)).spec == PartitionSpec(None, "tensor")
    assert logical_to_sharding(mesh, ("embed", "vocab"), (8, 30)).spec == PartitionSpec(None, None)
    assert logical_to_sharding(mesh, ("embed", "vocab")).spec == PartitionSpec(None, "tensor")  # no shape: no check


def test_a_mesh_larger_than_the_visible_devices_is_refused():
    with pytest.raises(ValueError, match=f"--tp-size 16 needs 16 devices but only {jax.device_count()}"):
        make_mesh(16)
    assert make_mesh(2, jax.devices()[2:]).devices.tolist() == [jax.devices()[2:4]]


def test_state_shardings_follow_each_parameters_declared_axes():
    state = nnx.State(
        {
            "w": nnx.Param(jnp.zeros((4, 6)), logical_axes=("embed", "mlp")),
            "b": nnx.Param(jnp.zeros((5,)), logical_axes=("mlp",)),  # 5 does not split over 2
        }
    )
    shardings = state_shardings(make_mesh(2), state)
    assert {path: s.spec for path, s in shardings.items()} == {
        ("w",): PartitionSpec(None, "tensor"),
        ("b",): PartitionSpec(None),
    }

"""sgl_jax_lora/lora/backend/base.py: LoRAMeta is a pytree whose one leaf group is the step's LoRABatch and that runs
no base GEMM; `dot_precision` asks for full precision only when every operand is float32; LoRABackend's defaults
(`prepare` wraps the batch, `apply_with_base` declines) and its abstract `apply_packed`; `make_lora_backend` builds
the backend each `--lora-backend` name stands for, with its mesh and fused-GEMM threshold, and refuses other names."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from sgl_jax_lora.lora.backend.auto import AutoBackend
from sgl_jax_lora.lora.backend.base import BACKEND_NAMES, LoRABackend, LoRAMeta, dot_precision, make_lora_backend
from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from sgl_jax_lora.lora.backend.einsum import EinsumBackend
from sgl_jax_lora.lora.backend.pallas_gpu import PallasGPUBackend
from sgl_jax_lora.lora.backend.sgmv import SgmvBackend
from sgl_jax_lora.lora.lora_batch import build_lora_batch


def batch():
    lora = build_lora_batch(np.array([2, 0, 2, 1]), 3, np.array([0.0, 1.0, 0.5], np.float32), np.array([0, 4, 8]))
    return jax.tree_util.tree_map(jnp.asarray, lora)


def test_lora_meta_is_a_pytree_of_its_batch():
    lora = batch()
    meta = LoRAMeta(lora)
    assert not meta.runs_base_gemm
    leaves, treedef = jax.tree_util.tree_flatten(meta)
    assert len(leaves) == len(jax.tree_util.tree_leaves(lora)) == 6
    rebuilt = jax.tree_util.tree_unflatten(treedef, [leaf + 1 for leaf in leaves])
    assert type(rebuilt) is LoRAMeta
    np.testing.assert_array_equal(rebuilt.batch.token_slot, np.asarray(lora.token_slot) + 1)
    # it crosses jit as an argument and as a result
    out = jax.jit(lambda m: LoRAMeta(dataclasses.replace(m.batch, token_slot=m.batch.token_slot * 2)))(meta)
    np.testing.assert_array_equal(out.batch.token_slot, [4, 0, 4, 2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.batch = lora


def test_dot_precision_is_highest_only_when_every_operand_is_float32():
    assert dot_precision(jnp.float32) == jax.lax.Precision.HIGHEST
    assert dot_precision(jnp.float32, np.float32, "float32") == jax.lax.Precision.HIGHEST
    for dtypes in [(jnp.bfloat16,), (jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32), (jnp.float16,)]:
        assert dot_precision(*dtypes) is None, dtypes


class Minimal(LoRABackend):
    """The least a backend must define: apply_packed."""

    name = "minimal"

    def apply_packed(self, x, lora_a, lora_bs, meta, base_out, *, tp_size, input_sharded=False, output_sharded=False):
        return base_out


def test_backend_defaults():
    with pytest.raises(TypeError, match="apply_packed"):
        LoRABackend()  # abstract
    mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
    backend = Minimal(mesh)
    assert backend.mesh is mesh and Minimal().mesh is None
    assert not backend.reads_stacked and LoRABackend.name == "base"
    lora = batch()
    meta = backend.prepare(lora, num_seqs=4)
    assert type(meta) is LoRAMeta and meta.batch is lora
    x = jnp.ones((4, 8))
    assert (
        backend.apply_with_base(x, jnp.ones((8, 6)), jnp.ones((3, 4, 8)), (jnp.ones((3, 6, 4)),), meta, tp_size=1)
        is None
    )


@pytest.mark.parametrize(
    ("name", "cls"),
    [("einsum", EinsumBackend), ("bgmv", BgmvBackend), ("sgmv", SgmvBackend), ("pallas", PallasGPUBackend)],
)
def test_make_lora_backend_builds_each_named_backend(name, cls):
    backend = make_lora_backend(name)
    assert type(backend) is cls and backend.name == name and backend.mesh is None
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "tensor"))
    assert make_lora_backend(name, mesh).mesh is mesh


def test_make_lora_backend_auto_and_the_fused_gemm_threshold():
    assert set(BACKEND_NAMES) == {"einsum", "bgmv", "sgmv", "pallas", "auto"}
    backend = make_lora_backend("auto", None, fused_gemm_min_tokens=256)
    assert isinstance(backend, AutoBackend) and backend.backends["pallas"].fused_gemm_min_tokens == 256
    assert make_lora_backend("pallas", None, 512).fused_gemm_min_tokens == 512
    assert make_lora_backend("pallas").fused_gemm_min_tokens == 0  # off by default on CPU (no Hopper GPU)


@pytest.mark.parametrize("name", ["", "Einsum", "xla", "pallas_gpu"])
def test_make_lora_backend_refuses_other_names(name):
    with pytest.raises(ValueError, match="unknown --lora-backend") as err:
        make_lora_backend(name)
    assert all(known in str(err.value) for known in BACKEND_NAMES)

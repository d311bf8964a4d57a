"""XlaBackend: the pure-JAX backends take the model's LayerStack views and slice the layer themselves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax_lora.layers.layer_stack import LayerStack
from sgl_jax_lora.lora.backend.base import LoRAMeta
from sgl_jax_lora.lora.backend.bgmv import BgmvBackend
from sgl_jax_lora.lora.backend.einsum import EinsumBackend
from sgl_jax_lora.lora.backend.sgmv import SgmvBackend
from sgl_jax_lora.lora.lora_batch import build_lora_batch


@pytest.mark.parametrize("backend", [EinsumBackend(None), BgmvBackend(None), SgmvBackend(None)], ids=lambda b: b.name)
def test_apply_packed_of_layer_views_equals_the_layers_slice(backend):
    rng = np.random.default_rng(0)
    lora = build_lora_batch(rng.integers(0, 3, 12).astype(np.int32), 4, np.array([0, 1, 2], np.float32), np.full(3, 8))
    meta = backend.prepare(jax.tree_util.tree_map(jnp.asarray, lora), num_seqs=12)
    assert type(meta) is LoRAMeta and not backend.reads_stacked
    a = jnp.asarray(rng.standard_normal((3, 3, 16, 32)), jnp.float32)  # [L, A, P * R, in]
    bs = tuple(jnp.asarray(rng.standard_normal((3, 3, w, 8)), jnp.float32) for w in (24, 16))
    x = jnp.asarray(rng.standard_normal((12, 32)), jnp.float32)
    base = jnp.zeros((12, 40), jnp.float32)
    layer = jnp.int32(1)
    views = jax.jit(
        lambda x, a, bs, meta, base: backend.apply_packed(
            x, LayerStack(a, layer), tuple(LayerStack(b, layer) for b in bs), meta, base, tp_size=1
        )
    )(x, a, bs, meta, base)
    sliced = backend.apply_packed(x, a[1], tuple(b[1] for b in bs), meta, base, tp_size=1)
    np.testing.assert_allclose(np.asarray(views), np.asarray(sliced), rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(sliced).max()) > 0

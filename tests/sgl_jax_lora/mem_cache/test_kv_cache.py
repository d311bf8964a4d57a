"""sgl_jax_lora/mem_cache/kv_cache.py: the cache's [L, K, N, D] layout with N = pages x page size, K = the kv heads
or, when tp exceeds them, one replicated copy per tensor shard; the bytes a token takes (checked by hand and
against the allocated buffers); the abstract cache holds no memory and the allocated one is zeros sharded on K; the
KVCache pytree goes through a jitted, donated update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from sgl_jax_lora.configs.model_config import ModelConfig
from sgl_jax_lora.layers.sharding import make_mesh
from sgl_jax_lora.mem_cache.kv_cache import KVCache, abstract_kv_cache, allocate_kv_cache, kv_bytes_per_token


def config(num_kv_heads: int = 2, num_layers: int = 3, head_dim: int = 8) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 8 * head_dim,
            "intermediate_size": 64,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 8,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
        }
    )


@pytest.mark.parametrize(
    ("kv_heads", "tp", "dtype", "expected"),
    [
        (2, 1, jnp.bfloat16, 2 * 3 * 2 * 8 * 2),  # K and V x layers x kv heads x head_dim x bytes
        (2, 2, jnp.bfloat16, 2 * 3 * 2 * 8 * 2),  # one head per shard: no copies
        (2, 4, jnp.bfloat16, 2 * 3 * 4 * 8 * 2),  # 4 shards, 2 heads: each head held twice
        (2, 8, jnp.float32, 2 * 3 * 8 * 8 * 4),
        (8, 4, jnp.float32, 2 * 3 * 8 * 8 * 4),
    ],
)
def test_bytes_per_token(kv_heads: int, tp: int, dtype, expected: int):
    assert kv_bytes_per_token(config(num_kv_heads=kv_heads), tp, dtype) == expected


@pytest.mark.parametrize(("kv_heads", "tp", "cache_heads"), [(2, 1, 2), (4, 2, 4), (2, 4, 4), (1, 8, 8)])
def test_abstract_cache_layout_and_sharding(kv_heads: int, tp: int, cache_heads: int):
    mesh = make_mesh(tp)
    cache = abstract_kv_cache(config(num_kv_heads=kv_heads), 5, 4, tp, jnp.bfloat16, mesh)
    for tensor in (cache.k, cache.v):
        assert isinstance(tensor, jax.ShapeDtypeStruct)
        assert tensor.shape == (3, cache_heads, 5 * 4, 8)
        assert tensor.dtype == jnp.bfloat16
        assert tensor.sharding.spec == PartitionSpec(None, "tensor", None, None)
        assert tensor.sharding.shard_shape(tensor.shape) == (3, cache_heads // tp, 20, 8)


def test_allocated_cache_is_zeros_sharded_on_the_kv_heads():
    mesh = make_mesh(4)
    cfg = config(num_kv_heads=2)
    cache = allocate_kv_cache(cfg, 3, 2, 4, jnp.float32, mesh)
    abstract = abstract_kv_cache(cfg, 3, 2, 4, jnp.float32, mesh)
    for tensor in (cache.k, cache.v):
        assert tensor.shape == (3, 4, 6, 8)
        assert tensor.dtype == jnp.float32
        assert tensor.sharding.is_equivalent_to(abstract.k.sharding, tensor.ndim)
        assert {shard.data.shape for shard in tensor.addressable_shards} == {(3, 1, 6, 8)}
        assert len({shard.device for shard in tensor.addressable_shards}) == 4
        assert not np.any(np.asarray(tensor))
    assert cache.k is not cache.v  # two buffers: the step donates and writes both


def test_bytes_per_token_match_the_allocated_cache():
    tp, pages, page_size = 4, 3, 4
    cfg = config(num_kv_heads=2, num_layers=2)
    cache = allocate_kv_cache(cfg, pages, page_size, tp, jnp.bfloat16, make_mesh(tp))
    total = cache.k.nbytes + cache.v.nbytes
    assert total == kv_bytes_per_token(cfg, tp, jnp.bfloat16) * pages * page_size


def test_the_cache_goes_through_a_donated_jitted_update():
    cache = allocate_kv_cache(config(num_kv_heads=2, num_layers=1, head_dim=4), 2, 2, 1, jnp.float32, make_mesh(1))
    leaves, _ = jax.tree_util.tree_flatten(cache)
    assert len(leaves) == 2

    def write(kv: KVCache, slot, value):
        return KVCache(k=kv.k.at[:, :, slot].set(value), v=kv.v.at[:, :, slot].set(-value))

    out = jax.jit(write, donate_argnums=0)(cache, 3, 1.5)
    assert isinstance(out, KVCache)
    assert np.all(np.asarray(out.k)[:, :, 3] == 1.5) and np.all(np.asarray(out.v)[:, :, 3] == -1.5)
    assert not np.any(np.asarray(out.k)[:, :, :3])
    assert cache.k.is_deleted()  # donated: its buffer now backs the result
